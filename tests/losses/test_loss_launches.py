"""The ops one SFT and one DPO step launch around their loss (devkit/loss_ops.py: everything of `training_step` but the
model's decoder, views and allocations left out), held at a ceiling: the CPU's count is the proxy for a GPU's kernel
launches (issue 38 item 5), and each op the chunked head runs per chunk runs again for every chunk.

The ceilings are the counts measured at this change (SFT 272, DPO 434) plus a headroom smaller than one op per chunk
(9 chunks in SFT's step here; DPO's policy and reference take 12 each), so a new metric or check of a few ops passes
and any new per-chunk op fails. The code before it counted SFT 380, DPO 578 here (the per-chunk copies, the
index-put of the one-hot, the unit scale, two ops per row maximum, the recorded projection graph's copy, the
upstream's negation per chunk and the targets' ranks that only LD-DPO reads).
"""

from __future__ import annotations

import pytest

from devkit.loss_ops import loss_region_ops
from leantune import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model

HH_PAIRS_ROWS = 16
CHUNK_ROWS = 16  # several chunks at this size's few hundred targets, as Qwen2.5-0.5B's 1,024 tokens make 10 on CPU
COMMON = dict(report_to=[], save_strategy="no", use_cpu=True, max_steps=1, per_device_train_batch_size=2,
              memory_breakdown=False, disable_tqdm=True, seed=0, loss_chunk_size=CHUNK_ROWS)
SFT_CEILING = 280  # measured 272; 9 chunks
DPO_CEILING = 445  # measured 434; 12 chunks


def first_batch(trainer):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(2)])


def chunks(trainer, batch, key: str) -> int:
    targets = int((batch[key][:, 1:] != -100).sum())
    return -(-targets // CHUNK_ROWS)


@pytest.mark.quick
def test_sft_step_launches_at_most_its_ceiling_around_the_loss(tokenizer, gsm8k_rows, tmp_path):
    trainer = SFTTrainer(model=tiny_model(), processing_class=tokenizer, train_dataset=gsm8k_prompt_completion(
        gsm8k_rows, 4), args=SFTConfig(output_dir=str(tmp_path), max_length=128, **COMMON))
    batch = first_batch(trainer)
    counted = loss_region_ops(trainer, batch)
    assert chunks(trainer, batch, "labels") == 9  # the per-chunk ops are what the ceiling holds
    assert counted.by_name["mm"] >= 3 and counted.by_name["addmm_"] == 9  # the head's matmuls were counted
    assert counted.count <= SFT_CEILING, dict(counted.by_name.most_common())


def test_dpo_step_launches_at_most_its_ceiling_around_the_loss(tokenizer, hh_pairs, tmp_path):
    trainer = DPOTrainer(model=tiny_model(), processing_class=tokenizer, train_dataset=hh_pairs,
                         args=DPOConfig(output_dir=str(tmp_path), max_length=192, **COMMON))
    batch = first_batch(trainer)
    counted = loss_region_ops(trainer, batch)
    assert chunks(trainer, batch, "labels") == 12
    assert counted.by_name["log_sigmoid_forward"] == 1  # the DPO loss itself was counted
    assert counted.count <= DPO_CEILING, dict(counted.by_name.most_common())
