"""The final model's files moved into a folder they share with checkpoints and logs, so that a kill at any moment
leaves `from_pretrained(folder)` loading the old model or the new one, every file whole.

A checkpoint has a folder of its own, renamed into place in one step (checkpoint_files.py). The final model's files
sit in output_dir itself, beside checkpoint-N and the logs, where transformers users load them from: they are
written into a staging folder there (`_staged-model`: push_to_hub leaves out names starting with `_`), fsynced, and
moved in one `os.replace` each, so no file is ever seen half-written, in an order that keeps the weights one whole
set at every instant:

1. the files the weights do not hang on (configs, tokenizer, card, arguments) and new weight shards, under names
   the old model's index does not use (renamed in the staging folder when they would replace an old shard);
2. the weights' entry file: a shard index, then a single weights file (which transformers loads in preference to an
   index), then `adapter_config.json` (whose presence makes the folder a PEFT adapter): the last of these replaced
   is the moment the new weights are the ones that load;
3. the old model's weight files that the new one does not have (a single file shadowing the new index, an old
   adapter config, stale shards): where one of them still decided the load, its removal is that moment.

What is not a weight file and not in the new save is left as it was (what transformers' in-place save did too).
"""

from __future__ import annotations

import json
import os
import re

from ...models.model_card import STAGED_MODEL_FOLDER as STAGED_MODEL
from . import checkpoint_files

INDEX = re.compile(r"^.+\.index\.json$")
# A single weights file, in the order they go in: a full model's (safetensors preferred over .bin by
# transformers), PPO's value function, a PEFT adapter's weights, and last the adapter config
ENTRY_FILES = ("pytorch_model.bin", "model.safetensors", "value_function.safetensors", "adapter_model.bin",
               "adapter_model.safetensors", "adapter_config.json")
# Weight files an earlier save may have left: removed when the new model does not have them
WEIGHT_FILE = re.compile(r"^((pytorch_model|model|adapter_model)(-\d+-of-\d+)?(\.v\d+)?\.(bin|safetensors)"
                         r"|(pytorch_model|model)\.(bin|safetensors)\.index\.json|adapter_config\.json"
                         r"|value_function\.safetensors)$")


def staged_folder(target: str) -> str:
    return os.path.join(target, STAGED_MODEL)


def publish_model(staged: str, target: str) -> None:
    """Move the complete model in `staged` into `target` (see the module's docstring), then remove `staged`."""
    _rename_colliding_shards(staged, target)
    checkpoint_files.fsync_tree(staged)
    new = sorted(os.listdir(staged))
    for name in sorted(new, key=_rank):
        source, destination = os.path.join(staged, name), os.path.join(target, name)
        if os.path.isdir(source):  # a folder of the save (a PEFT adapter by name): renamed whole, the old aside
            checkpoint_files.publish(source, destination)
        else:
            os.replace(source, destination)
        if _rank(name):  # each step of the weights' switch durable before the next
            checkpoint_files.fsync_dir(target)
    stale = [name for name in os.listdir(target) if WEIGHT_FILE.match(name) and name not in new]
    for name in sorted(stale, key=lambda name: -_rank(name)):  # a shadowing entry file first: the switch
        path = os.path.join(target, name)
        if os.path.isfile(path):
            os.remove(path)
    checkpoint_files.fsync_dir(target)
    checkpoint_files.remove_tree(staged)


def _rank(name: str) -> int:
    """0: goes in first; then shard indexes; then the entry files in ENTRY_FILES' order."""
    if name in ENTRY_FILES:
        return 2 + ENTRY_FILES.index(name)
    return 1 if INDEX.match(name) else 0


def _rename_colliding_shards(staged: str, target: str) -> None:
    """New shards that would replace an old model's shard of the same name (the old index still pointing at it)
    get a name free in `target` (`.v1`, `.v2` before the suffix), their index rewritten to match."""
    for index_name in [name for name in os.listdir(staged) if INDEX.match(name)]:
        path = os.path.join(staged, index_name)
        with open(path, encoding="utf-8") as handle:
            index = json.load(handle)
        shards = sorted(set(index.get("weight_map", {}).values()))
        if not any(os.path.exists(os.path.join(target, shard)) for shard in shards):
            continue
        version = 1
        while any(os.path.exists(os.path.join(target, _versioned(shard, version))) for shard in shards):
            version += 1
        for shard in shards:
            os.replace(os.path.join(staged, shard), os.path.join(staged, _versioned(shard, version)))
        index["weight_map"] = {key: _versioned(shard, version) for key, shard in index["weight_map"].items()}
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(index, handle, indent=2, sort_keys=True)


def _versioned(shard: str, version: int) -> str:
    stem, dot, suffix = shard.rpartition(".")
    stem = re.sub(r"\.v\d+$", "", stem)
    return f"{stem}.v{version}{dot}{suffix}"
