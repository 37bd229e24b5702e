"""Checkpoints and resume that lose nothing: a run stopped at step k and resumed gives the uninterrupted run's
per-step losses at every boundary (max_steps, an epoch's end, mid-epoch with gradient accumulation, a larger
max_steps); a finished run resumed trains nothing; a checkpoint appears whole or not at all; --overwrite_output_dir
deletes only an earlier run's complete checkpoints, and only once the new run has loaded; a full disk is one line.

Exactness: the stopped-and-resumed run does the same float operations in the same order as the uninterrupted one
(same data order, restored RNG, optimizer and scheduler states, same thread count in one process), so the losses
agree to rounding; 1e-6 relative (losses ~10, fp32 eps ~1e-7) leaves room for nothing else, while one skipped,
repeated or reordered batch moves a loss by ~1e-2 or more.
"""

from __future__ import annotations

import json
import os

import pytest
from transformers import TrainerCallback

from leantune import SFTConfig, SFTTrainer

from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.launchers import cpu_only, launch, small_disk, torchrun
from ..fixtures.models import saved_model_and_data, tiny_model
from ..fixtures.paths import SCRIPTS

SCRIPT = SCRIPTS / "sft_resume_launch.py"

REL = 1e-6


class StopAt(TrainerCallback):
    """Ends the run after optimizer step `step` (its checkpoint is written first), as a kill after that save would."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def make_trainer(out, tokenizer, rows, **overrides):
    settings = dict(output_dir=str(out), max_length=256, report_to=[], use_cpu=True, per_device_train_batch_size=2,
                    max_steps=4, save_steps=1, logging_steps=1, learning_rate=1e-3, seed=0, disable_tqdm=True,
                    memory_breakdown=False)
    settings.update(overrides)
    return SFTTrainer(model=tiny_model(), args=SFTConfig(**settings), processing_class=tokenizer,
                      train_dataset=gsm8k_prompt_completion(rows, 8))


def losses(trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def checkpoints(out) -> list[str]:
    return sorted((p.name for p in out.iterdir() if p.name.startswith(("checkpoint-", "tmp-checkpoint-"))),
                  key=lambda name: int(name.rsplit("-", 1)[1]))


# name: (settings of the run, step it is stopped at, settings of the resumed run or None for the same)
BOUNDARIES = {
    # 8 rows / batch 4: 2 steps an epoch; stopped where the first epoch ends, resumed into the second
    "epoch_end": (dict(max_steps=-1, num_train_epochs=2, per_device_train_batch_size=4), 2, None),
    # 2 micro-batches a step (4 steps an epoch), stopped mid-epoch: the resumed run skips exactly 2 x 3 batches
    "mid_accumulation": (dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=4), 3, None),
    # a run of 3 steps, finished, continued to 6: the same as a run of 6 (a constant rate, so the schedule of the
    # first 3 steps does not depend on max_steps)
    "larger_max_steps": (dict(max_steps=3, lr_scheduler_type="constant"), 3,
                         dict(max_steps=6, lr_scheduler_type="constant")),
}


@pytest.mark.parametrize("boundary", list(BOUNDARIES))
def test_stop_and_resume_gives_the_uninterrupted_losses(boundary, tokenizer, gsm8k_rows, tmp_path):
    first, stop, later = BOUNDARIES[boundary]
    later = later or first
    whole = make_trainer(tmp_path / "whole", tokenizer, gsm8k_rows, **later)
    whole.train()
    expected = losses(whole)

    out = tmp_path / "stopped"
    stopped = make_trainer(out, tokenizer, gsm8k_rows, **first, save_total_limit=2)
    if stop < stopped.args.max_steps or first.get("max_steps") == -1:
        stopped.add_callback(StopAt(stop))
    stopped.train()
    assert stopped.state.global_step == stop
    resumed = make_trainer(out, tokenizer, gsm8k_rows, **later, save_total_limit=2)
    resumed.train(resume_from_checkpoint=str(out / f"checkpoint-{stop}"))
    got = losses(resumed)
    assert sorted(got) == sorted(expected) == list(range(1, len(expected) + 1))  # every step once
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=REL), (boundary, step)
    last = max(expected)
    assert checkpoints(out) == [f"checkpoint-{last - 1}", f"checkpoint-{last}"]  # rotation, no staging left


@pytest.mark.slow
@cpu_only
def test_stop_and_resume_in_two_processes(model_and_data, tmp_path):
    """torchrun, 2 processes on CPU (gloo): each process's data shard, RNG state (rng_state_<rank>.pth) and the one
    optimizer state come back; the resumed losses equal the uninterrupted run's in the same processes."""
    model_dir, data_file = model_and_data
    out = tmp_path / "launch"
    run, _ = launch(torchrun(str(SCRIPT), str(out), str(model_dir), str(data_file), "2"), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1)]
    for rank in ranks:
        assert rank["world"] == 2 and rank["stopped_at"] == 2
        assert sorted(rank["resumed"]) == sorted(rank["whole"]) == ["1", "2", "3", "4"]
        for step, loss in rank["whole"].items():
            assert rank["resumed"][step] == pytest.approx(loss, rel=REL), step
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(out / "stopped" / "checkpoint-4"))
    assert checkpoints(out / "stopped") == [f"checkpoint-{i}" for i in (1, 2, 3, 4)]
    # The script keeps its three trainers to the end, as users' scripts do: leantune's exit handler still drops their
    # DDP wrappers and the group before the interpreter's teardown, where freeing them aborted now and then (SIGABRT)
    for rank in (0, 1):
        assert json.loads((out / f"exit{rank}.json").read_text()) == {"ddp_wrappers": 0, "group_alive": False}


@pytest.mark.parametrize("settings", [dict(max_steps=3), dict(max_steps=-1, num_train_epochs=1),
                                      dict(max_steps=3, save_strategy="epoch", logging_strategy="epoch")],
                         ids=["max_steps", "epochs", "epoch_saves"])
def test_resuming_a_finished_run_trains_nothing(settings, tokenizer, gsm8k_rows, tmp_path, caplog):
    out = tmp_path / "out"
    done = make_trainer(out, tokenizer, gsm8k_rows, **settings)
    done.train()
    last = done.state.global_step
    before = (out / f"checkpoint-{last}" / "trainer_state.json").read_text()
    again = make_trainer(out, tokenizer, gsm8k_rows, **settings)
    with caplog.at_level("WARNING", logger="leantune.trainer"):
        again.train(resume_from_checkpoint=str(out / f"checkpoint-{last}"))
    # transformers alone trains step last+1 here and writes checkpoint-<last+1>, the "latest" of every later resume
    assert again.state.global_step == last and again.trained_nothing
    assert checkpoints(out)[-1] == f"checkpoint-{last}"
    assert (out / f"checkpoint-{last}" / "trainer_state.json").read_text() == before
    assert "Nothing to train" in caplog.text


def test_a_checkpoint_is_renamed_into_place_whole(tokenizer, gsm8k_rows, tmp_path, monkeypatch):
    """The folder checkpoint-N appears only by the rename of its staged copy, with every file in it (GRPO-like
    extra state included, written before the rename); a stale staging folder of a killed save is replaced."""
    out = tmp_path / "out"
    trainer = make_trainer(out, tokenizer, gsm8k_rows, max_steps=2, save_steps=2)
    seen = []
    real_replace = os.replace

    def replace(source, target):
        seen.append((os.path.basename(str(source)), os.path.basename(str(target)), sorted(os.listdir(source))))
        assert not os.path.exists(target) or os.path.basename(str(target)).endswith(".replaced")
        return real_replace(source, target)

    def extra_state(folder):
        with open(os.path.join(folder, "extra.json"), "w") as handle:
            json.dump({"ok": 1}, handle)

    trainer.save_extra_state = extra_state
    (out / "tmp-checkpoint-2" / "checkpoint-2").mkdir(parents=True)
    (out / "tmp-checkpoint-2" / "checkpoint-2" / "half-written.bin").write_bytes(b"x")
    monkeypatch.setattr("leantune.trainers.parts.checkpoint_files.os.replace", replace)
    trainer.train()
    assert [(s, t) for s, t, _ in seen] == [("checkpoint-2", "checkpoint-2")]
    files = seen[0][2]
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
                 "extra.json"):
        assert name in files
    assert "half-written.bin" not in files
    assert checkpoints(out) == ["checkpoint-2"]


def test_the_latest_checkpoint_is_the_newest_complete_one_and_the_rest_are_named(tmp_path, caplog):
    from transformers.trainer_utils import get_last_checkpoint

    from leantune.trainers.parts.checkpoint_files import latest_complete_checkpoint

    for name in ("checkpoint-1", "checkpoint-2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-3").mkdir()  # an older leantune's save cut short: no trainer_state.json
    (tmp_path / "tmp-checkpoint-4" / "checkpoint-4").mkdir(parents=True)  # a staged save, not renamed
    assert get_last_checkpoint(str(tmp_path)).endswith("checkpoint-3")  # what transformers alone would resume
    with caplog.at_level("WARNING", logger="leantune.trainer"):
        assert latest_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    assert "ignored checkpoint-3, tmp-checkpoint-4" in caplog.text


def test_adaptive_entropy_state_missing_from_a_checkpoint_is_an_error(tmp_path):
    from leantune.losses.entropy_bonus import STATE_FILE, EntropyBonus

    bonus = EntropyBonus.__new__(EntropyBonus)
    bonus.coef, bonus.last_step_entropy = 0.25, 1.5
    bonus.save(str(tmp_path))
    bonus.coef = 0.0
    bonus.load(str(tmp_path))
    assert bonus.coef == 0.25
    os.remove(tmp_path / STATE_FILE)
    with pytest.raises(ValueError, match="use_adaptive_entropy"):  # it used to keep the configured coefficient
        bonus.load(str(tmp_path))


@pytest.fixture
def model_and_data(tmp_path, tokenizer, gsm8k_rows):
    return saved_model_and_data(tmp_path, tokenizer, gsm8k_rows[:8])


@pytest.fixture
def tmpfs(tmp_path):
    """A real small file system (tmpfs of 80 MiB): room for one checkpoint of the tiny model (~50 MiB: weights
    16 MiB, Adam states 33 MiB), not two."""
    with small_disk(tmp_path / "small-disk", 80) as folder:
        yield folder


def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(model_and_data, tmpfs, capsys):
    from leantune.cli.main import main

    model_dir, data_file = model_and_data
    out = tmpfs / "out"
    code = main(["sft", "--model_name_or_path", str(model_dir), "--dataset_name", str(data_file), "--max_length", "64",
                 "--per_device_train_batch_size", "2", "--max_steps", "3", "--save_steps", "1", "--report_to", "none",
                 "--disable_tqdm", "true", "--memory_breakdown", "false", "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"leantune sft: error: no room to write checkpoint-2 in {out}: it needs about ")
    assert "MiB is free" in line and "--save_total_limit" in line
    assert checkpoints(out) == ["checkpoint-1"]  # no staging folder left, the complete one untouched
    assert json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())["global_step"] == 1
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"} <= set(os.listdir(out / "checkpoint-1"))


# --- --overwrite_output_dir: nothing deleted before the new run has loaded, nothing deleted that is not a checkpoint --


def _earlier_run(out) -> None:
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"global_step": 2, "log_history": []}))
    (out / "checkpoint-3").write_text("a file, not a checkpoint")
    (out / "checkpoint-4").mkdir()  # no trainer_state.json: not known to be a checkpoint


def _sft(model_dir, data_file, out, *extra):
    from leantune.cli.main import main

    return main(["sft", "--model_name_or_path", str(model_dir), "--dataset_name", str(data_file), "--max_length", "64",
                 "--per_device_train_batch_size", "2", "--max_steps", "1", "--save_strategy", "no", "--report_to",
                 "none", "--disable_tqdm", "true", "--memory_breakdown", "false", "--output_dir", str(out),
                 "--overwrite_output_dir", "true", *extra])


def test_overwrite_deletes_nothing_when_the_model_does_not_load(model_and_data, tmp_path):
    model_dir, data_file = model_and_data
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    out = tmp_path / "out"
    _earlier_run(out)
    try:
        _sft(model_dir, data_file, out)
    except Exception:  # the load fails, in whatever words the loader has: what matters is what is left
        pass
    assert (out / "checkpoint-2" / "trainer_state.json").exists()  # deleted before the load, it used to be


def test_overwrite_deletes_only_complete_checkpoints_and_names_the_rest(model_and_data, tmp_path, caplog):
    model_dir, data_file = model_and_data
    out = tmp_path / "out"
    _earlier_run(out)
    with caplog.at_level("WARNING", logger="leantune.cli"):
        assert _sft(model_dir, data_file, out) == 0  # a file named checkpoint-3 used to stop it with a traceback
    assert not (out / "checkpoint-2").exists()
    assert (out / "checkpoint-3").is_file() and (out / "checkpoint-4").is_dir()
    assert "deleted the earlier run's checkpoint-2" in caplog.text
    assert "left checkpoint-3, checkpoint-4" in caplog.text
