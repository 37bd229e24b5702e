"""The nine methods, each described once: everything else (the exports, the command line, the planner, the model
card, TRL's defaults) reads this table, so a new method is its trainer file(s) and one entry here.

Classes are named by module path and imported on first use: `import leantune` and `leantune --help` stay fast.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# What a method's data is: its columns are checked (cli/runner.py) and its rows profiled and planned by this kind.
SFT_DATA = "sft"  # text, prompt-completion or messages (SFT, GKD)
PREFERENCE_DATA = "preference"  # pairs: prompt, chosen, rejected (DPO, reward)
KTO_DATA = "kto"  # unpaired examples with a desirable/undesirable label, or pairs unpaired automatically
PROMPT_DATA = "prompt"  # prompts only: completions are generated during training (the online methods)

# Frozen models a method takes by name or config, which the planner builds fake (planning/frozen.py); a reference
# copy is the trainer's own deep copy of the policy and needs no entry.
TEACHER = "teacher"  # GKD's teacher_model / teacher_model_name_or_path
REWARD_MODELS = "reward_models"  # reward models among the online methods' reward_funcs

# How a method's loss runs under context parallelism (trainers/parts/context_parallel.py), each process holding part of
# every sequence: a sum over tokens, each process's part of it (the parts add up over the group); or a loss over
# per-sequence sums, made whole over the group first (the loss is then the same on each process of it).
TOKEN_SUMS = "token_sums"
SEQUENCE_SUMS = "sequence_sums"


@dataclass(frozen=True)
class Method:
    name: str  # the key of METHODS, and the `method` attribute of the method's trainer
    command: str  # `leantune <command>`
    config: str  # "module:Class" of the config
    trainer: str  # "module:Class" of the trainer
    data: str  # one of the *_DATA kinds above
    help: str  # the command's line in `leantune --help`
    cli: str  # the module with the method's own command-line code: run_demo(...) and print_summary(...)
    card_name: str  # the method as the model card, the Hub tags and a plan name it
    trl_tag: str  # the Hub tag TRL's trainer of the method puts on the model
    output_suffix: str  # TRL's default output_dir, "<model>-<suffix>"; also names the method in log lines
    # Online: rounds of completions generated and scored by reward functions (`--reward_funcs`, a generation backend).
    online: bool = False
    sequence_classifier: bool = False  # the trained model is a sequence classifier with one output (reward models)
    frozen_models: tuple[str, ...] = ()  # TEACHER, REWARD_MODELS: what the planner builds fake from a name or config
    # The layouts the planner's budget search varies: "packing" (packed, padding-free, padded) or "padding_free".
    layouts: str = "padding_free"
    # The rows of `leantune profile`'s JSON the planner can build this method's data from: "sequences" (SFT data),
    # "pairs" (prompt, chosen, rejected) or "whole_pairs" (chosen and rejected with their prompt); None: not planned so.
    profile_rows: str | None = None
    # TOKEN_SUMS or SEQUENCE_SUMS: how the loss runs under context parallelism; None: refused there
    context_parallel: str | None = None

    @property
    def config_class(self) -> type:
        return _load(self.config)

    @property
    def trainer_class(self) -> type:
        return _load(self.trainer)

    @property
    def trainer_name(self) -> str:
        return self.trainer.split(":")[1]

    @property
    def demo_output_dir(self) -> str:
        """Where the built-in demo (the command with no model and no data) writes, unless --output_dir says."""
        return f"leantune-output/{self.command}-demo"


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _entry(name: str, class_stem: str, **fields) -> Method:
    """An entry by the house's names: trainers/<name>_config.py's <stem>Config and trainers/<name>_trainer.py's
    <stem>Trainer, the command <name> with dashes, TRL's "<model>-<stem>" output_dir, the card name <stem> in lower
    case (also TRL's Hub tag unless `trl_tag` says otherwise)."""
    fields.setdefault("trl_tag", class_stem.lower())
    return Method(name=name, command=name.replace("_", "-"), config=f"leantune.trainers.{name}_config:{class_stem}Config",
                  trainer=f"leantune.trainers.{name}_trainer:{class_stem}Trainer", card_name=class_stem.lower(),
                  output_suffix=class_stem, **fields)


ONLINE_CLI = "leantune.cli.online_runs"  # the online methods share their demo and summary
ONLINE = {"data": PROMPT_DATA, "cli": ONLINE_CLI, "online": True, "frozen_models": (REWARD_MODELS,)}
ONLINE_PAIRS = {**ONLINE, "context_parallel": SEQUENCE_SUMS}  # RLOO, Online DPO: whole-completion sums

METHODS: dict[str, Method] = {method.name: method for method in (
    _entry("sft", "SFT", data=SFT_DATA, cli="leantune.cli.sft", layouts="packing", profile_rows="sequences",
           context_parallel=TOKEN_SUMS,
           help="Supervised fine-tuning (no arguments: a built-in demo run on bundled data)."),
    _entry("dpo", "DPO", data=PREFERENCE_DATA, cli="leantune.cli.dpo", profile_rows="pairs",
           context_parallel=SEQUENCE_SUMS,
           help="Direct Preference Optimization (no arguments: a built-in demo run on bundled pairs)."),
    _entry("kto", "KTO", data=KTO_DATA, cli="leantune.cli.kto", context_parallel=SEQUENCE_SUMS,
           help="Kahneman-Tversky Optimization (no arguments: a built-in demo run on bundled data)."),
    _entry("reward", "Reward", data=PREFERENCE_DATA, cli="leantune.cli.reward", trl_tag="reward-trainer",
           sequence_classifier=True, profile_rows="whole_pairs", context_parallel=SEQUENCE_SUMS,
           help="Reward modelling (no arguments: a built-in demo run on bundled pairs)."),
    _entry("grpo", "GRPO", **ONLINE, context_parallel=TOKEN_SUMS,
           help="GRPO, online RL from rewards (no arguments: a built-in demo with a checked answer)."),
    _entry("rloo", "RLOO", **ONLINE_PAIRS,
           help="RLOO, online RL from rewards (no arguments: a built-in demo with a checked answer)."),
    _entry("online_dpo", "OnlineDPO", **ONLINE_PAIRS,
           help="Online DPO, pairs of sampled completions judged by rewards (no arguments: a built-in demo with a "
                "checked answer)."),
    _entry("ppo", "PPO", **ONLINE,
           help="PPO with a value function, online RL from rewards (no arguments: a built-in demo)."),
    _entry("gkd", "GKD", data=SFT_DATA, cli="leantune.cli.gkd", frozen_models=(TEACHER,), context_parallel=TOKEN_SUMS,
           help="Knowledge distillation from a teacher, GKD (no arguments: a built-in demo run)."),
)}

BY_COMMAND: dict[str, Method] = {method.command: method for method in METHODS.values()}


def find(name: str) -> Method:
    """The method a user names: its command ("online-dpo"), key ("online_dpo") or card name ("onlinedpo"), in any
    case."""
    wanted = str(name).strip().lower().replace("_", "-")
    for method in METHODS.values():
        if wanted in (method.command, method.card_name):
            return method
    raise ValueError(f"`method`: unknown method {name!r}; known: {', '.join(sorted(BY_COMMAND))}.")


def of(trainer) -> Method:
    """The method of a trainer or trainer class (its `method` attribute; a subclass inherits its parent's)."""
    name = getattr(trainer, "method", None)
    if name not in METHODS:
        shown = trainer.__name__ if isinstance(trainer, type) else type(trainer).__name__
        raise ValueError(f"`method`: {shown} is no leantune method's trainer (its `method` names none of "
                         f"{', '.join(METHODS)}).")
    return METHODS[name]
