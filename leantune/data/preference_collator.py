"""Batches of preference pairs: the chosen sequences of the batch, then the rejected ones, in any layout.

Each pair gives two sequences, prompt + chosen and prompt + rejected, whose completion tokens are the targets. They
are collated by `CausalLMCollator`, so padded and padding-free batches have exactly the layouts (and the targets)
of SFT: padded rows [2 x pairs, longest], or one flat row with restarting position_ids and sequence offsets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .collators import CausalLMCollator, prompt_completion_row, sequence_starts  # noqa: F401  (sequence_starts: its old home)

REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


@dataclass
class PreferenceCollator:
    pad_token_id: int
    padding_free: bool = False
    pad_to_multiple_of: int | None = None
    sequences: CausalLMCollator = field(init=False)

    def __post_init__(self):
        self.sequences = CausalLMCollator(self.pad_token_id, ("completion_mask",), self.padding_free,
                                          self.pad_to_multiple_of)

    def __call__(self, pairs: list[dict]) -> dict[str, torch.Tensor]:
        # Whole-sequence pairs (the reward trainer's) have no `prompt_ids`.
        sequences = [prompt_completion_row(pair.get("prompt_ids", ()), pair[f"{side}_ids"])
                     for side in ("chosen", "rejected") for pair in pairs]
        batch = self.sequences(sequences)
        batch["num_pairs"] = torch.tensor(len(pairs))
        for name in REFERENCE_COLUMNS:
            if name in pairs[0]:
                batch[name] = torch.tensor([float(pair[name]) for pair in pairs], dtype=torch.float32)
        return batch




