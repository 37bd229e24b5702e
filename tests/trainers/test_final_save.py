"""The final model staged and moved in (trainers/parts/model_files.py): a real process killed with SIGKILL at many
moments of `save_model(output_dir)` leaves output_dir loading the old final model or the new one, exactly, every
file whole; checkpoint-N and the logs beside it untouched. The order of the moves keeps the weights one set when the
new save changes their layout (one file <-> shards, a shard index reused, full model <-> adapter).

Exactness: the weights loaded are compared with torch.equal to the two saved versions: a file cut short or half of
one version's shards cannot load equal to either.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
import torch

from leantune import SFTConfig, SFTTrainer
from leantune.trainers.parts import model_files

from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import lora, tiny_model

SLOW_STEP_S = 0.01  # each rename or removal of the save slowed so that kills land between them


def _trainer(out, tokenizer, rows, peft: bool):
    args = SFTConfig(output_dir=str(out), max_length=64, report_to=[], use_cpu=True, disable_tqdm=True,
                     memory_breakdown=False, max_steps=1)
    return SFTTrainer(model=tiny_model(), args=args, processing_class=tokenizer,
                      train_dataset=gsm8k_prompt_completion(rows, 2), peft_config=lora(True) if peft else None)


def _trainable(trainer) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in trainer.model.named_parameters() if param.requires_grad}


def _saved(out, peft: bool) -> dict[str, torch.Tensor]:
    """What output_dir loads as: the full model by transformers, or the adapter as PEFT reads it (its config too)."""
    if peft:
        from peft import PeftConfig
        from peft.utils import load_peft_weights

        PeftConfig.from_pretrained(str(out))
        return load_peft_weights(str(out), device="cpu")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(out)).state_dict()


def _which(saved: dict, versions: list[dict]) -> int:
    """The index of the version `saved` equals, every tensor exactly, else -1 (PEFT saves its tensors without the
    adapter's name)."""
    for index, version in enumerate(versions):
        plain = {name.replace(".default.", "."): tensor for name, tensor in version.items()}
        if plain.keys() <= saved.keys() and all(torch.equal(tensor, saved[name]) for name, tensor in plain.items()):
            return index
    return -1


def _slow_weights_write(tensors, filename, metadata=None) -> None:
    """safetensors' save_file as a slow disk writes it: half the bytes, a pause, the rest (a kill in the pause cuts
    the file short, as a kill during any large write does)."""
    from safetensors.torch import save

    data = save(tensors, metadata=metadata)
    with open(filename, "wb") as handle:
        handle.write(data[: len(data) // 2])
        handle.flush()
        time.sleep(5 * SLOW_STEP_S)
        handle.write(data[len(data) // 2:])


def _forked_save(trainer, out, kill_after: float | None) -> float:
    """Fork a process that saves the final model, slowed at each rename and removal; SIGKILL it after `kill_after`
    seconds (None: let it finish). Returns the seconds it ran."""
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: save, then leave at once (no pytest teardown in a forked copy)
        try:
            replace, remove = os.replace, os.remove
            os.replace = lambda *a: (time.sleep(SLOW_STEP_S), replace(*a))[1]
            os.remove = lambda *a: (time.sleep(SLOW_STEP_S), remove(*a))[1]
            import peft.peft_model
            import transformers.modeling_utils

            transformers.modeling_utils.safe_save_file = peft.peft_model.safe_save_file = _slow_weights_write
            trainer.save_model(str(out))
        finally:
            os._exit(0)
    if kill_after is not None:
        time.sleep(kill_after)
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return time.perf_counter() - started


def _set(trainer, version: dict) -> None:
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if param.requires_grad:
                param.copy_(version[name])


@pytest.mark.parametrize("peft", [False, True], ids=["full", "peft"])
def test_a_final_save_killed_at_any_moment_leaves_the_old_model_or_the_new_one(tokenizer, gsm8k_rows, tmp_path, peft):
    out = tmp_path / "out"
    trainer = _trainer(out, tokenizer, gsm8k_rows, peft)
    (out / "checkpoint-1").mkdir(parents=True)
    (out / "checkpoint-1" / "trainer_state.json").write_text('{"global_step": 1}')
    (out / "runs").mkdir()
    (out / "runs" / "events.log").write_text("logged")
    versions = [_trainable(trainer)]
    with torch.no_grad():
        for param in trainer.model.parameters():
            if param.requires_grad:
                param.add_(0.5)
    versions.append(_trainable(trainer))
    trainer.save_model(str(out))  # version 1 on disk, whole
    _set(trainer, versions[0])
    whole_save_s = _forked_save(trainer, out, None)  # version 0: the time of one slowed save
    assert _which(_saved(out, peft), versions) == 0
    on_disk, rng, outcomes = 0, random.Random(0), []
    for _ in range(12):
        new = 1 - on_disk
        _set(trainer, versions[new])
        _forked_save(trainer, out, rng.uniform(0.0, whole_save_s))
        found = _which(_saved(out, peft), versions)
        assert found in (on_disk, new), f"output_dir loads neither the old model nor the new one: {os.listdir(out)}"
        outcomes.append("new" if found == new else "old")
        on_disk = found
    assert {"old", "new"} <= set(outcomes), outcomes  # kills landed before and after the switch
    assert (out / "checkpoint-1" / "trainer_state.json").read_text() == '{"global_step": 1}'
    assert (out / "runs" / "events.log").read_text() == "logged"
    trainer.save_model(str(out))  # after the kills a save completes, the staging folder of a cut one replaced
    assert not (out / model_files.STAGED_MODEL).exists()
    assert _which(_saved(out, peft), versions) == new  # the weights the trainer holds


def _write(folder, name, text):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)


def _index(folder, shards: dict[str, str]):
    _write(folder, "model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": shards}))


@pytest.mark.quick
def test_moves_keep_one_set_of_weights_when_the_layout_changes(tmp_path, monkeypatch):
    """Each rename or removal of publish_model, replayed: what transformers would load after it (a single
    model.safetensors before an index; adapter_config.json before both) is always all old or all new."""
    target, staged = tmp_path / "out", tmp_path / "out" / model_files.STAGED_MODEL
    _write(target, "model.safetensors", "old")  # an old single file; the new model comes in two shards
    _write(target, "config.json", "old")
    _write(target / "checkpoint-3", "trainer_state.json", "{}")
    _write(staged, "model-00001-of-00002.safetensors", "new")
    _write(staged, "model-00002-of-00002.safetensors", "new")
    _index(staged, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    _write(staged, "config.json", "new")
    loads = []
    real_replace, real_remove = os.replace, os.remove

    def loaded():
        if (target / "adapter_config.json").exists():
            return {"adapter:" + (target / "adapter_model.safetensors").read_text()}
        if (target / "model.safetensors").exists():
            return {(target / "model.safetensors").read_text()}
        index = json.loads((target / "model.safetensors.index.json").read_text())
        return {(target / shard).read_text() for shard in index["weight_map"].values()}

    def step(action):
        def run(*args):
            action(*args)
            loads.append(loaded())
        return run

    monkeypatch.setattr(model_files.os, "replace", step(real_replace))
    monkeypatch.setattr(model_files.os, "remove", step(real_remove))
    model_files.publish_model(str(staged), str(target))
    assert all(len(seen) == 1 for seen in loads), loads  # never a mix of shards
    assert loads[-1] == {"new"} and not (target / "model.safetensors").exists()
    assert (target / "checkpoint-3" / "trainer_state.json").exists() and not staged.exists()

    # sharded again, same shard names: the new shards get names the old index does not use
    _write(staged, "model-00001-of-00002.safetensors", "newer")
    _write(staged, "model-00002-of-00002.safetensors", "newer")
    _index(staged, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    loads.clear()
    model_files.publish_model(str(staged), str(target))
    assert all(len(seen) == 1 for seen in loads) and loads[-1] == {"newer"}, loads
    assert sorted(p.name for p in target.glob("model-*")) == ["model-00001-of-00002.v1.safetensors",
                                                              "model-00002-of-00002.v1.safetensors"]

    # an adapter replacing the full model, then the full model replacing the adapter
    _write(staged, "adapter_model.safetensors", "lora")
    _write(staged, "adapter_config.json", "{}")
    loads.clear()
    model_files.publish_model(str(staged), str(target))
    assert all(len(seen) == 1 for seen in loads) and loads[-1] == {"adapter:lora"}, loads
    _write(staged, "model.safetensors", "full")
    loads.clear()
    model_files.publish_model(str(staged), str(target))
    assert all(len(seen) == 1 for seen in loads) and loads[-1] == {"full"}, loads
    assert not (target / "adapter_config.json").exists() and not list(target.glob("model-*"))
