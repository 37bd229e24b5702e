"""Generation with transformers' `generate`, from the training model itself (the default; runs on CPU).

The policy generates in eval mode (no dropout, no activation checkpointing) with the KV cache on, on left-padded
prompts, and goes back to training mode after. Nothing needs syncing: it is the training model.
"""

from __future__ import annotations

import torch

from .sampling import SamplingSettings, cut_at_eos
from .zero3 import gathered_for_generation


class TransformersBackend:
    name = "transformers"

    def __init__(self, model, accelerator, gather_for_generation: bool = True, max_batch_size: int | None = None):
        self.accelerator = accelerator
        self.gather_for_generation = gather_for_generation
        self.max_batch_size = max_batch_size
        self.model = model

    def sync_weights(self, model) -> None:
        self.model = model

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSettings) -> list[list[int]]:
        model = self.model
        was_training = model.training
        model.eval()
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        try:
            with torch.random.fork_rng(devices=devices, enabled=sampling.seed is not None), \
                    gathered_for_generation(model, self.accelerator, self.gather_for_generation):
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)  # the round's own stream; each row samples its own tokens
                generator = self.accelerator.unwrap_model(model)  # a PEFT model stays one (its generate)
                step = self.max_batch_size or len(prompt_ids)
                out = []
                for start in range(0, len(prompt_ids), step):
                    out += self._generate_batch(generator, prompt_ids[start:start + step], sampling)
                return out
        finally:
            model.train(was_training)

    def _generate_batch(self, model, prompt_ids: list[list[int]], sampling: SamplingSettings) -> list[list[int]]:
        device = next(model.parameters()).device
        width = max(len(ids) for ids in prompt_ids)
        pad = sampling.pad_token_id if sampling.pad_token_id is not None else 0
        input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for row, ids in enumerate(prompt_ids):
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids):] = 1
        kwargs = {
            "max_new_tokens": sampling.max_new_tokens,
            "do_sample": sampling.temperature > 0,  # temperature 0: greedy, as in vLLM
            "temperature": sampling.temperature or None,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or 0,
            "repetition_penalty": sampling.repetition_penalty,
            "pad_token_id": pad,
            "eos_token_id": list(sampling.eos_token_ids) or None,
            "use_cache": True,
        }
        if sampling.min_p is not None:
            kwargs["min_p"] = sampling.min_p
        kwargs.update(sampling.extra)
        output = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs)
        new_tokens = output[:, width:].tolist()
        return [cut_at_eos(tokens, sampling.eos_token_ids) for tokens in new_tokens]
