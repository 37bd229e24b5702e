"""What a reader reads to follow one training step, from `trainer.train()` to the end of the first optimizer step
(the loss, its backward and the optimizer step leantune drives): every leantune function that runs. Issue 36's target
(GRPO: at most 1,200 lines in at most 15 files) is measured on the functions' lines (def to end, docstrings and
comments included, a nested function counted once) and on the files they are in; the whole-file total of those files
is printed beside it.

    python -m devkit.reading_path [--method grpo|rloo|online_dpo|ppo|dpo|kto|reward|sft|gkd] [--functions]
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
import tempfile
from pathlib import Path

import leantune
from leantune.methods import METHODS

PACKAGE = Path(leantune.__file__).resolve().parent
TARGET_LINES, TARGET_FILES = 1200, 15  # issue 36: following GRPO from train() to its loss
SPANS_WITHOUT_A_DEF = ("<lambda>", "<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")


def tiny_trainer(method: str, output_dir: str, **overrides):
    """A one-step CPU run of `method` on the built-in demo's data and character tokenizer (no files, no Hub), with
    the method's defaults but for `overrides` of its config."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from leantune.defaults import as_prompts_with_answers, build_default_dataset
    from leantune.defaults.model import build_default_model_config
    from leantune.defaults.preferences import build_default_preference_dataset, unpaired
    from leantune.defaults.tokenizer import build_default_tokenizer
    from leantune.methods import METHODS, PREFERENCE_DATA

    spec, tokenizer = METHODS[method], build_default_tokenizer()
    config = build_default_model_config(tokenizer)
    config.num_labels = 1  # a reward model's one score (a causal LM ignores it)
    kind = AutoModelForSequenceClassification if spec.sequence_classifier else AutoModelForCausalLM
    model = kind.from_config(config)
    settings = dict(output_dir=output_dir, use_cpu=True, report_to=[], save_strategy="no", max_steps=1, seed=0,
                    logging_steps=1, disable_tqdm=True, memory_breakdown=False, per_device_train_batch_size=8)
    if spec.online:  # 8-token completions, in groups of 4 (Online DPO: pairs; PPO: one per prompt)
        settings.update({"max_new_tokens" if method == "online_dpo" else "max_completion_length": 8},
                        **({"online_dpo": {"num_generations": 2}, "ppo": {}}.get(method, {"num_generations": 4})))
    settings.update(overrides)
    inputs = dict(model=model, args=spec.config_class(**settings), processing_class=tokenizer)
    if spec.online:
        inputs["reward_funcs"] = lambda completions, **_: [float(len(c)) for c in completions]
        data = as_prompts_with_answers(build_default_dataset(16, 0, seed=0, task="reverse")["train"])
    elif spec.data == PREFERENCE_DATA or method == "kto":
        data = build_default_preference_dataset(16, 0, seed=0)["train"]
        data = unpaired(data) if method == "kto" else data
    else:
        data = build_default_dataset(16, 0, seed=0, task="reverse")["train"]
    if method == "gkd":
        inputs["teacher_model"] = AutoModelForCausalLM.from_config(config)
    return spec.trainer_class(train_dataset=data, **inputs)


def traced_step(trainer) -> set:
    """The code objects of leantune that run from train() to the end of the first optimizer step."""
    from transformers import TrainerCallback

    seen, tracing = set(), [True]

    def profile(frame, event, arg):  # CPU: autograd runs the custom backward passes on this thread too
        if event == "call" and tracing[0] and frame.f_code.co_filename.startswith(str(PACKAGE)):
            seen.add(frame.f_code)

    class StopAfterTheStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            tracing[0] = False  # what follows (logging, saving, the run's summary) is reporting, not the step

    trainer.add_callback(StopAfterTheStep())
    sys.setprofile(profile)
    try:
        trainer.train()
    finally:
        sys.setprofile(None)
    return seen


@functools.cache
def definitions(filename: str, node=None, prefix: str = "") -> list[tuple[int, int, str]]:
    """(first line with decorators, last line, qualified name) of every function in a file."""
    found = []
    for child in ast.iter_child_nodes(node or ast.parse(Path(filename).read_text())):
        name = f"{prefix}{child.name}." if hasattr(child, "name") and hasattr(child, "body") else prefix
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            found.append((min([child.lineno, *(d.lineno for d in child.decorator_list)]), child.end_lineno, name[:-1]))
        found += definitions(filename, child, name)
    return found


def function_spans(codes: set) -> dict[str, dict[str, tuple[int, int]]]:
    """By file: each function run and its lines. A lambda or comprehension adds its own lines (inside a function
    that ran, none: that function's lines hold them); an import's module and class bodies are not the step's."""
    spans: dict[str, dict[str, tuple[int, int]]] = {}
    for code in codes:
        if code.co_name == "<module>":
            continue
        first = code.co_firstlineno
        if code.co_name in SPANS_WITHOUT_A_DEF:
            last = max(line for _, _, line in code.co_lines() if line is not None)
            name = f"{code.co_name}@{first}"
        else:
            found = [d for d in definitions(code.co_filename) if d[0] == first]
            if not found:
                continue  # a class body, run as its module is imported
            first, last, name = found[0]
        spans.setdefault(code.co_filename, {})[name] = (first, last)
    return spans


def lines_of(functions: dict[str, tuple[int, int]]) -> int:  # a nested function's lines counted once
    return len({line for first, last in functions.values() for line in range(first, last + 1)})


def measure(spans: dict) -> dict:
    """Functions, their lines, files and the files' whole lines."""
    return {"functions": sum(not name.startswith("<") for f in spans.values() for name in f),
            "function_lines": sum(lines_of(functions) for functions in spans.values()), "files": len(spans),
            "file_lines": sum(len(Path(f).read_text().splitlines()) for f in spans)}


def reading_path(method: str = "grpo", **overrides) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory() as output_dir:
        spans = function_spans(traced_step(tiny_trainer(method, output_dir, **overrides)))
    return measure(spans), spans


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="grpo", choices=sorted(METHODS))
    parser.add_argument("--functions", action="store_true", help="list every function with its lines")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="config fields, e.g. beta=0.04")
    options = parser.parse_args(argv)
    overrides = {key: ast.literal_eval(value) for key, value in (item.split("=", 1) for item in options.set)}
    counts, spans = reading_path(options.method, **overrides)
    for filename in sorted(spans, key=lambda f: -lines_of(spans[f])):
        functions = spans[filename]
        print(f"{Path(filename).relative_to(PACKAGE.parent)}: {len(functions)} functions, {lines_of(functions)} lines")
        if options.functions:
            for name, (first, last) in sorted(functions.items(), key=lambda item: item[1]):
                print(f"    {first:>5}-{last:<5} {last - first + 1:>4}  {name}")
    print(f"{options.method}: {counts['functions']} functions run, {counts['function_lines']} lines in "
          f"{counts['files']} files ({counts['file_lines']} lines in all); issue 36's target for GRPO: "
          f"<= {TARGET_LINES:,} lines ({counts['function_lines']:,}/{TARGET_LINES:,}) in <= {TARGET_FILES} files "
          f"({counts['files']}/{TARGET_FILES})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
