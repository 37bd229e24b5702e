"""pytest's registrations only: the thread budget, Triton's interpreter for the Liger tests, the collector's frozen
imports, the quick tier's check (tests/quick_tier.py), and the shared fixtures (built by tests/fixtures/, which the
test modules import; nothing imports this file)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

# At most 2 threads per test process; under pytest-xdist the threads asked for (OMP_NUM_THREADS, else the cores) are
# shared among the workers, so two workers on 2 cores do not each spin 2 OpenMP threads (measured: the whole suite
# spent 12.5 of its 39 CPU minutes in the kernel that way). OMP_NUM_THREADS=4 still gives each worker 2 threads.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads() // _WORKERS)))

# Before anything imports triton: Liger's kernels on CPU need Triton's interpreter from the start (devkit/liger_cpu.py)
from devkit.liger_cpu import hide_interpreter, interpreter_on_for_imports, keep_interpreter  # noqa: E402

interpreter_on_for_imports(cuda=torch.cuda.is_available())

from . import quick_tier  # noqa: E402
from .fixtures import data, paths, tokenizers  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "liger_interpreter: runs with TRITON_INTERPRET=1 (Liger's kernels on CPU)")
    quick_tier.register(config)


def pytest_collection_finish(session):
    """The imports of collection (~560k objects: torch, transformers, leantune) leave the cyclic collector's full scans.
    Every Trainer.train() runs one (accelerate's free_memory), ~0.3 s each over them: measured in tests/planning/
    test_plan_qlora.py, test_plan_engines.py and test_memory_budget.py, 16.3 s of full collections, 2.9 s frozen.
    Only what is live after a collection is frozen, and only imports are live then: what tests make is collected as
    before."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # the exit's own collection as before (frozen objects left to it make nanobind report leaks)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the node ids: after it, a
def pytest_collection_modifyitems(config, items):  # group marked here was ignored and its fixtures ran on each worker
    """`--dist loadgroup` (pyproject.toml) spreads the tests one by one over the workers, except the tests of a file
    with module- or session-scoped fixtures of its own (multi-process runs, TRL's scripts, a served model) or with
    Liger's interpreter: those stay together on one worker, so their fixtures are computed once. xdist hands out the
    groups first (largest first) and the single tests last, in collection order: the single tests marked slow are
    moved to the front of them, so that no long one starts last (a group's own order is kept)."""
    grouped = set()
    for item in items:
        path = item.nodeid.split("::")[0]
        fixture_info = getattr(item, "_fixtureinfo", None)  # a test function's (pytest's own record of it)
        own_wide_fixtures = fixture_info is not None and any(
            definition.scope in ("module", "session") and definition.baseid == path
            for definitions in fixture_info.name2fixturedefs.values() for definition in definitions)
        if own_wide_fixtures or item.get_closest_marker("liger_interpreter") is not None:
            item.add_marker(pytest.mark.xdist_group(path))
            grouped.add(item.nodeid)
    items.sort(key=lambda item: item.nodeid in grouped or item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _interpreter_only_for_liger_tests(request, monkeypatch):
    if request.node.get_closest_marker("liger_interpreter") is None:
        hide_interpreter(monkeypatch)
    else:
        keep_interpreter(monkeypatch)


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    return paths.require(paths.TOKENIZER_DIR)


@pytest.fixture(scope="session")
def _session_tokenizer(tokenizer_dir):
    return tokenizers.load_tokenizer(tokenizer_dir)


@pytest.fixture
def tokenizer(_session_tokenizer):
    """The real 32k tokenizer, a copy of its own for each test (tests change templates and tokens)."""
    return tokenizers.fresh_copy(_session_tokenizer)


@pytest.fixture(scope="module")
def char_tokenizer():
    """The built-in demo's character tokenizer (~100 tokens): the online trainers' tiny models."""
    from leantune.defaults import build_default_tokenizer

    return build_default_tokenizer()


@pytest.fixture(scope="session")
def gsm8k_rows() -> list[dict]:
    return data.gsm8k_rows(400)


@pytest.fixture(scope="module")
def hh_pairs(request):
    """The first HH-RLHF pairs as a Dataset: `HH_PAIRS_ROWS` of them, a constant of the test module (default 16)."""
    return data.hh_pairs(getattr(request.module, "HH_PAIRS_ROWS", 16))
