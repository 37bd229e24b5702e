"""Every field of TRL 1.16's configs against leantune's: which are missing, whose defaults differ, and their status.

    python bench/trl_fields.py             # with TRL installed (`pip install "leantune[bench]"`): missing fields and
                                           # differing defaults, per config (exit 1 if a field is missing)
    python bench/trl_fields.py --snapshot  # with TRL: write tests/fixtures/trl_1_16_fields.json (TRL's names, types, defaults)
    python bench/trl_fields.py --docs      # from that snapshot (no TRL needed): write docs/trl_compatibility.md

The status of each field comes from leantune itself (config_utils.UNSUPPORTED_TRL_FIELDS: accepted, a non-default
value refused) and from the hand-kept dicts below; tests/trainers/test_trl_fields.py checks that the snapshot's fields all
exist with TRL's defaults and that the docs are what this script writes. The command is bench/trl_fields.py; the
knowledge lives here, in devkit/, where the tests read it too.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SNAPSHOT = REPO / "tests" / "fixtures" / "trl_1_16_fields.json"
DOCS = REPO / "docs" / "trl_compatibility.md"
CONFIGS = ("SFTConfig", "DPOConfig", "KTOConfig", "RewardConfig", "GRPOConfig", "RLOOConfig", "OnlineDPOConfig",
           "GKDConfig")
# Configs TRL keeps outside its top-level namespace: where to import them from.
EXPERIMENTAL = {"GKDConfig": "trl.experimental.gkd", "OnlineDPOConfig": "trl.experimental.online_dpo"}

# TRL fields that leantune implements where it had none before (or where TRL's meaning needs a word).
IMPLEMENTED = {
    "trust_remote_code": "passed to from_pretrained of the model, reference, reward models and tokenizer loaded by "
                         "name (model_init_kwargs' own value wins)",
    "pad_token": "sets the tokenizer's padding token (must be in its vocabulary)",
    "log_multimodal": "accepted, any value: leantune trains on text, so there is no media to log",
    "sync_ref_model": "TR-DPO: every `ref_model_sync_steps` steps the reference becomes (1 - alpha) ref + alpha "
                      "policy; refused with a PEFT adapter as reference, precomputed log-probs, or beta=0",
    "ref_model_mixup_alpha": "alpha of `sync_ref_model`",
    "ref_model_sync_steps": "the period of `sync_ref_model`",
    "use_weighting": "WPO: each pair's loss times the policy's detached length-normalised probabilities of its "
                     "chosen and rejected completions (refused with aot / aot_unpaired)",
    "router_aux_loss_coef": "a Mixture-of-Experts model with output_router_logits=True gets this weight (None: the "
                            "config's) x its load-balancing loss added, logged as aux_loss",
    "entropy_coef": "loss - coef x the mean token entropy of the micro-batch (gradient through the chunked head)",
    "use_adaptive_entropy": "the coefficient moves by `entropy_coef_delta` after each optimizer step, towards "
                            "keeping the entropy at `entropy_target`; its state is saved with checkpoints",
    "entropy_coef_min": "bound of the adaptive coefficient",
    "entropy_coef_max": "bound of the adaptive coefficient",
    "entropy_coef_delta": "step of the adaptive coefficient",
    "entropy_target": "target of the adaptive coefficient",
    "multi_objective_aggregation": "'normalize_then_sum' normalises each reward function in its group, sums them "
                                   "with `reward_weights`, then normalises over the batch",
    "sapo_temperature_neg": "loss_type='sapo'",
    "sapo_temperature_pos": "loss_type='sapo'",
    "vespo_k_pos": "loss_type='vespo'",
    "vespo_lambda_pos": "loss_type='vespo'",
    "vespo_k_neg": "loss_type='vespo'",
    "vespo_lambda_neg": "loss_type='vespo'",
    "max_tool_calling_iterations": "with `tools` / `environment_factory`: most rounds of tool calls and generation "
                                   "after the first turn (None: until no call or `max_completion_length` is spent)",
}

# GRPOTrainer's keyword arguments beyond the configs (TRL 1.16's agentic ones): (keyword, status).
TRAINER_KEYWORDS = [
    ("tools", "implemented (leantune/rollouts/): a list of callables, sync or async, described to the policy by "
              "their type hints and docstrings; conversational prompts; generate -> parse calls (the tokenizer's "
              "`response_schema` / `response_template`, else the `<tool_call>` JSON markup of Hermes/Qwen templates; "
              "another template is a ValueError) -> run -> append results -> generate again, within "
              "`max_completion_length`; tool-result tokens are context, never targets; logs `tools/call_frequency`, "
              "`tools/failure_frequency` and leantune's `tools/malformed_frequency` (unparseable calls are read as "
              "text, as in TRL, and counted); turns go through the generation backends' one interface (tested with "
              "transformers' generate; the vLLM backends take the same calls but are not tested with tools)"),
    ("environment_factory", "implemented: a factory or a dict of them (each example's `environment` column picks "
                            "one; only its tools are shown); `reset(**row)`'s text is appended to the prompt; public "
                            "methods are tools; `get_reward()` is a reward named after the class (weight 1, after "
                            "`reward_funcs`, which become optional); no `train_dataset`: the environment owns the data "
                            "(`max_steps` required); `trainer.environments` holds the last round's instances; reward "
                            "functions get `environments=`"),
    ("rollout_func", "implemented: `rollout_func(prompts, trainer)` returns `prompt_ids`, `completion_ids`, "
                     "`logprobs` (one per prompt given), optional `env_mask` (0: not trained), other keys to the "
                     "reward functions; with `tools` or `environment_factory` it is refused (it owns the whole rollout)"),
]

# (config or "*", field): why leantune's default or meaning differs from TRL's on purpose.
DIFFERS = {
    ("*", "pad_to_multiple_of"): "None instead of TRL's 'auto', which means None except on AWS Neuron devices "
                                 "(128), which leantune does not target; under context parallelism: 2 x cp_size",
    ("*", "bf16"): "same default (None), resolved differently: on only with a bf16-capable GPU (TRL: whenever fp16 "
                   "is off, CPU included), so CPU runs stay in float32",
    ("KTOConfig", "train_sampling_strategy"): "'random' instead of 'sequential': the KL term's mismatched completions "
                                              "are fixed per example in data preparation, not by batch position "
                                              "(kl_pairing='batch' with 'sequential' pairs them as TRL does)",
    ("GRPOConfig", "remove_unused_columns"): "True (transformers' default) instead of False: leantune's online "
                                             "trainers build their own data loaders, so no column is removed either "
                                             "way (the reward functions get them all)",
    ("RLOOConfig", "remove_unused_columns"): "True (transformers' default) instead of False: leantune's online "
                                             "trainers build their own data loaders, so no column is removed either "
                                             "way (the reward functions get them all)",
    ("OnlineDPOConfig", "remove_unused_columns"): "True (transformers' default) instead of False: leantune's online "
                                                  "trainers build their own data loaders, so no column is removed "
                                                  "either way (the reward functions get them all)",
}

# (config, field): a status written by hand where the rules above do not say it (fields owned by other work).
NOTES: dict[tuple[str, str], str] = {
    ("OnlineDPOConfig", "beta"): (
        "same: one value, or one per epoch (the last for later epochs); leantune indexes by the whole epoch number, "
        "where TRL 1.16 indexes the list with the fractional `state.epoch` (a TypeError once a list of two or more "
        "is used)"
    ),
    ("OnlineDPOConfig", "max_length"): (
        "same: the start of the prompt is cut so that prompt + completion fit; leantune cuts each sequence to its "
        "own length (TRL: by the padded batch's width) and counts the prompts cut; `max_new_tokens >= max_length` "
        "is a ValueError (TRL: a warning)"
    ),
    ("OnlineDPOConfig", "temperature"): (
        "same: sampling temperature; completions are scored at temperature 1 (the model's own probabilities), as "
        "in TRL's Online DPO (GRPO/RLOO score at the sampling temperature)"
    ),
    ("SFTConfig", "assistant_only_loss"): (
        "same (TRL's default and meaning): the template's `{% generation %}` blocks, else the tokens each assistant "
        "turn adds to the rendered conversation; where a template's prefixes cannot show that and leantune knows "
        "the template exactly (Qwen3, DeepSeek-R1-Distill, Phi-3, Phi-3.5), its own marked equivalent gives the mask "
        "(`data/training_templates.py`, logged), the tokens staying the template's own (see below); other such "
        "templates are an error naming the fix"
    ),
}

NOTES.update({
    ("GKDConfig", "lmbda"): (
        "differs deliberately (how, not what): the share of optimizer steps trained on the student's own samples, "
        "drawn per step from `seed` and the step number (reproducible, the same on every process); TRL draws per "
        "micro-batch from Python's global random state"),
    ("GKDConfig", "temperature"): (
        "same: the sampling temperature of on-policy and seq_kd completions; the divergence is taken at temperature "
        "1, as TRL's GKDTrainer does"),
    ("GKDConfig", "teacher_model_init_kwargs"): (
        "implemented: from_pretrained keyword arguments of a teacher given by id or path (dtype names, "
        "`quantization_config` for a 4/8-bit teacher, CPU included); refused with a teacher object, as in TRL"),
    ("GKDConfig", "teacher_model_name_or_path"): (
        "implemented: the teacher when the trainer is given no `teacher_model`; a run without any teacher is a "
        "ValueError (TRL's docstring says the student is used, its code fails)"),
})

# Trainer behaviour (not a config default) that differs from TRL's on purpose, and why.
BEHAVIOUR = [
    "**RewardTrainer with a LoRA config**: the reward head (`score`) is trained too: in full with PEFT's SEQ_CLS task "
    "(as given), otherwise through a LoRA adapter added on it (exact for a one-output head, whose updates all have "
    "rank 1). TRL leaves a head that is not targeted frozen at its random initialisation, so its rewards are a fixed "
    "random projection of what the adapter learns.",
    "**SFT `padding_free=True` without packing**: leantune truncates to `max_length` and keeps the bound; TRL "
    "refuses the combination when `max_length` is set.",
    "**SFT `skip_prepare_dataset` with `completion_mask` / `assistant_masks` but no `labels`**: leantune's "
    "collator applies the masks; TRL refuses the dataset because its collator would ignore them.",
    "**SFT `assistant_only_loss` with a known template without `{% generation %}` markers** (Qwen3, "
    "DeepSeek-R1-Distill, Phi-3, Phi-3.5): leantune trains on the tokens the tokenizer's own template renders and "
    "takes only the mask from its marked equivalent, which renders the same tokens (checked per conversation). "
    "TRL 1.16 swaps in a training template that also changes the tokens (e.g. Qwen3's earlier turns keep their "
    "reasoning). Measured with leantune's prefix method, Qwen3.5/3.6, GLM-4-MoE, gpt-oss, DeepSeek-V3, "
    "Nemotron 3 and, with reasoning, Gemma 4 (latest revision) and DiffusionGemma also need one; leantune has none "
    "for them yet, so they stay an error naming the fix (a template with markers through `chat_template_path`).",
    "**GKD loss normalisation**: the summed divergence is divided by the target count of the batches the step "
    "actually trains on (on on-policy and seq_kd steps, the generated completions, counted after generation, over "
    "all accumulation micro-batches and processes); TRL divides by the count of the dataset's completions that the "
    "generated ones replaced.",
    "**GKD data and layouts**: leantune prepares GKD data as SFT data (prompt-completion, conversational "
    "prompt-completion, `messages` with the last message as the completion, as TRL's collator reads them, "
    "pre-tokenised), so packing and padding-free batches apply; on-policy and seq_kd steps regenerate from each "
    "sequence's tokens before its first target. TRL's GKD collator skips SFT's preparation and pads (left).",
    "**GKD chunked loss**: the divergence comes from both models' hidden states a chunk of target tokens at a time "
    "(Liger's fused linear JSD with `use_liger_loss`), never from [batch, time, vocabulary] logits; TRL computes it "
    "from both models' full logits.",
    "**OnlineDPOTrainer**: `judge` is refused with an error (TRL 1.16 has no judges either; rewards come from "
    "`reward_funcs`), as are `data_collator`, `compute_metrics` and `preprocess_logits_for_metrics`, which it would "
    "not use. A plain-text prompt is tokenised with the tokenizer's special tokens (the BOS), as in leantune's "
    "GRPO/RLOO; TRL's Online DPO tokenises it without them. Online fields that TRL's OnlineDPOConfig does not have "
    "and that cannot apply (`num_generations` other than 2, `epsilon`, `num_iterations`, `generation_batch_size`, "
    "`mask_truncated_completions`) are refused when set.",
    "**SFT pre-tokenised data**: prepared rows hold `input_ids` and `labels` (TRL 1.16's form); a sequence's first "
    "token is never a target, in every layout, so no prediction crosses a packed boundary.",
]

# PPOConfig / PPOTrainer follow TRL's last PPO (trl 0.19-0.2x; TRL 1.16 has none, so it is not in the field snapshot)
PPO_DIFFERENCES = [
    "The value function reads last hidden states, never logits: by default a value head on the policy's own body "
    "(one network; with PEFT one frozen base, the policy's adapter and the head), or TRL's separate `value_model` "
    "(its body and score head); TRL always trained a separate value model, also under PEFT.",
    "The completion's score is added on its last token (TRL added it one position after the last token, inside the "
    "padding, where only the value's own step reads it); the value loss covers the completion's tokens, the policy "
    "loss's (TRL's covered one extra padding position).",
    "Policy and value losses are means over all completion tokens of the optimizer step (every micro-batch, every "
    "process), so micro-batch size, accumulation and padding do not change them; TRL averaged each micro-batch.",
    "Rewards and advantages are whitened over the round's tokens on all processes (TRL: each process's own); "
    "whiten_rewards needs no minimum batch (TRL asserted at least 8 completions per process and mini-batch).",
    "A round holds `num_mini_batches` optimizer steps of completions (per_device_train_batch_size x processes x "
    "gradient_accumulation_steps each) and is trained `num_ppo_epochs` times in the same micro-batch order (TRL "
    "reshuffled each epoch; its round was one step's worth, split into mini-batches).",
    "`response_length` is accepted as TRL's name of `max_completion_length` (default 53 as in TRL); generation stops "
    "at EOS (TRL's `stop_token`, `stop_token_id` are not fields); `total_episodes`, "
    "`local_rollout_forward_batch_size`, `num_sample_generations`, `exp_name`, `sft_model_path`, "
    "`model_adapter_name`, `ref_adapter_name` are not fields (training length is num_train_epochs / max_steps; "
    "scoring runs per micro-batch through the chunked head).",
    "`reward_model_path` defaults to None (TRL: a Hub model that is downloaded unasked); `reward_model` also takes "
    "reward functions (as `reward_funcs`, leantune's online name), and a completion no function scores gets score 0, "
    "counted.",
    "GRPO/RLOO fields whose role PPO's own take are refused when set: `beta` (`kl_coef`), `epsilon` / "
    "`epsilon_high` (`cliprange`), `num_iterations` (`num_ppo_epochs`), `steps_per_generation` / "
    "`generation_batch_size` (`num_mini_batches`). `num_generations` (default 1) samples several completions per "
    "prompt.",
    "The value function is saved beside the policy as value_function.safetensors (TRL saved the policy only) and "
    "restored with it when a run resumes from a checkpoint.",
]


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _type_name(annotation) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", None) or repr(annotation)


def _declared_by_trl(klass, name: str) -> bool:
    for base in klass.__mro__:
        if name in base.__dict__.get("__annotations__", {}):
            return base.__module__.startswith("trl")
    return False


def trl_fields() -> dict:
    """{config: {field: {"type", "default" (repr), "trl_own"}}} from the installed TRL."""
    import trl

    if not trl.__version__.startswith("1.16"):
        print(f"warning: TRL {trl.__version__} installed; the snapshot is of TRL 1.16", file=sys.stderr)
    snapshot = {"trl_version": trl.__version__, "configs": {}}
    for name in CONFIGS:
        klass = getattr(trl, name, None) or getattr(importlib.import_module(EXPERIMENTAL[name]), name)
        snapshot["configs"][name] = {
            field.name: {"type": _type_name(field.type), "default": repr(_default(field)),
                         "trl_own": _declared_by_trl(klass, field.name)}
            for field in dataclasses.fields(klass) if field.init
        }
    return snapshot


def load_snapshot() -> dict:
    return json.loads(SNAPSHOT.read_text(encoding="utf-8"))


def leantune_fields(name: str) -> dict[str, dataclasses.Field]:
    import leantune

    return {field.name: field for field in dataclasses.fields(getattr(leantune, name))}


def compare(snapshot: dict) -> dict[str, dict]:
    """{config: {"missing": [...], "differ": [(field, TRL default, leantune default)]}}."""
    result = {}
    for name, fields in snapshot["configs"].items():
        ours = leantune_fields(name)
        missing = [field for field in fields if field not in ours]
        differ = [(field, info["default"], repr(_default(ours[field]))) for field, info in fields.items()
                  if field in ours and info["default"] != repr(_default(ours[field]))]
        result[name] = {"missing": missing, "differ": differ}
    return result


def status(config: str, field: str, info: dict) -> str:
    """The status of one TRL field in leantune's config, in words (starts with MISSING or UNEXPLAINED if wrong)."""
    from leantune.trainers.config_utils import UNSUPPORTED_TRL_FIELDS

    ours = leantune_fields(config)
    if field not in ours:
        return "MISSING"
    if (config, field) in NOTES:
        return NOTES[(config, field)]
    if field in UNSUPPORTED_TRL_FIELDS:
        return f"accepted, refuses non-default: {UNSUPPORTED_TRL_FIELDS[field]}"
    why = DIFFERS.get((config, field)) or DIFFERS.get(("*", field))
    if why:
        return f"differs deliberately: {why}"
    if info["default"] != repr(_default(ours[field])):
        return f"UNEXPLAINED default: TRL {info['default']}, leantune {_default(ours[field])!r}"
    if field in IMPLEMENTED:
        return f"implemented: {IMPLEMENTED[field]}"
    return "same"


def render_docs(snapshot: dict) -> str:
    lines = [
        "# TRL compatibility of leantune's configs",
        "",
        f"Every field of TRL {snapshot['trl_version']}'s configs exists in leantune's config of the same name, with "
        "TRL's type and default, so a TRL script constructs its config unchanged. Written by "
        "`python bench/trl_fields.py --docs` from `tests/fixtures/trl_1_16_fields.json` (TRL's fields) and leantune's "
        "configs; `tests/trainers/test_trl_fields.py` checks that it is up to date.",
        "",
        "Status: **same** (TRL's default and meaning); **implemented** (a TRL field leantune now honours); **accepted, "
        "refuses non-default** (the field exists with TRL's default; any other value is a ValueError naming the field "
        "and the closest thing leantune offers); **differs deliberately** (why).",
        "",
        "Fields that TRL's configs inherit from transformers' `TrainingArguments` without changing them are counted, "
        "not listed: leantune's configs subclass the same `TrainingArguments`, so they are the same.",
    ]
    for config, fields in snapshot["configs"].items():
        own = {field: info for field, info in fields.items() if info["trl_own"]}
        inherited = [field for field, info in fields.items() if not info["trl_own"]]
        lines += ["", f"## {config}", "", "| field | type | TRL default | status |", "| --- | --- | --- | --- |"]
        for field, info in own.items():
            text = status(config, field, info).replace("|", "\\|")
            kind, default = (info[key].replace("|", "\\|") for key in ("type", "default"))
            lines.append(f"| `{field}` | `{kind}` | `{default}` | {text} |")
        odd = [f"`{field}`: {status(config, field, fields[field])}" for field in inherited
               if status(config, field, fields[field]) != "same"]
        lines += ["", f"{len(inherited)} fields inherited from `TrainingArguments`: same"
                  + ("; except " + "; ".join(odd) if odd else "") + "."]
    lines += ["", "## GRPOTrainer's agentic keywords", "", "| keyword | status |", "| --- | --- |"]
    lines += ["| `" + keyword + "` | " + text.replace("|", "\\|") + " |" for keyword, text in TRAINER_KEYWORDS]
    lines += ["", "## Trainer behaviour that differs deliberately", ""] + [f"- {item}" for item in BEHAVIOUR]
    lines += ["", "## PPOConfig / PPOTrainer (TRL's last PPO, trl 0.19-0.2x)", ""] + [f"- {item}" for item in PPO_DIFFERENCES]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snapshot", action="store_true", help="write the snapshot of TRL's fields (needs TRL)")
    parser.add_argument("--docs", action="store_true", help="write docs/trl_compatibility.md from the snapshot")
    args = parser.parse_args(argv)
    if args.snapshot:
        SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
        SNAPSHOT.write_text(json.dumps(trl_fields(), indent=1, sort_keys=False) + "\n", encoding="utf-8")
        print(f"wrote {SNAPSHOT.relative_to(REPO)}")
    if args.docs:
        DOCS.write_text(render_docs(load_snapshot()), encoding="utf-8")
        print(f"wrote {DOCS.relative_to(REPO)}")
    if args.snapshot or args.docs:
        return 0
    snapshot = trl_fields()
    result = compare(snapshot)
    for name, found in result.items():
        print(f"{name}: {len(found['missing'])} TRL fields missing in leantune: {', '.join(found['missing']) or '-'}")
        for field, theirs, ours in found["differ"]:
            print(f"    default differs: {field}: TRL {theirs}, leantune {ours} -- "
                  f"{status(name, field, snapshot['configs'][name][field])}")
    return 1 if any(found["missing"] for found in result.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
