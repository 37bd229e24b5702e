"""No secret in the output (issue 39, item 7): a Hub token given to a run is in no file it leaves (checkpoints'
and the final model's training_args.bin, which push_to_hub uploads, and model cards), while the run keeps it."""

from __future__ import annotations

from pathlib import Path

import torch

from leantune import SFTConfig, SFTTrainer

from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model

SECRET = "hf_leantuneTestSecret0123456789"


def test_a_hub_token_is_in_no_saved_file(tokenizer, gsm8k_rows, tmp_path):
    args = SFTConfig(output_dir=str(tmp_path / "run"), hub_token=SECRET, max_steps=2, save_steps=1, max_length=64,
                     per_device_train_batch_size=2, use_cpu=True, report_to=[], disable_tqdm=True,
                     memory_breakdown=False, seed=0)
    trainer = SFTTrainer(tiny_model(), args=args, train_dataset=gsm8k_prompt_completion(gsm8k_rows, 4),
                         processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    assert trainer.args.hub_token == SECRET  # the run itself keeps its credential
    folders = [tmp_path / "run" / "checkpoint-1", tmp_path / "run" / "checkpoint-2", tmp_path / "run"]
    for folder in folders:
        saved = torch.load(folder / "training_args.bin", weights_only=False)
        assert saved.hub_token is None and saved.max_steps == 2, folder  # the config, without its credential
    holding = [path for path in Path(tmp_path).rglob("*") if path.is_file() and SECRET.encode() in path.read_bytes()]
    assert not holding, f"the Hub token was written into {holding}"
