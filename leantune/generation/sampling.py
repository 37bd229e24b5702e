"""What a generation round asks of any backend: how many new tokens and how to sample them (TRL's field names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None or 0: no top-k filter
    min_p: float | None = None
    repetition_penalty: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    extra: dict = field(default_factory=dict)  # generation_kwargs, passed through to the backend as they are
    # Set by the trainer per round and process: completion i of the round samples with seed + i, so processes (and
    # the repeats of one prompt on one process) never draw the same sample stream; None: the backend's own RNG.
    seed: int | None = None

    @classmethod
    def from_config(cls, args, tokenizer, model=None) -> SamplingSettings:
        """The tokenizer's EOS and the model's generation-config EOS ids (chat models end turns with their own)."""
        eos_ids = _ids(tokenizer.eos_token_id)
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            eos_ids += tuple(i for i in _ids(generation_config.eos_token_id) if i not in eos_ids)
        return cls(
            max_new_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k or None,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            eos_token_ids=eos_ids,
            pad_token_id=tokenizer.pad_token_id,
            extra=dict(args.generation_kwargs or {}),
        )


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def cut_at_eos(tokens: list[int], eos_token_ids: tuple[int, ...]) -> list[int]:
    """A completion ends at (and keeps) its first EOS token; what a backend produced after it is dropped."""
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: i + 1]
    return tokens
