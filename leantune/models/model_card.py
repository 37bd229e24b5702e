"""The README.md (model card) a trainer writes beside what it saves: what the folder holds (a full model and its class,
a PEFT adapter and the base model it needs, a reward model), which leantune trainer made it, and the lines that load
it. TRL-style front matter (`tags: [leantune, <method>]`) so the Hub files it with the method.

The card is rewritten at every save into a folder whose README.md is absent or is leantune's own (it carries
`MARKER`); a README.md written by someone else is left as it is. PEFT's `save_pretrained` writes a template card of
its own first; leantune's replaces it (keeping its facts: library_name peft, the base model, the PEFT version).
"""

from __future__ import annotations

import json
import logging
import os
import re

import peft
import transformers

from .. import methods
from ..version import __version__
from .loading import resolve_source

logger = logging.getLogger("leantune.models")

README = "README.md"
MARKER = "<!-- leantune model card: rewritten at each save; delete this line to keep your own edits -->"
# Classes by the suffix of their name -> the transformers Auto class that loads them (else the class itself).
AUTO_CLASSES = (
    ("ForCausalLM", "AutoModelForCausalLM"),
    ("ForSequenceClassification", "AutoModelForSequenceClassification"),
    ("ForTokenClassification", "AutoModelForTokenClassification"),
    ("ForConditionalGeneration", "AutoModelForImageTextToText"),
)
PEFT_NAMES = {"LORA": "LoRA", "ADALORA": "AdaLoRA", "IA3": "IA3", "PREFIX_TUNING": "prefix-tuning"}
PEFT_AUTO_CLASSES = {"CAUSAL_LM": "AutoPeftModelForCausalLM", "SEQ_CLS": "AutoPeftModelForSequenceClassification"}
_PLAIN_YAML = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./-]*$")


def may_write(output_dir: str) -> bool:
    """Whether a card may be written into `output_dir`: its README.md is absent or leantune's own."""
    path = os.path.join(output_dir, README)
    if not os.path.exists(path):
        return True
    try:
        with open(path, encoding="utf-8") as handle:
            return MARKER in handle.read()
    except (OSError, UnicodeDecodeError):
        return False


def method_of(trainer) -> tuple[str, str]:
    """(trainer class name, method name) the card states, from the method's entry in leantune/methods.py (a subclass
    of a leantune trainer is its parent's method): SFTTrainer -> sft."""
    try:
        method = methods.of(trainer)
    except ValueError:
        return type(trainer).__name__, "custom"
    return method.trainer_name, method.card_name


def _peft_model(model):
    """The PEFT model (adapter config, base model) if `model` is one, else None."""
    return model if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else None


def _auto_class(model_class: str) -> tuple[str, str]:
    """(module, class) that loads a saved `model_class` through from_pretrained."""
    for suffix, auto in AUTO_CLASSES:
        if model_class.endswith(suffix):
            return "transformers", auto
    return "transformers", model_class


def _yaml_value(value: str) -> str:
    return value if _PLAIN_YAML.match(value) else json.dumps(value)


def _is_hub_id(source: str | None) -> bool:
    return bool(source) and not os.path.isabs(source) and not os.path.exists(source)


CHECKPOINT_FOLDER = re.compile(r"^checkpoint-\d+$")
STAGING_FOLDER = re.compile(r"^tmp-checkpoint-\d+$")
STAGED_MODEL_FOLDER = "_staged-model"  # where a final model is written before it is moved in (trainers/parts/model_files.py)


def shown_folder(folder: str) -> str:
    """How the card names a saved folder: its name (a checkpoint's with its run folder's), never the absolute local
    path, which means nothing on another machine and would be published by push_to_hub."""
    parts = os.path.normpath(folder).split(os.sep)
    if len(parts) > 2 and CHECKPOINT_FOLDER.match(parts[-1]) and STAGING_FOLDER.match(parts[-2]):
        parts = parts[:-2] + parts[-1:]  # written while staged (trainers/parts/checkpoint_files.py): named as renamed
    if len(parts) > 1 and parts[-1] == STAGED_MODEL_FOLDER:
        parts = parts[:-1]  # a final model written while staged: named as the folder it is moved into
    if len(parts) > 1 and CHECKPOINT_FOLDER.match(parts[-1]) and parts[-2]:
        return f"{parts[-2]}/{parts[-1]}"
    return parts[-1] or folder


def shown_source(source: str) -> str:
    """A Hub id as it is; a local folder by its name (the absolute path stays in adapter_config.json, for loading)."""
    return shown_folder(source) if os.path.isabs(source) else source


def describe(trainer, model, output_dir: str) -> dict:
    """The facts the card states, as a dict (also handy for tests)."""
    trainer_class, method = method_of(trainer)
    folder = os.path.abspath(output_dir)
    facts = {"trainer": trainer_class, "method": method, "folder": folder, "leantune": __version__,
             "transformers": transformers.__version__, "step": getattr(getattr(trainer, "state", None),
                                                                       "global_step", None)}
    facts["tokenizer"] = getattr(trainer, "processing_class", None) is not None
    peft_model = _peft_model(model)
    if peft_model is not None:
        adapter = getattr(peft_model, "active_adapter", "default")
        adapter = adapter if isinstance(adapter, str) else adapter[0]
        config = peft_model.peft_config[adapter]
        task = getattr(config, "task_type", None)
        base = peft_model.get_base_model()
        facts.update(kind="adapter", peft_type=str(getattr(config.peft_type, "value", config.peft_type)),
                     task_type=getattr(task, "value", task), peft=peft.__version__,
                     base=resolve_source(config.base_model_name_or_path), model_class=type(base).__name__,
                     num_labels=getattr(base.config, "num_labels", None),
                     pad_token_id=getattr(base.config, "pad_token_id", None))
    elif not hasattr(model, "save_pretrained"):
        facts.update(kind="state_dict", model_class=type(model).__name__, base=None, num_labels=None)
    else:
        config = getattr(model, "config", None)
        facts.update(kind="model", model_class=type(model).__name__,
                     base=resolve_source(getattr(config, "_name_or_path", "") or "") or None,
                     num_labels=getattr(config, "num_labels", None))
    facts["reward"] = facts["model_class"].endswith("ForSequenceClassification")
    return facts


def _loading_lines(facts: dict) -> list[str]:
    folder = json.dumps(shown_folder(facts["folder"]))
    here = [f"# {folder}: this folder (its path from where you run this, or its Hub id once pushed)"]
    if facts["kind"] == "adapter":
        base = json.dumps(shown_source(facts["base"]))
        if facts["task_type"] == "SEQ_CLS":
            # The adapter folder has no config.json: the base must be built as the reward model was trained.
            extra = f", num_labels={facts['num_labels']}"
            if facts.get("pad_token_id") is not None:
                extra += f", pad_token_id={facts['pad_token_id']}"
            source = base
            lines = ["from peft import PeftModel", "from transformers import AutoModelForSequenceClassification", ""]
            if os.path.isabs(facts["base"]):  # a local base: the path adapter_config.json records, not written here
                lines = ["from peft import PeftConfig", *lines,
                         f"base_path = PeftConfig.from_pretrained({folder}).base_model_name_or_path  # {base}"]
                source = "base_path"
            lines += [f"base = AutoModelForSequenceClassification.from_pretrained({source}{extra})",
                     f"model = PeftModel.from_pretrained(base, {folder})"]
        elif facts["task_type"] in PEFT_AUTO_CLASSES:
            auto = PEFT_AUTO_CLASSES[facts["task_type"]]
            lines = [f"from peft import {auto}", "",
                     f"model = {auto}.from_pretrained({folder})  # loads the base model named in adapter_config.json",
                     f"# or: PeftModel.from_pretrained({_auto_class(facts['model_class'])[1]}.from_pretrained({base}), "
                     f"{folder})"]
        else:
            module, cls = _auto_class(facts["model_class"])
            lines = ["from peft import PeftModel", f"from {module} import {cls}", "",
                     f"model = PeftModel.from_pretrained({cls}.from_pretrained({base}), {folder})"]
    elif facts["kind"] == "state_dict":
        path = json.dumps(f"{shown_folder(facts['folder'])}/model.safetensors")
        lines = ["from safetensors.torch import load_file", "",
                 f"model.load_state_dict(load_file({path}))  # into a {facts['model_class']} you build yourself"]
    else:
        module, cls = _auto_class(facts["model_class"])
        lines = [f"from {module} import {cls}", "", f"model = {cls}.from_pretrained({folder})"]
    if facts["tokenizer"]:
        lines.insert(0, "from transformers import AutoTokenizer")
        lines.append(f"tokenizer = AutoTokenizer.from_pretrained({folder})")
    return _sorted_imports(here + lines)


def _sorted_imports(lines: list[str]) -> list[str]:
    """The import lines first, one per module (its names merged), then the code."""
    names: dict[str, set[str]] = {}
    for line in lines:
        if line.startswith("from "):
            module, _, imported = line.removeprefix("from ").partition(" import ")
            names.setdefault(module, set()).update(name.strip() for name in imported.split(","))
    imports = [f"from {module} import {', '.join(sorted(names[module]))}" for module in sorted(names)]
    return [*imports, "", *[line for line in lines if line and not line.startswith("from ")]]


def render(facts: dict, extra_tags=None, metadata: dict | None = None) -> str:
    """The card's text: front matter, what the folder holds, how it was made, how to load it."""
    tags = ["leantune", facts["method"]]
    if facts["kind"] == "adapter":
        tags += ["peft", facts["peft_type"].lower()]
    tags += [tag for tag in ([extra_tags] if isinstance(extra_tags, str) else list(extra_tags or [])) if tag not in tags]
    front = [f"library_name: {'peft' if facts['kind'] == 'adapter' else 'transformers'}"]
    if _is_hub_id(facts.get("base")):
        front.append(f"base_model: {_yaml_value(facts['base'])}")  # the Hub only accepts repository ids here
    front.append("pipeline_tag: " + ("text-classification" if facts["reward"] else "text-generation"))
    for key, value in (metadata or {}).items():
        if value:
            values = [value] if isinstance(value, str) else list(value)
            front.append(f"{key}:\n" + "\n".join(f"- {_yaml_value(str(v))}" for v in values))
    front.append("tags:\n" + "\n".join(f"- {_yaml_value(tag)}" for tag in tags))

    base = facts.get("base")
    base_text = ((f"`{shown_source(base)}` (a local folder" + (", its absolute path recorded in adapter_config.json"
                                                               if facts["kind"] == "adapter" else "") + ")")
                 if os.path.isabs(base) else f"`{base}` (a Hub model id)") if base else "(not recorded)"
    origin = f" Trained from {base_text}." if base else " Its starting weights came from no named checkpoint."
    peft_type = PEFT_NAMES.get(facts.get("peft_type"), facts.get("peft_type"))
    if facts["kind"] == "adapter":
        what = (f"A **{peft_type} adapter** (PEFT, task type {facts['task_type']}), not a full model. "
                f"It needs its base model: {base_text}, loaded as `{facts['model_class']}`.")
        if facts["reward"]:
            what += (f" With that base it is a **reward model**: sequence classification, "
                     f"num_labels={facts['num_labels']} (the `score` head is saved in full with the adapter).")
    elif facts["reward"]:
        what = (f"A **reward model**, full weights: `{facts['model_class']}` (sequence classification, "
                f"num_labels={facts['num_labels']}), one score per sequence.{origin}")
    elif facts["kind"] == "state_dict":
        what = (f"The **state dict** (model.safetensors) of a `{facts['model_class']}`, which is not a transformers "
                "model: build the module yourself and load the weights into it.")
    else:
        what = f"A **full model**, all weights: `{facts['model_class']}`.{origin}"
    step = f", at optimizer step {facts['step']}" if facts.get("step") else ""
    versions = f"leantune {facts['leantune']}, transformers {facts['transformers']}"
    if facts["kind"] == "adapter":
        versions += f", PEFT {facts['peft']}"
    name = shown_folder(facts["folder"])
    lines = ["---", *front, "---", MARKER, "", f"# {name}", "", what, "",
             f"Made by leantune's `{facts['trainer']}` (method: {facts['method']}){step}; {versions}.", "",
             "## Load it", "", "```python", *_loading_lines(facts), "```", ""]
    return "\n".join(lines)


def write_model_card(trainer, output_dir: str, model=None, extra_tags=None, metadata: dict | None = None) -> str:
    """Write README.md into `output_dir` for what `trainer` saved there; returns its path."""
    if model is None:
        model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    text = render(describe(trainer, model, output_dir), extra_tags, metadata)
    path = os.path.join(output_dir, README)
    os.makedirs(output_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    return path
