"""Per-rank memory of one SFT step (AdamW) under DDP, FSDP2, ZeRO-2 and ZeRO-3, 1 and 2 CPU processes.

    python bench/scale_out_memory.py [--engines ddp,fsdp2,zero2,zero3] [--processes 1,2] [--json out.json]

Every run is `accelerate launch --config_file examples/accelerate/<engine>.yaml` of this file's worker (an SFT run of
a ~32M-parameter Llama, vocabulary 32,000, hidden 384, 4 layers, fp32, built from a config and saved to a temporary
folder), with the CPU-only helpers of devkit/cpu_engines/ exactly as tests/launch/test_scale_out.py uses them: FSDP2
through its sitecustomize (LEANTUNE_TEST_CPU_FSDP=1), DeepSpeed with DS_ACCELERATOR=cpu, ZeRO-3 with
devkit/cpu_engines/deepspeed_zero3_cpu.json (every parameter partitioned).

Per rank it reports two accountings of the second optimizer step (the first that holds optimizer states):
- MemTracker: leantune's `MemoryBreakdownCallback` (the default `memory_breakdown=True`): the step's peak of live
  tensor memory and its parts at that moment (parameters, gradients, optimizer states, activations, temporaries).
- Engine: what the engine holds, read from its own objects right after the step: the local storage of every
  parameter (FSDP2: the DTensor's local shard; ZeRO-3: `ds_tensor`, the partition), the optimizer's state tensors
  (the innermost torch optimizer: DeepSpeed's partitioned fp32 groups), and DeepSpeed's fp32 master copy of the
  partition and its other buffers (tensors reachable from the ZeRO optimizer object, by attribute).
Expected per rank, with P the bytes of all parameters and N processes: DDP P / P / 2P (parameters / gradients /
AdamW states), FSDP2 P/N / P/N / 2P/N, ZeRO-2 P / P/N / 2P/N, ZeRO-3 P/N / P/N / 2P/N.

The numbers are tensor bytes, independent of timing, so the runs may share the CPU with other work. Results and the
discussion: docs/scale_out.md, "Memory per rank".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "accelerate"
HELPERS = REPO / "devkit" / "cpu_engines"
MIB = 1024 * 1024
ENGINES = ("ddp", "fsdp2", "zero2", "zero3")
# the share of P each part should have per rank, N processes: (parameters, gradients, optimizer states)
EXPECTED = {
    "ddp": lambda n: (1.0, 1.0, 2.0),
    "fsdp2": lambda n: (1 / n, 1 / n, 2 / n),
    "zero2": lambda n: (1.0, 1 / n, 2 / n),
    "zero3": lambda n: (1 / n, 1 / n, 2 / n),
}
GLOBAL_BATCH = 4
MAX_LENGTH = 128


# --- worker: one rank of a launched run -------------------------------------------------------------------------


def _storages(tensors) -> dict:
    """Unique untyped storages of tensors (a DTensor counts its local shard), by data pointer -> bytes."""
    from torch.distributed.tensor import DTensor

    found = {}
    for tensor in tensors:
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        if storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


def _tensors_by_attribute(obj, skip: set, depth: int = 0, seen: set | None = None) -> dict:
    """Tensors reachable from an object's attributes (through lists, tuples, dicts), grouped by top attribute."""
    import torch

    seen = set() if seen is None else seen
    groups: dict[str, dict] = {}

    def walk(value, name, level):
        if id(value) in seen or level > 4:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            for ptr, size in _storages([value]).items():
                if ptr not in skip:
                    groups.setdefault(name, {})[ptr] = size
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item, name, level + 1)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item, name, level + 1)

    for name, value in vars(obj).items():
        walk(value, name, 0)
    return groups


def _innermost_optimizer(optimizer):
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def engine_accounting(trainer) -> dict:
    """What the engine holds on this rank right after the step, read from its own objects."""
    import torch

    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    params = list(model.parameters())
    logical = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params)
    local = [p.ds_tensor if hasattr(p, "ds_tensor") else p for p in params]
    param_storages = _storages(local)
    inner = _innermost_optimizer(trainer.optimizer)
    state_tensors = [v for s in inner.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0]  # AdamW's `step` is a 0-d tensor
    state_storages = _storages(state_tensors)
    record = {"logical_parameter_bytes": logical, "parameter_bytes": sum(param_storages.values()),
              "optimizer_state_bytes": sum(state_storages.values()), "deepspeed_buffers": {}}
    zero = getattr(trainer.model_wrapped, "optimizer", None)
    record["fp32_master_bytes"] = 0
    if zero is not None and hasattr(zero, "optimizer") and type(zero).__module__.startswith("deepspeed"):
        skip = set(param_storages) | set(state_storages)
        groups = _tensors_by_attribute(zero, skip)
        for bucket in (getattr(zero, "ipg_buckets", None) or {}).values():  # gradient bucket objects
            groups.update({f"ipg_buckets.{k}": v for k, v in _tensors_by_attribute(bucket, skip).items()})
        record["deepspeed_buffers"] = {name: sum(s.values()) for name, s in sorted(groups.items())
                                       if sum(s.values()) > 0}
        # DeepSpeed's fp32 copy of this rank's partition, which the torch optimizer updates (ZeRO-1/2; ZeRO-3)
        record["fp32_master_bytes"] = sum(record["deepspeed_buffers"].get(name, 0) for name in
                                          ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"))
    return record


def watch_peak_composition(found: list) -> None:
    """Diagnostics (LEANTUNE_BENCH_PEAK_DETAIL=1): at the measured step's peak, every live storage >= 1 MiB by part."""
    from leantune.metrics import memory_breakdown

    original = memory_breakdown._tracker_class

    def tracker_class():
        base = original()

        class Detailed(base):
            def _update_peak_stats(self, peak_state):
                before = dict(self._peak_mem)
                super()._update_peak_stats(peak_state)
                if self._peak_mem != before:
                    sizes = [(w.reftype.name, w.mem_consumed) for w, _ in self._WINFO.values() if w.mem_consumed >= MIB]
                    found[:] = [sorted(sizes, key=lambda item: -item[1]), self._mod_tracker.parents.copy(),
                                self._mod_tracker.is_bw, self._in_opt]

        return Detailed

    memory_breakdown._tracker_class = tracker_class


def worker(out: str, assets: str, batch_size: int, steps: int) -> None:
    import torch
    from datasets import load_dataset
    from transformers import TrainerCallback

    import leantune

    torch.set_num_threads(1)
    accounting, peak_detail = {}, []
    if os.environ.get("LEANTUNE_BENCH_PEAK_DETAIL") == "1":
        watch_peak_composition(peak_detail)

    class EngineAccounting(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:  # right after the step the MemoryBreakdownCallback measured (the second)
                accounting.update(engine_accounting(trainer))

    args = leantune.SFTConfig(output_dir=out, report_to=[], save_strategy="no", disable_tqdm=True,
                              per_device_train_batch_size=batch_size, max_steps=steps, logging_steps=1,
                              learning_rate=1e-3, optim="adamw_torch", max_length=MAX_LENGTH, seed=0, data_seed=0)
    data = load_dataset("json", data_files=f"{assets}/sft.jsonl")["train"]
    trainer = leantune.SFTTrainer(f"{assets}/model", args=args, train_dataset=data)
    trainer.add_callback(EngineAccounting())
    trainer.train()
    state = trainer.accelerator
    breakdown = trainer.memory_breakdown
    record = {
        "rank": state.process_index,
        "world": state.num_processes,
        "engine": str(state.distributed_type).split(".")[-1],
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "memtracker": {"peak": breakdown.peak_bytes, **breakdown.parts} if breakdown is not None else None,
        "engine_accounting": accounting,
        "peak_detail": [[(k, round(v / MIB, 1)) for k, v in peak_detail[0]], sorted(peak_detail[1]),
                        peak_detail[2], peak_detail[3]] if peak_detail else None,
    }
    with open(f"{out}/rank{state.process_index}.json", "w") as handle:
        json.dump(record, handle)
    state.end_training()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/scripts/engine_run.py: no interpreter teardown after the work is written


# --- driver -----------------------------------------------------------------------------------------------------


def make_assets(root: Path, hidden: int, layers: int) -> None:
    sys.path.insert(0, str(REPO))
    from bench.common import load_tokenizer, tiny_llama, write_sft_jsonl

    model = tiny_llama(seed=0, vocab_size=32_000, hidden=hidden, layers=layers, heads=6, intermediate=1024)
    model.save_pretrained(root / "model")
    load_tokenizer().save_pretrained(root / "model")
    write_sft_jsonl(root / "sft.jsonl", 32)


def zero3_cpu_config(root: Path) -> Path:
    """examples/accelerate/zero3.yaml with devkit/cpu_engines/deepspeed_zero3_cpu.json (as tests/launch/test_scale_out.py)."""
    path = root / "zero3_cpu.yaml"
    text = (EXAMPLES / "zero3.yaml").read_text()
    text = text.replace("deepspeed_config:\n",
                        f"deepspeed_config:\n  deepspeed_config_file: {HELPERS / 'deepspeed_zero3_cpu.json'}\n")
    lines = [line for line in text.splitlines() if not line.strip().startswith(("zero_stage", "zero3_save_16bit",
                                                                                "offload_", "mixed_precision"))]
    path.write_text("\n".join(lines) + "\n")
    return path


def free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def launch(root: Path, engine: str, processes: int, steps: int) -> list[dict]:
    out = root / f"{engine}_{processes}"
    out.mkdir()
    config = zero3_cpu_config(root) if engine == "zero3" else EXAMPLES / f"{engine}.yaml"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--main_process_port", free_port(),
               __file__, "worker", str(out), str(root), str(GLOBAL_BATCH // processes), str(steps)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(LEANTUNE_BENCH_PEAK_DETAIL=os.environ.get("LEANTUNE_BENCH_PEAK_DETAIL", "0"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               TORCH_EXTENSIONS_DIR=str(root / "torch_extensions"))
    if engine == "fsdp2":
        env.update(PYTHONPATH=os.pathsep.join([str(HELPERS), str(REPO)]), LEANTUNE_TEST_CPU_FSDP="1")
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    if run.returncode != 0:
        raise RuntimeError(f"{engine} x {processes} failed:\n{run.stderr[-6000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def rows_of(engine: str, processes: int, ranks: list[dict]) -> list[list]:
    rows = []
    for record in ranks:
        acc, mt = record["engine_accounting"], record["memtracker"] or {}
        total = acc["logical_parameter_bytes"]
        exp_p, _, exp_o = (share * total for share in EXPECTED[engine](processes))
        master = acc.get("fp32_master_bytes", 0)
        rows.append([
            f"{engine}, {processes}", record["rank"], record["engine"],
            mt.get("parameters", 0) / MIB, acc["parameter_bytes"] / MIB, mt.get("parameters", 0) / exp_p,
            mt.get("gradients", 0) / MIB,
            mt.get("optimizer_states", 0) / MIB, acc["optimizer_state_bytes"] / MIB, acc["optimizer_state_bytes"] / exp_o,
            master / MIB, (mt.get("optimizer_states", 0) - master) / exp_o,
            (mt.get("activations", 0) + mt.get("temporaries", 0)) / MIB, mt.get("peak", 0) / MIB,
        ])
    return rows


HEADERS = ["engine, processes", "rank", "accelerate type", "P MemTracker", "P engine", "P MemTracker / expected",
           "G at peak", "O MemTracker", "AdamW moments (engine)", "moments / expected", "of O: fp32 master copy",
           "(O - master) / expected", "A+T", "step peak"]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        out, assets, batch_size, steps = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        return worker(out, assets, batch_size, steps)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", default=None)
    options = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from bench.common import markdown_table

    results, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="scale_out_memory_") as tmp:
        root = Path(tmp)
        make_assets(root, options.hidden, options.layers)
        for engine in options.engines.split(","):
            for processes in (int(n) for n in options.processes.split(",")):
                ranks = launch(root, engine, processes, options.steps)
                results[f"{engine}_{processes}"] = ranks
                rows.extend(rows_of(engine, processes, ranks))
                print(markdown_table(HEADERS, rows_of(engine, processes, ranks)), flush=True)
                for record in ranks:
                    print(f"  rank {record['rank']} losses {record['losses']} "
                          f"DeepSpeed buffers (MiB) { {k: round(v / MIB, 1) for k, v in record['engine_accounting']['deepspeed_buffers'].items()} }",
                          flush=True)
    print()
    print(markdown_table(HEADERS, rows))
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
