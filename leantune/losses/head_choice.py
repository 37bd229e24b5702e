"""Which head computes the target log-probs when Liger is asked for: Liger's fused linear cross-entropy or leantune's
chunked head, whichever is faster on the run's device at its shape (`liger_head="auto"`), chosen once.

Why a timed probe and not a fixed rule. Both paths run the same three head matmuls per chunk (logits, the
hidden states' gradient, the weight's) with the same rows per chunk (Liger's chunk is given the chunked head's rows,
`liger_chunk_const`, at no more memory: its chunk's logits are in the compute dtype, the chunked head's up to three
fp32 copies). What separates them is the per-chunk elementwise work (Liger: one Triton kernel over the logits; the
chunked head: a few torch ops over fp32 logits, and its backward's recomputation; Liger's summed kernel forms the
gradient in the forward and recomputes nothing) against the matmuls, which depends on the GPU, the dtype, the hidden
size and the vocabulary. The one measurement there is (the H100 kit: SFT with Liger at 0.66x TRL, Liger then in 89
chunks of ~110 rows) predates both paths' device-sized chunks, so no rule could be backed by it. The probe runs
each path forward and backward on random hidden states of the head's dtype (4 chunks' rows), best of a few calls
after a warm-up (Liger's compile, which the run would pay anyway): tens of milliseconds, once when the trainer is
built. Ties go to Liger (what the user asked for). `liger_head="liger"` or `"chunked"` skips the probe.

It is not run where its figure would say nothing: on CPU (Liger runs there only in Triton's interpreter, for tests),
on fake weights (the planner's step) and on a head whose weights are sharded (ZeRO-3, FSDP): there Liger is used as
asked. Several processes time on their own devices, then take the slowest time of each path, so they all agree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..models.output_head import OutputHead
from .liger import liger_nll_sum, liger_target_logprobs
from .token_logprobs import Targets, chunked_logprobs

HEAD_CHOICES = ("auto", "liger", "chunked")
LIGER, CHUNKED = "liger", "chunked"
PROBE_CHUNKS = 4  # the probe's rows: this many of the chunked head's chunks
PROBE_REPEATS = 3  # timed calls per path after the warm-up; the fastest counts


@dataclass(frozen=True)
class HeadTimes:
    """Seconds per forward + backward of each path at `rows` targets, `chunk_rows` rows per chunk."""

    rows: int
    chunk_rows: int
    chunked: float
    liger_per_target: float
    liger_summed: float


@dataclass(frozen=True)
class LigerHeadChoice:
    """The head each kind of loss uses under Liger: `per_target` (per-target log-probs: every loss but SFT's plain
    NLL, and scoring), `summed` (SFT's summed NLL); `why`: the log line's reason (the times, or the setting)."""

    per_target: str = LIGER
    summed: str = LIGER
    why: str = "Liger as asked"

    def describe(self) -> str:
        if self.per_target == self.summed:
            heads = f"{'Liger' if self.per_target == LIGER else 'the chunked head'} for every loss"
        else:
            heads = (f"per-target log-probs: {self.per_target}, summed NLL (SFT): {self.summed}")
        return f"Liger head choice: {heads} ({self.why})."


def probe_skipped_reason(head: OutputHead, device_type: str) -> str | None:
    """Why no timing is taken here (None: it is): see the module's docstring."""
    weight = getattr(head.module, "weight", None)
    if device_type != "cuda":
        return f"not timed on {device_type}: Liger runs there in Triton's interpreter, whose time says nothing of a GPU"
    if isinstance(weight, FakeTensor) or (weight is not None and weight.device.type == "meta"):
        return "not timed on fake weights (the planner's step)"
    if head.weights_sharded():
        return "not timed: the head's weights are sharded (ZeRO-3 / FSDP)"
    return None


def choose_liger_head(setting: str, head: OutputHead, device_type: str, chunk_rows: int) -> LigerHeadChoice:
    """The heads to use under Liger: `setting` (`liger_head`: auto, liger or chunked), timed where auto asks it."""
    if setting not in HEAD_CHOICES:
        raise ValueError(f"`liger_head` must be one of {HEAD_CHOICES}, got {setting!r}.")
    if setting != "auto":
        return LigerHeadChoice(setting, setting, f"liger_head={setting!r}")
    skipped = probe_skipped_reason(head, device_type)
    if skipped is not None:
        return LigerHeadChoice(why=f"liger_head='auto', {skipped}")
    return choice_from_times(agreed(time_head_paths(head, PROBE_CHUNKS * chunk_rows, chunk_rows)))


def choice_from_times(times: HeadTimes) -> LigerHeadChoice:
    """The faster head per kind of loss (a tie: Liger), and the times that chose it. Where the summed kernel loses,
    so does the per-target one: it does the summed kernel's work and recomputes the logits in its backward, so a
    timing that says otherwise is noise (and SFT's NLL, which asks for the summed kernel first, then falls back to
    per-target log-probs, must not land on the slower of Liger's kernels)."""
    summed = LIGER if times.liger_summed <= times.chunked else CHUNKED
    per_target = LIGER if summed == LIGER and times.liger_per_target <= times.chunked else CHUNKED
    why = (f"liger_head='auto', timed once, forward + backward of {times.rows:,} targets, {times.chunk_rows:,} rows "
           f"a chunk: Liger per-target {times.liger_per_target * 1e3:.2f} ms, Liger summed "
           f"{times.liger_summed * 1e3:.2f} ms, chunked head {times.chunked * 1e3:.2f} ms")
    return LigerHeadChoice(per_target, summed, why)


def time_head_paths(head: OutputHead, rows: int, chunk_rows: int, repeats: int = PROBE_REPEATS) -> HeadTimes:
    """Each path's fastest forward + backward over `rows` random targets in the head's dtype and device. Gradients
    are returned, never accumulated into the model's `.grad`; nothing of it is kept."""
    weight = head.module.weight
    generator = torch.Generator(device=weight.device).manual_seed(0)
    hidden = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device, generator=generator)
    hidden.requires_grad_(True)
    tokens = torch.randint(head.vocab_size, (rows,), device=weight.device, generator=generator)
    targets = Targets(torch.arange(rows, device=weight.device), tokens, torch.Size((rows,)))
    upstream = torch.rand(rows, device=weight.device, generator=generator)  # a different gradient per target
    inputs = [hidden, *head.trainable_parameters]

    def chunked():
        return torch.autograd.grad(chunked_logprobs(hidden, head, targets, chunk_rows), inputs, upstream)

    def liger_per_target():
        return torch.autograd.grad(liger_target_logprobs(hidden, head, targets, chunk_rows=chunk_rows), inputs,
                                   upstream)

    def liger_summed():
        return torch.autograd.grad(liger_nll_sum(hidden, head, targets, chunk_rows=chunk_rows)[0], inputs)

    times = [_fastest(path, weight.device, repeats) for path in (chunked, liger_per_target, liger_summed)]
    return HeadTimes(rows, chunk_rows, *times)


def _fastest(path, device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `path`, after one untimed call (compiles, allocator warm-up)."""
    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    path()
    best = float("inf")
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        path()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def agreed(times: HeadTimes) -> HeadTimes:
    """Every process's slowest time of each path (when several train), so every process makes the same choice."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return times
    if torch.distributed.get_world_size() == 1:
        return times
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    figures = torch.tensor([times.chunked, times.liger_per_target, times.liger_summed], dtype=torch.float64,
                           device=device)
    torch.distributed.all_reduce(figures, op=torch.distributed.ReduceOp.MAX)
    return HeadTimes(times.rows, times.chunk_rows, *figures.tolist())
