"""The `leantune` command line: help, flags named like the config fields, YAML configs, local data and models."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from datasets import Dataset

from .conftest import REPO, tiny_model


def leantune(*args, cwd=None, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "leantune.cli.main", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, env=env, timeout=timeout)


def test_help_lists_commands_and_sft_flags():
    top = leantune("--help")
    assert top.returncode == 0 and "sft" in top.stdout
    sft = leantune("sft", "--help")
    assert sft.returncode == 0
    for flag in ("--max_length", "--packing", "--packing_strategy", "--padding_free", "--pad_to_multiple_of",
                 "--completion_only_loss", "--assistant_only_loss", "--model_name_or_path", "--dataset_name",
                 "--use_peft", "--lora_r", "--gradient_checkpointing", "--config"):
        assert flag in sft.stdout, flag


def test_unknown_command_and_flag_fail_clearly():
    assert leantune("sfx").returncode == 2
    result = leantune("sft", "--not_a_field", "1")
    assert result.returncode != 0 and "not_a_field" in result.stderr


@pytest.fixture
def local_model_and_data(tmp_path, tokenizer, gsm8k_rows):
    model_dir = tmp_path / "tiny-llama"
    tiny_model().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data_file = tmp_path / "train.jsonl"
    with open(data_file, "w") as handle:
        for row in gsm8k_rows[:24]:
            handle.write(json.dumps({"prompt": row["question"], "completion": " " + row["answer"]}) + "\n")
    return model_dir, data_file


def test_sft_trains_a_local_model_on_a_jsonl_file_with_yaml_config(local_model_and_data, tmp_path):
    model_dir, data_file = local_model_and_data
    config = tmp_path / "sft.yaml"
    config.write_text(f"model_name_or_path: {model_dir}\ndataset_name: {data_file}\nmax_length: 64\n"
                      f"per_device_train_batch_size: 4\nmax_steps: 3\npacking: true\nreport_to: none\n")
    out = tmp_path / "out"
    result = leantune("sft", "--config", str(config), "--max_steps", "2", "--output_dir", str(out), "--use_cpu", "true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "steps: 2" in result.stdout  # the flag overrode the YAML value
    assert "real tokens/s" in result.stdout and "peak memory" in result.stdout
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


def test_sft_reads_parquet_csv_and_saved_folders(local_model_and_data, tmp_path):
    from leantune.data.loading import load_dataset_source

    rows = [{"text": f"example {i}"} for i in range(5)]
    Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    Dataset.from_list(rows).to_csv(str(tmp_path / "d.csv"))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for source in ("d.parquet", "d.csv", "saved"):
        data = load_dataset_source(str(tmp_path / source))
        assert data["train"]["text"] == [r["text"] for r in rows], source
    with pytest.raises(FileNotFoundError):
        load_dataset_source(str(tmp_path / "missing.jsonl"))


def test_demo_runs_with_no_model_or_dataset(tmp_path):
    result = leantune("sft", "--max_steps", "3", "--output_dir", str(tmp_path / "demo"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "built-in demo" in result.stdout and "exact match" in result.stdout and "steps: 3" in result.stdout
    assert (tmp_path / "demo" / "model.safetensors").exists()
