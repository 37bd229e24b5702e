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
    # Return each sampled token's log-probability under the distribution it was drawn from (`Completions.logprobs`):
    # the logits after temperature, top-k/top-p/min-p filtering and repetition penalty (vLLM's "processed" log-probs).
    logprobs: bool = True

    @classmethod
    def from_config(cls, args, tokenizer, model=None) -> SamplingSettings:
        """The tokenizer's EOS and the model's generation-config EOS ids (chat models end turns with their own)."""
        eos_ids = eos_token_ids(tokenizer, model)
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
            logprobs=bool(getattr(args, "needs_sampling_logprobs", False)),  # read only by GRPO's vLLM correction
        )


def eos_token_ids(tokenizer, model=None) -> tuple[int, ...]:
    """The tokenizer's EOS and the model's generation-config EOS ids (chat models end turns with their own)."""
    eos_ids = _ids(tokenizer.eos_token_id)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        eos_ids += tuple(i for i in _ids(generation_config.eos_token_id) if i not in eos_ids)
    return eos_ids


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


class Completions(list):
    """What `generate` returns: the completions' token ids (a list of lists, compared and sliced as one) and, in
    `logprobs`, one list per completion of its tokens' sampling log-probs (float('nan') where the engine reported
    none), or None when the sampling settings did not ask for them."""

    def __init__(self, ids=(), logprobs: list[list[float]] | None = None):
        super().__init__(ids)
        if logprobs is not None and [len(lp) for lp in logprobs] != [len(t) for t in self]:
            raise ValueError(f"sampling log-probs do not match the completions' lengths: "
                             f"{[len(lp) for lp in logprobs]} vs {[len(t) for t in self]}")
        self.logprobs = logprobs


def cut_completion(tokens: list[int], logprobs: list[float] | None, sampling: SamplingSettings):
    """A completion and its log-probs cut at max_new_tokens and after the first EOS (the same tokens kept)."""
    kept = cut_at_eos(list(tokens)[: sampling.max_new_tokens], sampling.eos_token_ids)
    return kept, None if logprobs is None else [float(v) for v in logprobs[: len(kept)]]


def cut_at_eos(tokens: list[int], eos_token_ids: tuple[int, ...]) -> list[int]:
    """A completion ends at (and keeps) its first EOS token; what a backend produced after it is dropped."""
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: i + 1]
    return tokens
