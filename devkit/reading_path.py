"""What a reader reads to follow one training step: from `trainer.train()` until the first optimizer step is done
(the loss, its backward and the optimizer step that leantune drives), every leantune function that runs.

Issue 25's target ("following GRPO from train() to the loss: at most 1,500 lines") is measured against the lines of
the functions on the path (def to end, docstrings and comments included: what a reader reads, nested functions
counted once); the whole-file total of the files they live in is printed beside it.

    python -m devkit.reading_path [--method grpo|rloo|online_dpo|dpo|sft] [--functions]
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
import tempfile
from pathlib import Path

import leantune

PACKAGE = Path(leantune.__file__).resolve().parent
SPANS_WITHOUT_A_DEF = ("<lambda>", "<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")


def tiny_trainer(method: str, output_dir: str, **overrides):
    """A one-step CPU run of `method` on the built-in demo's data and character tokenizer (no files, no Hub), with
    the method's defaults but for `overrides` of its config."""
    from transformers import AutoModelForCausalLM

    from leantune.defaults import as_prompts_with_answers, build_default_dataset
    from leantune.defaults.preferences import build_default_preference_dataset
    from leantune.defaults.model import build_default_model_config
    from leantune.defaults.tokenizer import build_default_tokenizer
    from leantune.methods import METHODS

    spec = METHODS[method]
    tokenizer = build_default_tokenizer()
    model = AutoModelForCausalLM.from_config(build_default_model_config(tokenizer))
    common = dict(output_dir=output_dir, use_cpu=True, report_to=[], save_strategy="no", max_steps=1, seed=0,
                  logging_steps=1, disable_tqdm=True, memory_breakdown=False, per_device_train_batch_size=8, **overrides)
    if spec.online:
        prompts = as_prompts_with_answers(build_default_dataset(16, 0, seed=0, task="reverse")["train"])
        lengths = {"max_new_tokens": 8} if method == "online_dpo" else {"max_completion_length": 8}
        args = spec.config_class(**common, **lengths, num_generations=2 if method == "online_dpo" else 4)
        return spec.trainer_class(model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                                  args=args, train_dataset=prompts, processing_class=tokenizer)
    if spec.data == "preference":
        data = build_default_preference_dataset(16, 0, seed=0)["train"]
    else:
        data = build_default_dataset(16, 0, seed=0, task="reverse")["train"]
    return spec.trainer_class(model, args=spec.config_class(**common), train_dataset=data, processing_class=tokenizer)


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
def definitions(filename: str) -> list[tuple[int, int, str]]:
    """(first line with decorators, last line, qualified name) of every function in a file."""
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    found.append((first, child.end_lineno, name))
                name += "."
            visit(child, name)

    visit(ast.parse(Path(filename).read_text()), "")
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


def lines_of(functions: dict[str, tuple[int, int]]) -> int:
    """The lines of a file's functions, a nested one's counted once."""
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
    parser.add_argument("--method", default="grpo", choices=("grpo", "rloo", "online_dpo", "dpo", "sft"))
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
    print(f"{options.method}: {counts['functions']} functions run, {counts['function_lines']} lines (issue 25's "
          f"target, <= 1,500 for GRPO, is measured on these), in {counts['files']} files of "
          f"{counts['file_lines']} lines in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
