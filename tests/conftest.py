"""Shared fixtures: the real tokenizer and datasets kept in tests/data, and tiny models built from configs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# Slices of the full-size data, with their licences (tests/data/README.md): the suite needs nothing beside the clone.
DATA = REPO / "tests" / "data" / "shared"  # laid out as shared/ is
TOKENIZER_DIR = DATA / "tokenizers" / "mistral-7b-v0.1"
GSM8K_TRAIN = DATA / "data" / "gsm8k" / "train.jsonl"
HH_PAIRS = DATA / "data" / "hh-rlhf-harmless" / "test.jsonl.gz"

# At most 2 threads per test process; under pytest-xdist the threads asked for (OMP_NUM_THREADS, else the cores) are
# shared among the workers, so two workers on 2 cores do not each spin 2 OpenMP threads (measured: the whole suite
# spent 12.5 of its 39 CPU minutes in the kernel that way). OMP_NUM_THREADS=4 still gives each worker 2 threads.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads() // _WORKERS)))

# Before anything imports triton: Liger's kernels on CPU need Triton's interpreter from the start (tests/liger_cpu.py)
from .liger_cpu import hide_interpreter, interpreter_on_for_imports  # noqa: E402

interpreter_on_for_imports(cuda=torch.cuda.is_available())


def pytest_configure(config):
    config.addinivalue_line("markers", "liger_interpreter: runs with TRITON_INTERPRET=1 (Liger's kernels on CPU)")


@pytest.fixture(autouse=True)
def _interpreter_only_for_liger_tests(request, monkeypatch):
    if request.node.get_closest_marker("liger_interpreter") is None:
        hide_interpreter(monkeypatch)


def _require(path: Path) -> Path:
    assert path.exists(), f"test fixture missing from the repository: {path}"
    return path


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    return _require(TOKENIZER_DIR)


@pytest.fixture
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def gsm8k_rows() -> list[dict]:
    with open(_require(GSM8K_TRAIN), encoding="utf-8") as handle:
        return [json.loads(line) for _, line in zip(range(400), handle)]


def gsm8k_prompt_completion(rows, n):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["question"], "completion": " " + r["answer"]} for r in rows[:n]])


def tiny_model(arch: str = "llama", vocab_size: int = 32000, attn_implementation: str = "sdpa", seed: int = 0):
    """A 2-layer model of a real architecture, random weights, fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, attn_implementation=attn_implementation))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, attn_implementation=attn_implementation))
    else:
        raise ValueError(arch)
    return model.float()


def saved_model_and_data(folder: Path, tokenizer, rows: list[dict]) -> tuple[Path, Path]:
    """A saved tiny model (with the real tokenizer) and a GSM8K prompt/completion JSONL file, as the CLI reads them."""
    model_dir = folder / "tiny-llama"
    tiny_model().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data_file = folder / "train.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": r["question"], "completion": " " + r["answer"]}) + "\n"
                                 for r in rows))
    return model_dir, data_file
