"""Issue 37's Qwen2.5-1.5B full fine-tune row, planned on CPU: leantune's best memory configuration against TRL 1.16's
best (gradient checkpointing + its `activation_offloading` + its fused chunked LM head) at 131,072 tokens, and the
longest length each fits on one 80 GiB GPU.

    python bench/long_context_plan.py [--length 131072] [--device h100] [--host-memory 128GiB] [--no-longest]
                                      [--out long_context_plan.json] [--layers N --hidden H ... (a smaller shape)]

Nothing is measured here: both sides are predictions, each library's own SFT step run with fake weights
(planning/fake_step.py) and metered by the same MemTracker callback. leantune's is its planner (`plan_memory`, device
terms of `--device`, checkpoint offload held to `--host-memory`); TRL's is its SFTTrainer's step traced the way
bench/real_shapes.py traces it, with TRL's activation-offloading hooks running (below). A model of more than 4 layers
is traced with 2, 3 and 4 and extrapolated when every number grows by the same bytes a layer (as the planner does).

The model is Qwen2.5-1.5B's configuration (bench/gpu/shapes.py: 28 layers, hidden 1536, 12/2 heads, intermediate
8960, vocabulary 151,936, tied) in bf16 with `bf16=True`, as the GPU kit trains it; one row of `--length` token ids a
step (batch 1), AdamW, gradient checkpointing (non-reentrant), gradient clipping off on both sides (`max_grad_norm=0`:
leantune's optimizer step inside the backward needs it, and the two then learn the same thing), lr 1e-5 constant.
- leantune: its chunked head (default), the tiled MLP with `--tile` tokens a tile (default the CUDA launch floor,
  1,024: its least memory; the planner's own rule sizes a tile as 1/16 of the device's whole memory, 298,272 tokens
  for 80 GiB, which leaves a 131,072-token step untiled), the layers' norms and attention projections at the same
  tile (`tiled_attention_projections`; off with `--no-tiled-projections`), checkpoint offload
  (`checkpoint_offload_layers`: every layer at `--length`; "auto", the fewest that fit the device within the host,
  in the longest-length search), and the optimizer step inside the backward.
  (leantune's `activation_offloading` is not used: under checkpointing it offloads the same layer inputs, and a fake
  tensor is one it keeps on the device, so the planner cannot count it; checkpoint offload is planned.)
- TRL: `activation_offloading=True` (its defaults: pinned memory, a side stream, tensors of 1 KiB and more, a stash
  of 5) and its fused LM head (on by default in TRL 1.16's SFTTrainer: 32,768-token chunks).

Why TRL's offloading needs help to be traced, and what the help changes (`trl_offload_traceable`): its hooks read
the accelerator (`torch.accelerator.current_accelerator().type`, None on a CPU-only machine: AttributeError), make a
CUDA stream, copy each tensor on the accelerator into pinned host memory, and key each saved tensor by its storage's
`data_ptr()` (0 for every fake tensor, so every one would look like one storage and never be offloaded twice). The
trace gives them: "cpu" as the accelerator (the fake model's device), a stream module whose streams and events do
nothing (the copies are shape-only; what is kept alive, and until when, is TRL's own Python: its forward stash of 5,
its backward stash until the next node), host copies as fake tensors on the "meta" device (so the meter files them
apart from the traced device, and a host ledger counts each as pinned memory rounds it: a power of two), and each
fake storage's own address (its StorageImpl) as its `data_ptr()`. TRL's rules of what to offload, what to keep and
when to bring back run unchanged. The device peak is the traced device's; the host's is the ledger's.

Activation memory = the step's peak less the parameters (and buffers), gradients and optimizer states held at that
peak, as the meter files them (with the optimizer step in the backward, leantune holds at most one parameter's
gradient at a time: the issue's "state memory" technique; the activation ratio compares what is left).

The longest length: `devkit/longest_fitting.py` over each library's prediction (the device total, the traced peak
plus the device's CUDA context and allocator rounding, within the device's memory; TRL's host bytes within
`--host-memory` too, since its hooks offload without a check), up to `--longest-limit` (default 1,048,576: a
leantune plan at 1,032,192 tokens took 430 s and 19 GB of this machine's memory; one that reaches the limit is
reported as "at least"). Time and memory grow with the length on both sides (TRL's trace runs every tile of its head;
leantune's plan here, 35 s at 131,072 tokens to 430 s at 1,032,192), printed per probe.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import warnings
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    MIB,
    finish_report,
    library_versions,
    machine_description,
    markdown_table,
    print_saved_report,
    quiet,
    source_state,
)
from bench.real_shapes import load_tokenizer, rows_dataset  # noqa: E402
from devkit.longest_fitting import longest_fitting  # noqa: E402
from leantune.memory.tiled_mlp import MIN_TILE_TOKENS  # noqa: E402

GIB = 1024 * MIB
LIBRARIES = ("leantune", "trl")
TARGET_LENGTH = 131_072
# Qwen2.5-1.5B's config.json (bench/gpu/shapes.py QWEN25_1_5B), in devkit/qwen2_shape.py's field names
QWEN25_1_5B_SHAPE = dict(layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, vocab=151_936)
STATE_PARTS = ("parameters", "buffers", "gradients", "optimizer_states")
ACTIVATION_TARGET, LENGTH_TARGET = 0.4, 4.0  # issue 37: activation memory <= 0.4x TRL's; longest length >= 4x


# --- settings -----------------------------------------------------------------------------------------------------


def model_config(opts):
    from devkit.qwen2_shape import qwen2_config

    return qwen2_config(**{name: getattr(opts, name) for name in QWEN25_1_5B_SHAPE})


def shared_fields(length: int) -> dict:
    """What both libraries are given (their defaults differ), as the GPU kit sets them, clipping off."""
    return dict(per_device_train_batch_size=1, gradient_accumulation_steps=1, max_length=length, learning_rate=1e-5,
                lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, optim="adamw_torch", seed=0,
                gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}, bf16=True,
                max_grad_norm=0.0, packing=False)


def leantune_fields(length: int, offload_layers, tile: int, projections: bool = True) -> dict:
    return {**shared_fields(length), "model_init_kwargs": {"dtype": "bfloat16"}, "tiled_mlp": True,
            "tiled_mlp_tile_size": tile, "checkpoint_offload_layers": offload_layers, "optimizer_in_backward": True,
            "tiled_attention_projections": projections}


def trl_fields(length: int) -> dict:
    return {**shared_fields(length), "activation_offloading": True}


# --- the two predictions ------------------------------------------------------------------------------------------


def side(peak: int, parts: dict, terms: int, host: int, seconds: float, **extra) -> dict:
    """One library's prediction at one length: what the table reads (bytes)."""
    return {"peak_bytes": peak, "parts": parts, "activation_bytes": activation_bytes(peak, parts),
            "device_total_bytes": peak + terms, "host_bytes": host, "seconds": round(seconds, 1), **extra}


def activation_bytes(peak: int, parts: dict) -> int:
    """The peak less the weights (parameters, buffers), gradients and optimizer states held at that peak."""
    return peak - sum(parts.get(name, 0) for name in STATE_PARTS)


def device_terms_bytes(device: str) -> int:
    from leantune.metrics.devices import device_terms

    return sum(term.bytes for term in device_terms(device, {}, 1, "ddp"))


def plan_leantune(config, length: int, opts, tokenizer, offload_layers) -> dict:
    """leantune's planner on its SFT step (fake weights), for the GPU `opts.device` with host `opts.host_memory`."""
    from leantune.planning.planner import plan_memory

    started = time.perf_counter()
    plan = plan_memory(config, rows_dataset(length, opts.vocab, 0, 1), "sft", processing_class=tokenizer,
                       device=opts.device, host_memory=opts.host_memory, measured_step=False, max_batches=1,
                       **leantune_fields(length, offload_layers, opts.tile, not opts.no_tiled_projections))
    step = plan.worst
    offload = plan.offload
    return side(step.peak_bytes, dict(step.parts), plan.device_total_bytes - plan.peak_bytes,
                offload.host_bytes if offload else 0, time.perf_counter() - started,
                offloaded_layers=offload.layers if offload else 0, notes=list(plan.notes))


class HostLedger:
    """The host copies TRL's hooks make (fake tensors on "meta"): bytes live now and at most, raw and as pinned memory
    takes them (CUDA's caching host allocator: each block a power of two)."""

    def __init__(self):
        self.live = self.peak = self.live_pinned = self.peak_pinned = 0

    def add(self, tensor, pinned: bool) -> None:
        from leantune.memory.checkpoint_offload import pinned_bytes

        size = tensor.numel() * tensor.element_size()
        held = pinned_bytes(size) if pinned else size
        self.live += size
        self.live_pinned += held
        self.peak, self.peak_pinned = max(self.peak, self.live), max(self.peak_pinned, self.live_pinned)
        weakref.finalize(tensor, self._release, size, held)

    def _release(self, size: int, held: int) -> None:
        self.live -= size
        self.live_pinned -= held


class _NoStreams:
    """A device module whose streams and events do nothing: what TRL's hooks keep alive is decided by their own Python
    (stashes), not by the streams."""

    class Stream(torch.cpu.Stream):
        def synchronize(self) -> None:
            pass

    _current = None

    @classmethod
    def current_stream(cls):
        if cls._current is None:
            cls._current = cls.Stream()
        return cls._current

    @staticmethod
    @contextlib.contextmanager
    def stream(stream):
        yield

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def synchronize() -> None:
        pass


class _HostOnMeta:
    """TRL's module's `torch`, with host allocations made as fake tensors on the "meta" device (counted apart from the
    traced device, and in the ledger)."""

    def __init__(self, torch_module, fake_mode, ledger: HostLedger):
        self._torch, self._fake_mode, self._ledger = torch_module, fake_mode, ledger

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def _on_host(self, make, pin_memory: bool):
        with self._fake_mode:
            tensor = make()
        self._ledger.add(tensor, pin_memory)
        return tensor

    def empty_like(self, source, *, pin_memory=False, device=None, **kwargs):
        return self._on_host(lambda: self._torch.empty_like(source, device="meta", **kwargs), pin_memory)

    def empty(self, *size, pin_memory=False, device=None, **kwargs):
        return self._on_host(lambda: self._torch.empty(*size, device="meta", **kwargs), pin_memory)


@contextlib.contextmanager
def trl_offload_traceable(mode, ledger: HostLedger):
    """TRL's activation offloading, runnable in the fake step (module docstring): the accelerator is "cpu" while the
    trainer builds its hooks, host copies go to the ledger on "meta", a fake storage's `data_ptr()` is its own
    address. Yields a function that gives built hooks the stream module that does nothing."""
    import trl.models.activation_offloading as offloading

    original_ptr = torch.UntypedStorage.data_ptr
    original_accelerator = torch.accelerator.current_accelerator
    original_torch = offloading.torch

    def data_ptr(storage):
        return storage._cdata if storage.device.type == "meta" else original_ptr(storage)

    def streamless(hooks):
        if hasattr(hooks, "device_module"):
            hooks.device_module = _NoStreams
            if hooks.use_streams:
                hooks.s1 = _NoStreams.Stream()
        return hooks

    torch.UntypedStorage.data_ptr = data_ptr
    torch.accelerator.current_accelerator = lambda *args, **kwargs: torch.device("cpu")
    offloading.torch = _HostOnMeta(torch, mode.fake_mode, ledger)
    try:
        with warnings.catch_warnings(), trl_head_as_on_gpu(mode):
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield streamless
    finally:
        torch.UntypedStorage.data_ptr = original_ptr
        torch.accelerator.current_accelerator = original_accelerator
        offloading.torch = original_torch


@contextlib.contextmanager
def trl_head_as_on_gpu(mode):
    """TRL's fused LM head (trl/kernels/chunked_logprob.py) on the path it takes on a CUDA device: off CUDA it folds
    each [4,096 tokens, 32,768 vocabulary] tile in torch (fp32 copies of the tile: GiBs no GPU step holds) and
    accumulates its gradient GEMMs through fp32 copies; on CUDA its Triton kernels fold the tile in place (a launch on
    fake tensors is skipped, planning/fake_step.py, as the planner does for Liger's) and `torch.addmm(...,
    out_dtype=float32)` accumulates without copies. Its buffers are made inside the function from no fake input, so
    it runs with every tensor fake (as a model is built): no real [tokens, vocabulary] arithmetic on this CPU.
    Not followed: the head's caller (`_fused_forward`) on CUDA gathers the target rows (`hidden[mask]`, a copy) where
    off CUDA it reshapes (a view); every row here is a target, so the rows are the same, and the gathered copy
    ([tokens - 1, hidden] bf16, 0.375 GiB at 131,072 tokens, saved by the head and so offloaded by TRL's hooks) is a
    stated gap: the fake step cannot count the rows of a mask computed under its hooks."""
    import trl.kernels.chunked_logprob as head

    function = head.ChunkedLogProbFunction
    saved = {"forward": function.__dict__["forward"], "backward": function.__dict__["backward"]}
    saved_use, saved_addmm = head._use_triton, head._addmm_fp32

    def all_fake(method):
        def run(*args, **kwargs):
            with mode.building():
                return method(*args, **kwargs)

        return staticmethod(run)

    def addmm_fp32_as_on_cuda(acc, a, b):  # TRL's branch for a half-precision CUDA product (torch >= 2.8)
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)

    function.forward = all_fake(saved["forward"].__func__)
    function.backward = all_fake(saved["backward"].__func__)
    head._use_triton = lambda device: True
    head._addmm_fp32 = addmm_fp32_as_on_cuda
    try:
        yield
    finally:
        function.forward, function.backward = saved["forward"], saved["backward"]
        head._use_triton = saved_use
        head._addmm_fp32 = saved_addmm


def trace_trl_once(config, length: int, opts, tokenizer) -> dict:
    """TRL's SFTTrainer, its second step traced with fake weights and its offloading hooks: (peak, parts, host)."""
    from transformers import set_seed
    from trl import SFTConfig, SFTTrainer

    from leantune.metrics.memory_breakdown import MemoryBreakdownCallback
    from leantune.planning.fake_step import fake_model_from_config
    from leantune.planning.planned_run import planning_session
    from leantune.planning.planner import _quiet, _train_quietly

    breakdowns, ledger = [], HostLedger()
    with tempfile.TemporaryDirectory(prefix="long-context-trl-") as output_dir, planning_session() as mode, \
            trl_offload_traceable(mode, ledger) as streamless:
        args = SFTConfig(output_dir=output_dir, max_steps=2, use_cpu=True, report_to=[], save_strategy="no",
                         logging_steps=1, disable_tqdm=True, dataset_num_proc=None, **trl_fields(length))
        fake = fake_model_from_config(config, mode, dtype=torch.bfloat16)
        set_seed(0)
        trainer = SFTTrainer(model=fake, args=args, train_dataset=rows_dataset(length, opts.vocab, 0, 2),
                             processing_class=tokenizer,
                             callbacks=[MemoryBreakdownCallback(args.device, breakdowns.append, step=1)])
        streamless(trainer.maybe_activation_offload_context)
        _quiet(trainer)
        _train_quietly(trainer)
    if not breakdowns:
        raise RuntimeError("the traced TRL step produced no memory breakdown")
    found = breakdowns[0]
    return {"peak_bytes": found.peak_bytes, "parts": dict(found.parts), "host_bytes": ledger.peak,
            "host_pinned_bytes": ledger.peak_pinned, "host_meter_bytes": found.other_devices.get("meta", 0)}


LAYERS_TRACED = (2, 3, 4)


def extrapolated(traces: list[dict], layers: int) -> dict | None:
    """The traces at LAYERS_TRACED layers carried to `layers`, when every number grew by the same bytes a layer."""
    def line(values):
        first, second, third = values
        return None if second - first != third - second else first + (layers - LAYERS_TRACED[0]) * (second - first)

    out = {name: line([trace[name] for trace in traces]) for name in traces[0] if name != "parts"}
    names = set().union(*(trace["parts"] for trace in traces))
    out["parts"] = {name: line([trace["parts"].get(name, 0) for trace in traces]) for name in names}
    if None in out.values() or None in out["parts"].values():
        return None
    return out


def trace_trl(config, length: int, opts, tokenizer) -> dict:
    """TRL's prediction at `length`: extrapolated from 2, 3 and 4 layers where exact, else traced whole."""
    from leantune.planning.planner import _with_layers

    started = time.perf_counter()
    layers = config.num_hidden_layers
    found = None
    if layers > LAYERS_TRACED[-1]:
        found = extrapolated([trace_trl_once(_with_layers(config, n), length, opts, tokenizer)
                              for n in LAYERS_TRACED], layers)
    how = "extrapolated from 2, 3, 4 layers (exact: linear)" if found else "traced whole"
    if found is None:
        found = trace_trl_once(config, length, opts, tokenizer)
    return side(found["peak_bytes"], found["parts"], device_terms_bytes(opts.device), found["host_pinned_bytes"],
                time.perf_counter() - started, host_raw_bytes=found["host_bytes"],
                host_meter_bytes=found["host_meter_bytes"], how=how)


# --- the table ----------------------------------------------------------------------------------------------------


def ratio(a, b):
    return a / b if a is not None and b else None


def summarise(report: dict) -> dict:
    """The ratios the issue's targets read."""
    at = report.get("at_length", {})
    longest = report.get("longest", {})
    lt, tr = at.get("leantune"), at.get("trl")
    out = {}
    if lt and tr:
        out["peak_ratio"] = ratio(lt["peak_bytes"], tr["peak_bytes"])
        out["activation_ratio"] = ratio(lt["activation_bytes"], tr["activation_bytes"])
        out["activation_target_met"] = out["activation_ratio"] is not None and out["activation_ratio"] <= \
            ACTIVATION_TARGET
    if longest.get("leantune") and longest.get("trl"):
        out["longest_ratio"] = ratio(longest["leantune"]["length"], longest["trl"]["length"])
        out["longest_target_met"] = out["longest_ratio"] is not None and out["longest_ratio"] >= LENGTH_TARGET
    return out


def gib(size) -> str:
    return "-" if size is None else f"{size / GIB:.2f}"


def render(report: dict) -> str:
    length = report["options"]["length"]
    at, summary = report.get("at_length", {}), report.get("summary", {})
    rows = []
    for library in LIBRARIES:
        found = at.get(library)
        if not found:
            continue
        parts = found["parts"]
        rows.append([library, gib(found["peak_bytes"]), gib(parts.get("parameters", 0) + parts.get("buffers", 0)),
                     gib(parts.get("gradients", 0)), gib(parts.get("optimizer_states", 0)),
                     gib(found["activation_bytes"]), gib(found["device_total_bytes"]), gib(found["host_bytes"]),
                     f"{found['seconds']:.0f}"])
    headers = [f"{length:,} tokens", "peak GiB", "weights", "gradients", "optimizer", "activation memory",
               "device total", "host (pinned)", "s to predict"]
    lines = [markdown_table(headers, rows), ""]
    if "activation_ratio" in summary:
        lines.append(f"- activation memory, leantune / TRL: {summary['activation_ratio']:.3f} (target <= "
                     f"{ACTIVATION_TARGET}; {'met' if summary['activation_target_met'] else 'NOT met'}, predicted); "
                     f"step peak ratio {summary['peak_ratio']:.3f}")
    for library in LIBRARIES:
        found = report.get("longest", {}).get(library)
        if found:
            lines.append(f"- longest length in {report['budget_gib']:.2f} GiB ({report['options']['device']}), "
                         f"{library} (predicted): {'at least ' if found.get('at_limit') else ''}{found['length']:,} "
                         f"tokens (device total "
                         f"{gib(found['device_total_bytes'])} GiB, host {gib(found['host_bytes'])} GiB; "
                         f"{found['probes']} probes, {found['seconds']:.0f} s)")
    if summary.get("longest_ratio") is not None:
        bound = "at least " if report["longest"]["leantune"].get("at_limit") else ""
        lines.append(f"- longest length, leantune / TRL: {bound}{summary['longest_ratio']:.2f}x (target >= "
                     f"{LENGTH_TARGET:g}x; "
                     f"{'met' if summary['longest_target_met'] else 'NOT met'}, predicted)")
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=TARGET_LENGTH, help="tokens a step for the comparison")
    parser.add_argument("--device", default="h100", help="the GPU planned for (a name of leantune.metrics.devices."
                        "GPUS or a size; default h100: the issue's 80 GiB GPU)")
    parser.add_argument("--budget", default=None, help="the device memory to fit (default: --device's size)")
    parser.add_argument("--host-memory", default="128GiB", help="host memory (default 128GiB: the GPU kit's machine)")
    parser.add_argument("--tile", type=int, default=MIN_TILE_TOKENS["cuda"],
                        help="leantune's tiled-MLP tile in tokens (default: the CUDA launch floor, its least memory)")
    parser.add_argument("--no-longest", action="store_true", help="skip the longest-length search")
    parser.add_argument("--no-tiled-projections", action="store_true",
                        help="leantune without `tiled_attention_projections` (the norms and q/k/v/o untiled)")
    parser.add_argument("--longest-step", type=int, default=4096, help="the search's resolution in tokens")
    parser.add_argument("--longest-limit", type=int, default=1 << 20, help="the longest length searched")
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the shared Mistral one)")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--render", default=None, metavar="JSON", help="print the table of an earlier --out and exit")
    for name, value in QWEN25_1_5B_SHAPE.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value,
                            help=f"model shape (default Qwen2.5-1.5B's {value})")
    opts = parser.parse_args(argv)
    unknown = set(opts.libraries.split(",")) - set(LIBRARIES)
    if unknown:
        parser.error(f"--libraries: unknown {sorted(unknown)}; choose from {list(LIBRARIES)}")
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed gradient_checkpointing fields
    if opts.render:
        return print_saved_report(opts.render, summarise, render)
    from leantune.metrics.devices import parse_budget

    quiet()
    started = time.perf_counter()
    config, tokenizer = model_config(opts), load_tokenizer(opts)
    libraries = [name for name in LIBRARIES if name in opts.libraries.split(",")]
    budget, host = parse_budget(opts.budget or opts.device), parse_budget(opts.host_memory)
    print(f"# long-context plan: {machine_description()}")
    print(f"# {library_versions('transformers', 'trl', 'torch')}; {source_state()}")
    print(f"# model: Qwen2 hidden {opts.hidden}, {opts.layers} layers, {opts.heads}/{opts.kv_heads} heads, intermediate "
          f"{opts.intermediate}, vocab {opts.vocab:,}, tied, bf16; batch 1 x {opts.length:,} tokens; device "
          f"{opts.device} ({budget / GIB:.2f} GiB), host {host / GIB:.0f} GiB", flush=True)
    report = {"options": vars(opts), "machine": machine_description(), "source": source_state(),
              "versions": library_versions("transformers", "trl", "torch"), "budget_gib": budget / GIB,
              "at_length": {}, "longest": {}}

    def save():
        report["summary"] = summarise(report)
        if opts.out:
            Path(opts.out).write_text(json.dumps(report, indent=1, default=str))

    predictors = {"leantune": lambda n, layers: plan_leantune(config, n, opts, tokenizer, layers),
                  "trl": lambda n, _layers: trace_trl(config, n, opts, tokenizer)}
    for library in libraries:  # every layer's input offloaded: leantune's least device memory at this length
        found = report["at_length"][library] = predictors[library](opts.length, opts.layers)
        print(f"{opts.length:>8} {library:9s} peak {gib(found['peak_bytes'])} GiB, activation memory "
              f"{gib(found['activation_bytes'])} GiB, host {gib(found['host_bytes'])} GiB ({found['seconds']:.0f} s)",
              flush=True)
        save()
    if not opts.no_longest:
        for library in libraries:
            report["longest"][library] = longest_of(library, predictors[library], opts, budget, host)
            save()
    return finish_report(report, started, save, render)


def longest_of(library: str, predict, opts, budget: int, host: int) -> dict:
    """The longest length whose prediction fits the device (and the host): leantune with checkpoint offload "auto"."""
    started, probes = time.perf_counter(), {}

    def probe(length: int) -> int:
        try:
            found = predict(length, "auto")
        except ValueError as error:  # the planner refuses an offload the host cannot hold
            print(f"  probe {library} {length:,}: refused ({error})", flush=True)
            probes[length] = None
            return budget + 1
        probes[length] = found
        over_host = found["host_bytes"] > host
        print(f"  probe {library} {length:,} tokens: device {gib(found['device_total_bytes'])} GiB, host "
              f"{gib(found['host_bytes'])} GiB{' (over the host)' if over_host else ''} ({found['seconds']:.0f} s)",
              flush=True)
        return budget + 1 if over_host else found["device_total_bytes"]

    length, _ = longest_fitting(probe, budget, opts.length, step=opts.longest_step, limit=opts.longest_limit)
    found = probes.get(length) or {}
    return {"length": length, "at_limit": length >= opts.longest_limit,
            "device_total_bytes": found.get("device_total_bytes"),
            "host_bytes": found.get("host_bytes"), "probes": len(probes),
            "seconds": round(time.perf_counter() - started, 1), "predicted": True}


if __name__ == "__main__":
    sys.exit(main())
