"""A flag is read in one place: the files under leantune/ that read each config field a part uses.

A read is `args.<field>` / `<x>.args.<field>` (the config is named `args` throughout leantune, after transformers'
and TRL's Trainer; also `training_args`, and `sized`: planning's copy) or `getattr(args, "<field>")`. The resolver is
the config layer (each config's own fields and __post_init__ validation: *_config.py, config_utils, memory_options,
preference_options, trl_options), parts/resolved_config.py and trainers/settings.py (the parts' frozen settings).
Every other file that reads a field is listed in STILL_READ: the to-do. A field not listed there is read by the
resolver alone, and a new read elsewhere fails this test.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import leantune

ROOT = Path(leantune.__file__).parent
RESOLVER = {"trainers/config_utils.py", "trainers/memory_options.py", "trainers/preference_options.py",
            "trainers/trl_options.py", "trainers/parts/resolved_config.py", "trainers/settings.py"}
CONFIG_NAMES = {"args", "training_args", "sized"}

# The fields the parts use: layout, checkpointing, the head and log-probs, generation, reference, memory, non-finite
# policy, out-of-memory retry.
PART_FIELDS = (
    "padding_free", "packing", "eval_packing", "pad_to_multiple_of", "gradient_checkpointing", "activation_checkpointing", "gradient_checkpointing_kwargs",
    "activation_checkpointing_kwargs", "use_vllm", "vllm_mode", "activation_offloading",
    "activation_offloading_min_bytes", "activation_offloading_use_streams", "use_liger_kernel", "use_liger_loss", "chunked_loss", "loss_chunk_size",
    "nonfinite_policy", "average_tokens_across_devices", "router_aux_loss_coef", "precompute_ref_log_probs",
    "precompute_ref_batch_size", "sync_ref_model", "ref_model_sync_steps", "ref_model_mixup_alpha",
    "steps_per_generation", "liger_head", "checkpoint_offload_layers", "tiled_mlp", "tiled_mlp_tile_size", "tiled_attention_projections",
    "optimizer_in_backward", "cache_implementation", "shared_prompt",
)

# To do: fields still read outside the resolver (none left: the dict stays for the test's exact check).
STILL_READ: dict[str, set[str]] = {}


def is_config(node: ast.AST) -> bool:
    return ((isinstance(node, ast.Name) and node.id in CONFIG_NAMES)
            or (isinstance(node, ast.Attribute) and node.attr == "args"))


def library_sources() -> dict[str, str]:
    """{file under leantune/: its source}, the resolver left out."""
    sources = {path.relative_to(ROOT).as_posix(): path for path in ROOT.rglob("*.py")}
    return {name: path.read_text(encoding="utf-8") for name, path in sources.items()
            if name not in RESOLVER and not name.endswith("_config.py")}


def files_reading(sources: dict[str, str]) -> dict[str, set[str]]:
    """{field: the files that read it}."""
    readers = defaultdict(set)
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in PART_FIELDS
                    and is_config(node.value)):
                readers[node.attr].add(name)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and node.args[1].value in PART_FIELDS
                  and is_config(node.args[0])):
                readers[node.args[1].value].add(name)
    return readers


def test_each_part_field_is_read_by_the_resolver_alone_or_listed_as_to_do():
    readers = files_reading(library_sources())
    for field in PART_FIELDS:
        assert readers.get(field, set()) == STILL_READ.get(field, set()), field


def test_the_rule_sees_each_kind_of_read_and_not_a_write_or_another_object():
    source = ("def f(trainer, args, collator):\n"
              "    a = trainer.args.padding_free\n"
              "    b = getattr(args, 'use_vllm', False)\n"
              "    c = args.vllm_mode\n"
              "    args.packing = True\n"
              "    return collator.loss_chunk_size\n")
    assert files_reading({"x.py": source}) == {"padding_free": {"x.py"}, "use_vllm": {"x.py"}, "vllm_mode": {"x.py"}}
