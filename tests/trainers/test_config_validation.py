"""Conflicting or ineffective config settings are errors at construction (before any model or data is touched),
naming the fields in backticks; every config's defaults construct; combinations that work stay accepted."""

from __future__ import annotations

import pytest

from leantune import SFTConfig
from leantune.trainers.dpo_config import DPOConfig
from leantune.trainers.grpo_config import GRPOConfig
from leantune.trainers.kto_config import KTOConfig
from leantune.trainers.reward_config import RewardConfig
from leantune.trainers.rloo_config import RLOOConfig

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds

ALL_CONFIGS = (SFTConfig, DPOConfig, KTOConfig, RewardConfig, GRPOConfig, RLOOConfig)
PREFERENCE_CONFIGS = (DPOConfig, KTOConfig, RewardConfig)
ONLINE_CONFIGS = (GRPOConfig, RLOOConfig)


def make(cls, **overrides):
    return cls(**{"output_dir": "/tmp/leantune-config-validation", "report_to": [], "use_cpu": True, **overrides})


def rejects(cls, field: str, **overrides):
    """The config raises a one-sentence ValueError naming `field` in backticks."""
    with pytest.raises(ValueError, match=f"`{field}") as error:
        make(cls, **overrides)
    return str(error.value)


# --- defaults and TRL-style usage keep working ----------------------------------------------------------------------


@pytest.mark.parametrize("cls", ALL_CONFIGS)
def test_defaults_construct(cls):
    cls(output_dir="/tmp/leantune-config-validation")  # no use_cpu: exactly the defaults
    make(cls)


@pytest.mark.parametrize("settings", [
    dict(packing=True, padding_free=True),  # TRL users pass both: packed rows flattened into one row
    dict(packing=True, padding_free=True, packing_strategy="bfd_split", pad_to_multiple_of=64),
    dict(packing=False, eval_packing=True, packing_strategy="wrapped"),  # the strategy packs the eval set
    dict(packing=True, eval_packing=False),
    dict(completion_only_loss=True, assistant_only_loss=True),  # both masks: assistant turns of the completion
    dict(packing=True, packing_strategy="bfd", truncation_mode="keep_end"),  # bfd truncates before packing
    dict(packing=True, packing_strategy="wrapped", eval_packing=False, truncation_mode="keep_end"),  # eval truncates
    dict(use_liger_kernel=True),
    dict(chunked_loss=False),
    dict(use_liger_kernel=True, loss_chunk_size=128),  # the chunked fallback off CUDA reads it
    dict(activation_offloading=True, activation_offloading_use_streams=False, activation_offloading_min_bytes=0),
])
def test_sft_combinations_that_work_are_accepted(settings):
    make(SFTConfig, **settings)


@pytest.mark.parametrize("settings", [
    dict(use_vllm=True),
    dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True, vllm_gpu_memory_utilization=0.5,
         vllm_max_model_length=1024, vllm_tensor_parallel_size=1),
    dict(use_vllm=True, vllm_mode="server", vllm_server_host="10.0.0.1", vllm_server_port=8001,
         vllm_server_timeout=60.0),
    dict(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://localhost:8000"),
    dict(epsilon=0.2, epsilon_high=0.28),  # DAPO's clip-higher
    dict(epsilon=0.2, epsilon_high=0.1),  # an asymmetric range the other way is still a valid clip
    dict(generation_batch_size=16),
    dict(steps_per_generation=2),
    dict(log_completions=True, num_completions_to_print=2),
    dict(ds3_gather_for_generation=False),  # transformers generate under ZeRO-3
])
@pytest.mark.parametrize("cls", ONLINE_CONFIGS)
def test_online_combinations_that_work_are_accepted(cls, settings):
    make(cls, **settings)


# --- every config --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ALL_CONFIGS)
@pytest.mark.parametrize("field", ["per_device_train_batch_size", "per_device_eval_batch_size",
                                   "gradient_accumulation_steps"])
def test_batch_sizes_must_be_positive(cls, field):
    message = rejects(cls, field, **{field: 0})
    assert "positive" in message


@pytest.mark.parametrize("cls", ALL_CONFIGS)
def test_lengths_and_multiples_must_be_positive(cls):
    for field in ("max_length", "pad_to_multiple_of") if cls not in ONLINE_CONFIGS else ("pad_to_multiple_of",
                                                                                         "max_prompt_length"):
        for value in (0, -8):
            rejects(cls, field, **{field: value})


@pytest.mark.parametrize("cls", ALL_CONFIGS)
@pytest.mark.parametrize("flag", ["use_liger_kernel", "use_liger_loss"])
def test_liger_with_full_logits_is_rejected(cls, flag):
    message = rejects(cls, flag, **{flag: True, "chunked_loss": False})
    assert "`chunked_loss=False`" in message


@pytest.mark.parametrize("cls", ALL_CONFIGS)
def test_loss_chunk_size_without_the_chunked_loss_is_rejected(cls):
    message = rejects(cls, "loss_chunk_size", chunked_loss=False, loss_chunk_size=256)
    assert "`chunked_loss=False`" in message


@pytest.mark.parametrize("cls", ALL_CONFIGS)
@pytest.mark.parametrize("option", [dict(activation_offloading_use_streams=False),
                                    dict(activation_offloading_min_bytes=0)])
def test_offloading_options_without_offloading_are_rejected(cls, option):
    message = rejects(cls, next(iter(option)), **option)
    assert "`activation_offloading=True`" in message


# --- SFT ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["bfd_split", "wrapped"])
def test_packing_strategy_without_packing_is_rejected(strategy):
    message = rejects(SFTConfig, "packing_strategy", packing_strategy=strategy)
    assert "`packing=True`" in message


@pytest.mark.parametrize("field", ["packing", "eval_packing"])
def test_packing_needs_max_length_naming_the_field_that_asked(field):
    rejects(SFTConfig, field, max_length=None, **{field: True})


def test_truncation_mode_without_truncation_is_rejected():
    message = rejects(SFTConfig, "truncation_mode", max_length=None, truncation_mode="keep_end")
    assert "`max_length=None`" in message


@pytest.mark.parametrize("strategy", ["bfd_split", "wrapped"])
def test_truncation_mode_with_a_splitting_packing_strategy_is_rejected(strategy):
    message = rejects(SFTConfig, "truncation_mode", packing=True, packing_strategy=strategy, truncation_mode="keep_end")
    assert f"`packing_strategy='{strategy}'`" in message


def test_padding_free_help_defines_packing_with_padding_free():
    from dataclasses import fields

    help_text = {f.name: f.metadata["help"] for f in fields(SFTConfig)}["padding_free"]
    assert "packing" in help_text and "one row" in help_text


# --- data-dependent checks happen in data preparation ----------------------------------------------------------------


def test_assistant_only_loss_on_non_conversational_data_fails_in_preparation(tokenizer):
    from datasets import Dataset

    from leantune.data.sft_preparation import prepare_sft_dataset

    data = Dataset.from_dict({"prompt": ["2+2="], "completion": [" 4"]})
    with pytest.raises(ValueError, match="assistant_only_loss") as error:
        prepare_sft_dataset(data, tokenizer, make(SFTConfig, assistant_only_loss=True))
    assert "prompt_completion" in str(error.value)
    with pytest.raises(ValueError, match="completion_only_loss"):
        prepare_sft_dataset(Dataset.from_dict({"text": ["2+2=4"]}), tokenizer, make(SFTConfig, completion_only_loss=True))


def test_completion_and_assistant_masks_both_select_targets():
    from datasets import Dataset

    from leantune.data.sft_preparation import loss_mask_columns

    data = Dataset.from_dict({"input_ids": [[1, 2]], "completion_mask": [[0, 1]], "assistant_masks": [[1, 1]]})
    args = make(SFTConfig, completion_only_loss=True, assistant_only_loss=True)
    assert loss_mask_columns(data, args) == ["completion_mask", "assistant_masks"]


# --- preference configs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", PREFERENCE_CONFIGS)
def test_preference_truncation_mode_without_max_length_is_rejected(cls):
    mode = "keep_start" if cls is RewardConfig else "keep_end"  # the one that is not the config's default
    message = rejects(cls, "truncation_mode", max_length=None, truncation_mode=mode)
    assert "`max_length=None`" in message
    make(cls, max_length=None)  # the default mode with no bound is fine


@pytest.mark.parametrize("cls", (DPOConfig, KTOConfig))
def test_precompute_batch_size_without_precompute_is_rejected(cls):
    message = rejects(cls, "precompute_ref_batch_size", precompute_ref_batch_size=4)
    assert "`precompute_ref_log_probs=True`" in message
    make(cls, precompute_ref_log_probs=True, precompute_ref_batch_size=4)


@pytest.mark.parametrize("cls", (DPOConfig, KTOConfig, RewardConfig))
def test_prompt_and_completion_bounds_above_max_length_are_accepted(cls):
    # They do what they say (cut first); max_length then bounds the pair, and what it drops is counted.
    make(cls, max_length=64, max_prompt_length=128, max_completion_length=128)


# --- online configs (GRPO, RLOO) -------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ONLINE_CONFIGS)
@pytest.mark.parametrize("option", [
    dict(vllm_mode="server"), dict(vllm_enable_sleep_mode=True), dict(vllm_gpu_memory_utilization=0.5),
    dict(vllm_max_model_length=2048), dict(vllm_tensor_parallel_size=2), dict(vllm_server_base_url="http://h:1"),
    dict(vllm_server_host="10.0.0.1"), dict(vllm_server_port=9000), dict(vllm_server_timeout=10.0),
])
def test_vllm_options_without_use_vllm_are_rejected(cls, option):
    message = rejects(cls, next(iter(option)), **option)
    assert "`use_vllm=True`" in message


@pytest.mark.parametrize("cls", ONLINE_CONFIGS)
@pytest.mark.parametrize("option", [dict(vllm_server_host="10.0.0.1"), dict(vllm_server_port=9000),
                                    dict(vllm_server_base_url="http://h:1"), dict(vllm_server_timeout=10.0)])
def test_server_options_with_a_colocated_engine_are_rejected(cls, option):
    message = rejects(cls, next(iter(option)), use_vllm=True, **option)
    assert "`vllm_mode='server'`" in message


@pytest.mark.parametrize("cls", ONLINE_CONFIGS)
@pytest.mark.parametrize("option", [dict(vllm_enable_sleep_mode=True), dict(vllm_gpu_memory_utilization=0.5),
                                    dict(vllm_max_model_length=2048), dict(vllm_tensor_parallel_size=2)])
def test_colocate_options_with_a_server_are_rejected(cls, option):
    message = rejects(cls, next(iter(option)), use_vllm=True, vllm_mode="server", **option)
    assert "`vllm_mode='colocate'`" in message


@pytest.mark.parametrize("cls", ONLINE_CONFIGS)
def test_vllm_mode_must_be_known(cls):
    rejects(cls, "vllm_mode", use_vllm=True, vllm_mode="remote")


@pytest.mark.parametrize("cls", ONLINE_CONFIGS)
def test_ds3_gather_off_with_vllm_is_rejected(cls):
    message = rejects(cls, "ds3_gather_for_generation", use_vllm=True, ds3_gather_for_generation=False)
    assert "`use_vllm=False`" in message


@pytest.mark.parametrize("cls", ONLINE_CONFIGS)
def test_completions_that_leave_no_room_for_a_prompt_in_the_engine_are_rejected(cls):
    rejects(cls, "max_completion_length", use_vllm=True, vllm_max_model_length=256, max_completion_length=256)
    make(cls, use_vllm=True, vllm_max_model_length=512, max_completion_length=256)


@pytest.mark.parametrize("cls", ONLINE_CONFIGS)
def test_generation_batch_size_and_steps_per_generation_are_exclusive(cls):
    rejects(cls, "generation_batch_size", generation_batch_size=16, steps_per_generation=2)


@pytest.mark.parametrize("settings, field", [
    (dict(per_device_train_batch_size=6, num_generations=4), "per_device_train_batch_size"),
    (dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, num_generations=4), "steps_per_generation"),
    (dict(per_device_train_batch_size=2, steps_per_generation=3, num_generations=4), "steps_per_generation"),
    (dict(per_device_train_batch_size=8, generation_batch_size=12, num_generations=4), "generation_batch_size"),
    (dict(per_device_train_batch_size=4, generation_batch_size=12, num_generations=8), "generation_batch_size"),
])
@pytest.mark.parametrize("cls", ONLINE_CONFIGS)
def test_generation_rounds_must_hold_whole_groups(cls, settings, field):
    rejects(cls, field, **settings)


@pytest.mark.parametrize("cls", ONLINE_CONFIGS)
def test_generate_calls_take_whole_groups_and_only_transformers_generate_in_pieces(cls):
    rejects(cls, "max_completions_per_generate", num_generations=4, max_completions_per_generate=6)
    message = rejects(cls, "max_completions_per_generate", use_vllm=True, max_completions_per_generate=8)
    assert "vllm_gpu_memory_utilization" in message
    make(cls, num_generations=4, per_device_train_batch_size=8, max_completions_per_generate=4)


@pytest.mark.parametrize("cls", ONLINE_CONFIGS)
def test_rounds_of_whole_groups_over_accumulation_are_accepted(cls):
    make(cls, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_generations=4)
    make(cls, per_device_train_batch_size=2, steps_per_generation=4, num_generations=8)


@pytest.mark.parametrize("cls", ONLINE_CONFIGS)
def test_num_completions_to_print_without_log_completions_is_rejected(cls):
    message = rejects(cls, "num_completions_to_print", num_completions_to_print=3)
    assert "`log_completions=True`" in message
