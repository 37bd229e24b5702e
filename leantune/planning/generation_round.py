"""An online method's generation round in the plan, beside the update step the trace measures.

The round runs before its update steps and frees its cache before they start, so the two do not overlap: the run's
peak is the larger. With transformers' `generate` the round holds what stays live between steps (parameters,
buffers, optimizer states, frozen models) plus the KV cache of the round's sequences at full length (per layer, keys
and values: 2 x batch x kv_heads x (prompt + max_completion_length) x head_dim x dtype bytes), one layer's keys again
while the cache grows (each step's `torch.cat` holds the old and the new tensor), and one decode step's logits (the
model's, and transformers' fp32 copy of them). A colocated vLLM engine instead reserves its pool at start (a device
term: `vllm_gpu_memory_utilization` of the device), and its sleep mode keeps the weights in CPU memory while it sleeps
(a host figure, not device memory).

With `max_completions_per_generate` transformers generates the round in pieces of whole prompt groups, one after
another, each freeing its cache before the next: the round's figures are those of its largest piece.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..data.prompt_preparation import PROMPT_IDS

MIB = 1024 * 1024
HELD_PARTS = ("parameters", "buffers", "optimizer_states", "frozen_models")  # live between update steps


@dataclass
class GenerationRound:
    """One generation round per process, planned: bytes beside what the update steps leave live (`held_bytes`)."""

    backend: str  # "transformers" or "vllm"
    batch: int  # sequences generated at once (one `generate` call: the round, or its largest piece)
    length: int  # prompt + max_completion_length tokens
    kv_cache_bytes: int  # transformers' cache at full length, plus one layer's keys while it grows
    decode_logits_bytes: int
    held_bytes: int
    host_copy_bytes: int = 0  # vLLM sleep mode: the weights kept in CPU memory
    prompt_length: int = 0  # the longest prepared prompt (the rest of `length` is max_completion_length)
    round_sequences: int = 0  # the round's sequences per process (more than `batch` when generated in pieces)

    @property
    def peak_bytes(self) -> int:
        """The round's peak on the training device (a colocated vLLM pool is a device term of its own)."""
        return self.held_bytes + self.kv_cache_bytes + self.decode_logits_bytes

    def with_batch(self, batch: int) -> GenerationRound:
        """The same round generated `batch` sequences per call: the cache and the logits are per sequence."""
        if self.backend != "transformers":
            return self
        return dataclasses.replace(self, batch=batch, kv_cache_bytes=self.kv_cache_bytes // self.batch * batch,
                                   decode_logits_bytes=self.decode_logits_bytes // self.batch * batch)

    def lines(self) -> list[str]:
        pieces = f", {self.batch} per generate call" if self.batch < self.round_sequences else ""
        out = [f"generation round ({self.backend}, {max(self.batch, self.round_sequences)} sequences of up to "
               f"{self.length} tokens per process{pieces}): {self.peak_bytes / MIB:.2f} MiB"]
        if self.backend == "transformers":
            out += [f"  {'KV cache':<17} {self.kv_cache_bytes / MIB:.2f} MiB",
                    f"  {'decode logits':<17} {self.decode_logits_bytes / MIB:.2f} MiB",
                    f"  {'held':<17} {self.held_bytes / MIB:.2f} MiB (parameters, buffers, optimizer states, "
                    "frozen models)"]
        if self.host_copy_bytes:
            out.append(f"  host memory while vLLM sleeps: {self.host_copy_bytes / MIB:.2f} MiB (the weights, "
                       "vllm_enable_sleep_mode)")
        return out


def kv_cache_bytes(config, batch: int, length: int, dtype: torch.dtype) -> int:
    """transformers' DynamicCache at `length` tokens for `batch` sequences, plus one layer's keys held twice by the
    `torch.cat` that grows it."""
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    one_layer_keys = batch * kv_heads * length * head_dim * _bytes_of(dtype)
    return config.num_hidden_layers * 2 * one_layer_keys + one_layer_keys


def decode_logits_bytes(config, batch: int, dtype: torch.dtype) -> int:
    """One decode step's logits for the last position: the model's, and the fp32 copy transformers samples from."""
    config = getattr(config, "text_config", None) or config
    return batch * config.vocab_size * (_bytes_of(dtype) + 4)


def round_shape_of(trainer) -> dict:
    """What sizes an online trainer's round: sequences per process and per `generate` call, the longest prompt, the
    completion limit and the backend (read from the planned trainer: its resolved config and prepared prompts)."""
    args = trainer.args
    prompts = trainer.train_dataset[PROMPT_IDS] if PROMPT_IDS in trainer.train_dataset.column_names else [[]]
    whole = max(trainer.round_size // trainer.accelerator.num_processes, 1)
    return {"batch": min(whole, getattr(args, "max_completions_per_generate", None) or whole), "round": whole,
            "prompt_length": max(len(prompt) for prompt in prompts),
            "max_completion_length": int(args.max_completion_length), "use_vllm": trainer.generation.samples_with_vllm,
            "sleep_mode": bool(getattr(args, "vllm_enable_sleep_mode", False))}


def generation_round(config, shape: dict, dtype: torch.dtype, held_bytes: int, num_parameters: int) -> GenerationRound:
    """The round of `round_shape_of`'s shape for a model of `config` in `dtype`."""
    batch, length = shape["batch"], shape["prompt_length"] + shape["max_completion_length"]
    whole = shape.get("round", batch)
    if shape["use_vllm"]:
        host = num_parameters * _bytes_of(dtype) if shape["sleep_mode"] else 0
        return GenerationRound("vllm", whole, length, 0, 0, held_bytes, host, shape["prompt_length"], whole)
    return GenerationRound("transformers", batch, length, kv_cache_bytes(config, batch, length, dtype),
                           decode_logits_bytes(config, batch, dtype), held_bytes, 0, shape["prompt_length"], whole)


def held_between_steps(parts: dict) -> int:
    """What an update step's breakdown holds before and after it: the round sits on top of that."""
    return sum(parts.get(name, 0) for name in HELD_PARTS)


def _bytes_of(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
