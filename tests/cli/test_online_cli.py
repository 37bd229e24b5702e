"""`leantune grpo | rloo`: the built-in rewards by hand, reward functions named on the command line, runs on GSM8K
prompts with a local model, the built-in demo's rising reward, and bad command lines failing clearly."""

from __future__ import annotations

import json
import re

import pytest

from leantune.cli.main import main
from leantune.rewards import characters_in_place, correct_answer, resolve_reward_funcs

from ..fixtures.models import tiny_model

# --- built-in rewards ------------------------------------------------------------------------------------------


def test_correct_answer_checks_the_last_number_against_the_reference_by_hand():
    answers = ["Natalia sold 48/2 = 24 clips in May.\n#### 72", "#### 1,000", "cat", "42", None]
    completions = ["So 48 + 24 = 72.", "She has 1000 now", " cat ", "42 or 43", "anything"]
    assert correct_answer(completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, None]
    # conversational completions: the last message's content; `solution` works as the reference column too
    assert correct_answer([[{"role": "assistant", "content": "it is 7"}]], solution=["7"]) == [1.0]
    assert correct_answer(["no number"], answer=["5"]) == [0.0]


@pytest.mark.quick
def test_characters_in_place_by_hand():
    scores = characters_in_place([" tac", "tca", "tacxx", ""], answer=["tac", "tac", "tac", "tac"])
    assert scores == pytest.approx([1.0, 1 / 3, 3 / 5, 0.0])


def test_a_builtin_reward_without_a_reference_column_names_what_it_needs():
    with pytest.raises(ValueError, match="answer or solution"):
        correct_answer(["1"], ground_truth=["1"])


def test_reward_functions_are_resolved_by_name_import_path_or_model():
    funcs = resolve_reward_funcs(["correct_answer", "leantune.rewards.builtin:characters_in_place", "org/reward-model"])
    assert funcs == [correct_answer, characters_in_place, "org/reward-model"]
    with pytest.raises(ValueError, match="unknown reward function 'corect_answer'.*correct_answer"):
        resolve_reward_funcs(["corect_answer"])
    with pytest.raises(ValueError, match="could not be imported"):
        resolve_reward_funcs(["leantune.rewards.builtin:no_such_function"])
    with pytest.raises(ValueError, match="not a callable"):
        resolve_reward_funcs(["leantune.rewards.builtin:REFERENCE_COLUMNS"])


# --- the command line ------------------------------------------------------------------------------------------


def test_help_lists_the_online_fields(capsys):
    assert main(["grpo", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--reward_funcs", "--num_generations", "--loss_type", "--scale_rewards", "--use_vllm",
                 "--vllm_enable_sleep_mode", "--ds3_gather_for_generation", "--chunked_loss"):
        assert flag in text, flag
    assert main(["rloo", "--help"]) == 0
    assert "--normalize_advantages" in capsys.readouterr().out


@pytest.fixture
def gsm8k_model_and_prompts(tokenizer, gsm8k_rows, tmp_path):
    model_dir = tmp_path / "model"
    tiny_model().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "gsm8k.jsonl"
    with open(data, "w", encoding="utf-8") as handle:
        for row in gsm8k_rows[:16]:
            handle.write(json.dumps({"prompt": row["question"], "answer": row["answer"]}) + "\n")
    return model_dir, data


@pytest.mark.quick
@pytest.mark.parametrize("command", ["grpo", "rloo"])
def test_cli_trains_a_local_model_on_gsm8k_prompts(command, gsm8k_model_and_prompts, tmp_path, capsys):
    model_dir, data = gsm8k_model_and_prompts
    out = tmp_path / "out"
    code = main([command, "--model_name_or_path", str(model_dir), "--dataset_name", str(data),
                 "--reward_funcs", "correct_answer", "characters_in_place", "--max_steps", "2",
                 "--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8",
                 "--max_prompt_length", "64", "--beta", "0.04", "--output_dir", str(out), "--report_to", "none",
                 "--use_cpu", "true", "--logging_steps", "1"])
    assert code == 0
    assert (out / "model.safetensors").exists()
    text = capsys.readouterr().out
    assert f"=== leantune {command} summary ===" in text
    assert "correct_answer:" in text and "characters_in_place:" in text
    assert "steps: 2 in" in text


def test_cli_without_reward_funcs_or_with_an_unknown_one_fails_clearly(gsm8k_model_and_prompts, capsys):
    model_dir, data = gsm8k_model_and_prompts
    base = ["grpo", "--model_name_or_path", str(model_dir), "--dataset_name", str(data), "--use_cpu", "true"]
    assert main(base) == 2
    assert "--reward_funcs is required" in capsys.readouterr().err
    assert main([*base, "--reward_funcs", "exactness"]) == 2
    assert "unknown reward function 'exactness'" in capsys.readouterr().err
    assert main(["grpo", "--dataset_name", str(data)]) == 2
    assert "--model_name_or_path is required" in capsys.readouterr().err


def _demo_numbers(text: str) -> dict[str, float]:
    sampled = re.search(r"sampled reward .*?\) ([\d.]+) -> ([\d.]+); greedy exact match ([\d.]+)% -> ([\d.]+)%", text)
    train = re.search(r"train reward \(logged mean\): ([\d.]+) at step \d+ -> ([\d.]+)", text)
    return {"sampled_before": float(sampled.group(1)), "sampled_after": float(sampled.group(2)),
            "greedy_before": float(sampled.group(3)), "greedy_after": float(sampled.group(4)),
            "train_first": float(train.group(1)), "train_last": float(train.group(2))}


@pytest.mark.slow
@pytest.mark.parametrize("command", ["grpo"])  # RLOO's demo is the same run with RLOO's loss (~2 min of CI more)
def test_demo_reward_rises(command, capsys, tmp_path):
    assert main([command, "--output_dir", str(tmp_path), "--max_steps", "80"]) == 0  # 80 of the demo's 200 steps
    numbers = _demo_numbers(capsys.readouterr().out)
    assert numbers["greedy_before"] >= 40.0, numbers  # the warm-up stops at 40% held-out exact match
    # measured at 80 steps (seed 42): sampled 0.719 -> 0.990 (GRPO) / 1.022 (RLOO); train 0.817 -> 0.991 / 1.088
    assert numbers["sampled_after"] > numbers["sampled_before"] + 0.15, numbers
    assert numbers["train_last"] > numbers["train_first"] + 0.08, numbers


@pytest.mark.parametrize("command", ["grpo", "rloo"])
def test_a_generation_backend_that_cannot_run_here_is_one_line_before_anything_loads(command, capsys, tmp_path):
    """Colocated vLLM without vllm installed (the training venv never has it) or without a GPU: one line naming what
    to install, exit 2, before the demo's warm-up or any data is read (a file that does not exist is never opened)."""
    from leantune.utils.imports import is_available

    if is_available("vllm"):
        pytest.skip("vllm is installed in this venv: its missing-extra error cannot be shown")
    argv = [command, "--use_vllm", "true", "--vllm_mode", "colocate", "--output_dir", str(tmp_path / "out")]
    for extra in ([], ["--model_name_or_path", str(tmp_path / "none"), "--dataset_name", str(tmp_path / "none.jsonl")]):
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "pip install 'leantune[vllm]'" in err[0], err
        assert not (tmp_path / "out").exists()
