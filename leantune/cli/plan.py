"""`leantune plan`: the peak memory of a training step per process before it runs (no weights loaded), and with
--memory_budget the fastest configuration that fits (planning/recommend.py)."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field

from .arguments import ModelConfig, ScriptArguments, model_init_kwargs_from, peft_config_from
from .errors import UsageError
from .help_cache import method_flag as _method_of
from .parser import parse_command_args


@dataclass
class PlanArguments:
    method: str = field(default="sft", metadata={"help": "sft, dpo, kto, reward, grpo, rloo, online-dpo, ppo, gkd (any "
                                                         "leantune trainer); --help then lists its fields."})
    num_processes: int = field(default=1, metadata={"help": "Processes of the launch (per-process plan)."})
    engine: str = field(default="ddp", metadata={"help": "ddp (fsdp2, zero2, zero3, cp: not planned yet)."})
    device: str | None = field(
        default=None, metadata={"help": "A GPU name (h100, a100-40gb, l4, ...) to list its terms beyond the trace."})
    memory_budget: str | None = field(
        default=None, metadata={"help": "24GiB or a GPU name: also plan the candidates that learn the same thing and "
                                "name the fastest that fits."})
    tokenizer: str | None = field(
        default=None, metadata={"help": "Tokenizer id or folder, when --model_name_or_path holds only config.json."})
    plan_json: str | None = field(default=None, metadata={"help": "Also write the plan as JSON to this file."})


def run(argv: list[str]) -> int:
    from ..planning.planner import _init_parameters, method_classes
    from .online_runs import RewardArguments

    try:
        trainer_class, config_class = method_classes(_method_of(argv))
    except ValueError as error:
        raise UsageError(str(error)) from error
    if not any(arg.split("=")[0] == "--use_cpu" for arg in argv):
        argv = [*argv, "--use_cpu", "true"]  # the plan runs here, on CPU, for any device (bf16 included)
    online = "reward_funcs" in _init_parameters(trainer_class)  # as `leantune <method>`: --reward_funcs
    types = (PlanArguments, ScriptArguments, *([RewardArguments] if online else []), ModelConfig, config_class)
    parsed = parse_command_args("leantune plan", types, argv)
    plan_args, script_args, model_args, config, explicit = *parsed[:2], *parsed[-3:]
    rewards = {}
    if online and parsed[2].reward_funcs:  # reward models among them are planned from their config.json
        from .runner import online_reward_funcs

        rewards["reward_funcs"] = online_reward_funcs(parsed[2])
    explicit.discard("use_cpu")
    if model_args.model_name_or_path is None or script_args.dataset_name is None:
        if model_args.model_name_or_path is None:
            raise UsageError("--model_name_or_path is required (a Hub id or local folder: only its config.json is "
                             "read).")
        raise UsageError("--dataset_name is required (the data as the trainers read it: a Hub id, a local folder or "
                         "a data file).")
    from ..planning.devices import parse_budget
    from .runner import load_splits

    budget = parse_budget(plan_args.memory_budget) if plan_args.memory_budget else None
    config_fields = {f.name for f in dataclasses.fields(config)} - {"output_dir", "use_cpu"}
    fields = {name: getattr(config, name) for name in explicit if name in config_fields}
    init = {k: v for k, v in model_init_kwargs_from(model_args).items() if k != "revision"}
    if init:
        fields["model_init_kwargs"] = {**init, **(fields.get("model_init_kwargs") or {})}
    if model_args.load_in_4bit or model_args.load_in_8bit:
        raise UsageError("--load_in_4bit / --load_in_8bit: quantized (QLoRA) models are not planned yet.")
    fields.pop("eval_strategy", None)
    config.eval_strategy = "no"
    train, _ = load_splits(script_args, config)
    from ..planning import plan_memory

    tokenizer = None
    if plan_args.tokenizer:
        from ..models.loading import load_tokenizer

        try:
            tokenizer = load_tokenizer(plan_args.tokenizer)
        except (OSError, ValueError) as error:
            raise UsageError(f"--tokenizer {plan_args.tokenizer}: {str(error).splitlines()[0]}") from error

    try:
        plan = plan_memory(model_args.model_name_or_path, train, trainer_class,
                           processing_class=tokenizer, peft_config=peft_config_from(model_args),
                           num_processes=plan_args.num_processes, engine=plan_args.engine,
                           device=plan_args.device or plan_args.memory_budget, **rewards, **fields)
    except ValueError as error:
        raise UsageError(str(error)) from error
    print("\n".join(plan.lines()))
    if budget is not None:
        from ..planning.recommend import recommend

        recommendation = recommend(plan, budget, model_args.model_name_or_path, train, trainer_class,
                                   peft_config_from(model_args), plan_args, {**fields, **rewards}, tokenizer)
        print("\n".join(recommendation.lines()))
    if plan_args.plan_json:
        with open(plan_args.plan_json, "w", encoding="utf-8") as handle:
            json.dump(plan.to_dict(), handle, indent=2, default=str)
        print(f"written: {plan_args.plan_json}", file=sys.stderr)
    return 0
