"""How close 2 processes come to 1 with AdamW (and, for contrast, SGD with momentum) under DDP, FSDP2, ZeRO-2, ZeRO-3.

    python bench/scale_out_adamw.py [--engines ddp,fsdp2,zero2,zero3] [--optimizers adamw,sgd] [--steps 3]

SFT of tests/fixtures/models.py's tiny Llama shape (hidden 64, 2 layers, vocabulary 32,000; random init, seed 0) on 32
GSM8K prompt-completion rows, global batch 4 (1 x 4 against 2 x 2), max_length 64, no clipping, no weight decay,
lr 1e-3 (AdamW) / 1e-2 (SGD, momentum 0.9, as tests/launch/test_scale_out.py). Launched exactly as
bench/scale_out_memory.py (accelerate launch with examples/accelerate/*.yaml and the CPU helpers of
devkit/cpu_engines/). After every step the full weights are gathered (the engine's own full state dict) and written;
the one-process run also writes the first step's gradient.

Reported per engine and step: the loss's relative difference from one process, and |W_N - W_1| / |W_1 - W_0| (the
difference of the weights relative to the update so far) over all parameters together and for the worst parameter;
for step 1 of AdamW, the entries whose update differs by more than lr/2 (AdamW's first update is lr * g / (|g| + eps)
per element: +-lr unless |g| is near eps) and the size of their gradient. Results: docs/scale_out.md, "AdamW".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scale_out_memory import ENGINES, EXAMPLES, HELPERS, REPO, free_port, zero3_cpu_config  # noqa: E402

GLOBAL_BATCH = 4
LEARNING_RATE = {"adamw": 1e-3, "sgd": 1e-2}


def worker(out: str, assets: str, batch_size: int, steps: int, optimizer: str) -> None:
    import torch
    from datasets import load_dataset
    from safetensors.torch import save_file
    from transformers import TrainerCallback

    import leantune

    torch.set_num_threads(1)

    class SaveWeights(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step == 0 and trainer.accelerator.num_processes == 1:
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
                save_file(grads, f"{out}/grad1.safetensors")

        def on_step_end(self, args, state, control, **kwargs):
            weights = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # every process takes part
            if trainer.accelerator.is_main_process:
                save_file({k: v.detach().float().contiguous().clone() for k, v in weights.items()},
                          f"{out}/step{state.global_step}.safetensors")

    fields = dict(optim="adamw_torch") if optimizer == "adamw" else dict(optim="sgd", optim_args="momentum=0.9")
    args = leantune.SFTConfig(output_dir=out, report_to=[], save_strategy="no", disable_tqdm=True,
                              per_device_train_batch_size=batch_size, max_steps=steps, logging_steps=1,
                              learning_rate=LEARNING_RATE[optimizer], max_grad_norm=0.0, weight_decay=0.0,
                              max_length=64, seed=0, data_seed=0, memory_breakdown=False, **fields)
    data = load_dataset("json", data_files=f"{assets}/sft.jsonl")["train"]
    trainer = leantune.SFTTrainer(f"{assets}/model", args=args, train_dataset=data)
    trainer.add_callback(SaveWeights())
    trainer.train()
    if trainer.accelerator.is_main_process:
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        Path(f"{out}/losses.json").write_text(json.dumps(losses))
    trainer.accelerator.end_training()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make_assets(root: Path) -> None:
    from bench.common import load_tokenizer, tiny_llama, write_sft_jsonl

    model = tiny_llama(seed=0, vocab_size=32_000, hidden=64, layers=2, heads=4, intermediate=128)
    model.save_pretrained(root / "model")
    load_tokenizer().save_pretrained(root / "model")
    write_sft_jsonl(root / "sft.jsonl", 32)


def run(root: Path, engine: str, optimizer: str, steps: int) -> Path:
    out = root / f"{optimizer}_{engine}"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               TORCH_EXTENSIONS_DIR=str(root / "torch_extensions"))
    tail = [__file__, "worker", str(out), str(root), None, str(steps), optimizer]
    if engine == "one":
        tail[4] = str(GLOBAL_BATCH)
        command = [sys.executable, *tail]
    else:
        tail[4] = str(GLOBAL_BATCH // 2)
        config = zero3_cpu_config(root) if engine == "zero3" else EXAMPLES / f"{engine}.yaml"
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
                   "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", free_port(), *tail]
        if engine == "fsdp2":
            env.update(PYTHONPATH=os.pathsep.join([str(HELPERS), str(REPO)]), LEANTUNE_TEST_CPU_FSDP="1")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        raise RuntimeError(f"{optimizer} {engine} failed:\n{result.stderr[-6000:]}")
    return out


def compare(one: Path, other: Path, steps: int, lr: float, adamw: bool) -> dict:
    import torch
    from safetensors.torch import load_file

    initial = load_file(str(one.parent / "model" / "model.safetensors"))
    ref_losses, losses = json.loads((one / "losses.json").read_text()), json.loads((other / "losses.json").read_text())
    report = {"loss_rel": [abs(a - b) / abs(a) for a, b in zip(losses, ref_losses)], "weights_rel": [],
              "worst_param_rel": []}
    for step in range(1, steps + 1):
        expected, got = load_file(str(one / f"step{step}.safetensors")), load_file(str(other / f"step{step}.safetensors"))
        diff2 = update2 = 0.0
        worst = (0.0, "")
        for name, weight in expected.items():
            start = initial[name].double()
            difference = (got[name].double() - weight.double()).norm() ** 2
            update = (weight.double() - start).norm() ** 2
            diff2, update2 = diff2 + float(difference), update2 + float(update)
            if update > 0:
                worst = max(worst, (float((difference / update).sqrt()), name))
        report["weights_rel"].append((diff2 / update2) ** 0.5)
        report["worst_param_rel"].append(worst)
    if adamw:  # the first step: which entries moved differently, and how large their gradient was
        grads = load_file(str(one / "grad1.safetensors"))
        expected, got = load_file(str(one / "step1.safetensors")), load_file(str(other / "step1.safetensors"))
        flipped, total, flipped_grad, typical = 0, 0, [], []
        for name, weight in expected.items():
            moved = (got[name].double() - weight.double()).abs() > lr / 2
            grad = grads[name].double().abs()
            flipped += int(moved.sum())
            total += moved.numel()
            flipped_grad.extend(grad[moved].tolist())
            typical.append(grad.median())
        report["step1_entries_differing_by_over_half_lr"] = flipped
        report["step1_entries"] = total
        report["step1_their_abs_grad_max"] = max(flipped_grad) if flipped_grad else None
        report["median_abs_grad"] = float(torch.stack(typical).median())
    return report


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--optimizers", default="adamw,sgd")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    options = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="scale_out_adamw_") as tmp:
        root = Path(tmp)
        make_assets(root)
        for optimizer in options.optimizers.split(","):
            one = run(root, "one", optimizer, options.steps)
            for engine in options.engines.split(","):
                other = run(root, engine, optimizer, options.steps)
                report = compare(one, other, options.steps, LEARNING_RATE[optimizer], optimizer == "adamw")
                results[f"{optimizer} {engine}"] = report
                print(f"{optimizer:5s} {engine:5s} " + json.dumps(report), flush=True)
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
