"""The transformers seam (docs/transformers_seam.md): the private methods of transformers' Trainer that leantune
still overrides or calls, pinned as the tested releases have them, and a guard that no other private method or
attribute of Trainer is overridden, called or read anywhere in leantune/.

A failure here on a new transformers release means: read Trainer's new source of the method named in the message
and what leantune relies on (the doc's table), fix leantune if needed, then add the new hash below (with the
release it was seen in)."""

from __future__ import annotations

import ast
import hashlib
import inspect
import pathlib
import re
import textwrap
import types

import datasets
import pytest
import torch
import transformers
from transformers import Trainer

import leantune
from leantune import SFTConfig, SFTTrainer
from leantune.trainers.parts import step_guards

from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model

# name -> (its parameters, {sha256 prefix of its source: the releases it was seen in}, what leantune relies on)
SEAM = {
    "_save_checkpoint": (
        ("self", "model", "trial"),
        {"cabad0a7ec83ba20": "5.17.0, 5.24.0"},
        "overridden by LeantuneTrainer (staged checkpoints): Trainer writes the whole checkpoint into "
        "`<self._get_output_dir(trial)>/checkpoint-<global_step>`, whose folder is `args.output_dir` (the staging "
        "copy's), pushes only `if self.args.push_to_hub`, and rotates within that folder"),
    "_push_from_checkpoint": (
        ("self", "checkpoint_folder"),
        {"aa70f9f2b52d05b5": "5.17.0", "b290add452483bfb": "5.24.0"},
        "called by parts/saving.py after the rename: pushes the renamed checkpoint folder (process 0, not with "
        "hub_strategy 'end')"),
    "_prepare_context_parallel_inputs": (
        ("self", "model", "inputs"),
        {"25584b8f770768e0": "5.17.0, 5.24.0"},
        "overridden (context_parallel.py's layout): called first by `training_step`, returns (context manager, "
        "inputs); Trainer's own layout must not run on leantune's batches"),
}
# Private attributes of Trainer leantune writes or reads, and what it relies on
ATTRIBUTES = {
    "_signature_columns": "written once after Trainer.__init__ (None there): the columns `_remove_unused_columns` and "
                          "`_get_collator_with_removed_columns` keep",
}
# What leantune relies on without overriding or calling it (the staging copy of args names the run's folder)
RELIED_ON = {"_get_output_dir": {"306b4b1844b9a297": "5.17.0, 5.24.0"}}
PACKAGE = pathlib.Path(leantune.__file__).parent


def trainer_source(name: str) -> str:
    """The source of Trainer's method `name` as written in transformers' trainer.py (dedented)."""
    path = inspect.getsourcefile(Trainer)
    text = pathlib.Path(path).read_text(encoding="utf-8")
    lines = text.splitlines()
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == "Trainer":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    start = min([item.lineno] + [d.lineno for d in item.decorator_list])
                    return textwrap.dedent("\n".join(lines[start - 1:item.end_lineno]))
    raise AssertionError(f"transformers {transformers.__version__}: Trainer.{name} is gone")


def source_hash(name: str) -> str:
    return hashlib.sha256(trainer_source(name).encode()).hexdigest()[:16]


def private_trainer_names() -> tuple[set[str], set[str]]:
    """(Trainer's private methods, the private attributes its source sets or reads on self)."""
    methods = {name for name in dir(Trainer) if name.startswith("_") and not name.startswith("__")}
    text = pathlib.Path(inspect.getsourcefile(Trainer)).read_text(encoding="utf-8")
    attributes = set(re.findall(r"self\.(_[a-z][A-Za-z0-9_]*)", text)) - methods
    return methods, attributes


def uses_in_leantune(names: set[str]) -> dict[str, list[str]]:
    """name -> where leantune/ defines a method of that name in a class body, or reads / writes / calls it as an
    attribute (`x._name`, getattr/setattr/hasattr(x, "_name"))."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in names:
                        found.setdefault(item.name, []).append(f"{where}:{item.lineno} (defines)")
            elif isinstance(node, ast.Attribute) and node.attr in names:
                found.setdefault(node.attr, []).append(f"{where}:{node.lineno}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
                found.setdefault(node.args[1].value, []).append(f"{where}:{node.lineno} ({node.func.id})")
    return found


@pytest.mark.parametrize("name", sorted(SEAM))
def test_each_private_method_left_is_as_the_tested_releases_have_it(name):
    parameters, hashes, relied_on = SEAM[name]
    assert tuple(inspect.signature(getattr(Trainer, name)).parameters) == parameters, (
        f"transformers {transformers.__version__} changed the signature of Trainer.{name}; leantune relies on it: "
        f"{relied_on} (docs/transformers_seam.md)")
    found = source_hash(name)
    assert found in hashes, (
        f"transformers {transformers.__version__} changed Trainer.{name} (source hash {found}, tested: {hashes}). "
        f"leantune relies on it: {relied_on}. Read the new source, check the tests of what it guards "
        f"(test_resume.py, test_nonfinite.py, test_saved_artifacts.py, the context-parallel tests), then add "
        f"{found!r} to SEAM here (docs/transformers_seam.md).")


@pytest.mark.parametrize("name", sorted(RELIED_ON))
def test_what_the_seam_relies_on_is_unchanged(name):
    found = source_hash(name)
    assert found in RELIED_ON[name], (
        f"transformers {transformers.__version__} changed Trainer.{name} (hash {found}): the staged checkpoint's "
        "copy of args must still name the folder Trainer's _save_checkpoint writes into (parts/saving.py).")


def test_training_step_lays_out_context_parallel_batches_through_the_hook_first():
    source = trainer_source("training_step")
    assert "self._prepare_context_parallel_inputs(model, inputs)" in source
    assert source.index("_prepare_context_parallel_inputs") < source.index("self.compute_loss(")
    # without context parallelism Trainer's own hook hands the batch back as it is
    fake = types.SimpleNamespace(accelerator=types.SimpleNamespace(parallelism_config=None))
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long)}
    context, laid = Trainer._prepare_context_parallel_inputs(fake, None, batch)
    assert laid is batch
    with context():
        pass


def test_push_from_checkpoint_pushes_from_process_zero_only():
    fake = types.SimpleNamespace(is_world_process_zero=lambda: False)
    assert Trainer._push_from_checkpoint(fake, "/nonexistent/checkpoint-1") is None  # touches nothing


def test_signature_columns_written_once_are_what_trainer_keeps():
    class Fake:
        _set_signature_columns_if_needed = Trainer._set_signature_columns_if_needed
        _remove_unused_columns = Trainer._remove_unused_columns
        args = types.SimpleNamespace(remove_unused_columns=True)
        model = torch.nn.Linear(1, 1)

    fake = Fake()
    fake._signature_columns = ["prompt_ids", "leantune_row_index"]
    dataset = datasets.Dataset.from_dict({"prompt_ids": [[1]], "other": [0], "leantune_row_index": [0]})
    assert Trainer._remove_unused_columns(fake, dataset).column_names == ["prompt_ids", "leantune_row_index"]
    assert fake._signature_columns == ["prompt_ids", "leantune_row_index"]


def test_no_other_private_method_or_attribute_of_trainer_is_used():
    methods, attributes = private_trainer_names()
    assert {"_save", "_run_epoch", "_get_num_items_in_batch", "_prepare_inputs"} <= methods  # the scan sees them
    found = uses_in_leantune(methods | attributes)
    allowed = set(SEAM) | set(ATTRIBUTES)
    assert set(found) <= allowed, {name: where for name, where in found.items() if name not in allowed}
    assert set(found) == allowed, f"a seam entry no longer used: {allowed - set(found)} (docs/transformers_seam.md)"


def test_the_scan_finds_an_override_a_call_and_a_read(tmp_path, monkeypatch):
    package = tmp_path / "leantune"
    package.mkdir()
    (package / "sample.py").write_text(
        "class T:\n    def _run_epoch(self):\n        return self._prepare_inputs({})\n\n"
        "def f(t):\n    return getattr(t, '_initial_global_step', 0)\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", package)
    found = uses_in_leantune({"_run_epoch", "_prepare_inputs", "_initial_global_step"})
    assert set(found) == {"_run_epoch", "_prepare_inputs", "_initial_global_step"}


def test_the_step_check_sees_the_norm_transformers_computed(gsm8k_rows, tokenizer, tmp_path, monkeypatch):
    """step_guards.py (GradientCheck): transformers computes each step's gradient norm through accelerate's public
    `clip_grad_norm_`, which the check keeps; the check's own computation is never needed."""
    computed = []
    monkeypatch.setattr(step_guards, "gradient_norm", lambda model: computed.append(1) or torch.tensor(0.0))
    checked = []
    for max_grad_norm in (1.0, 0.0):  # clipping, or the norm for the log only
        args = SFTConfig(output_dir=str(tmp_path), max_length=64, report_to=[], save_strategy="no", use_cpu=True,
                         per_device_train_batch_size=2, max_steps=2, logging_steps=1, max_grad_norm=max_grad_norm,
                         memory_breakdown=False)
        trainer = SFTTrainer(model=tiny_model(), args=args, processing_class=tokenizer,
                             train_dataset=gsm8k_prompt_completion(gsm8k_rows, 4))
        trainer.nonfinite.check_step = lambda model, norm, check=trainer.nonfinite.check_step: (
            checked.append(float(norm)) or check(model, norm))
        trainer.train()
        logged = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
        assert checked[-2:] == pytest.approx(logged) and all(norm > 0 for norm in logged)
    assert not computed
