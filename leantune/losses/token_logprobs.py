"""The causal-LM targets (the token each position predicts, how many positions are learned: the count a step's summed
loss is divided by) and their log-probabilities, from full logits or from hidden states chunk by chunk.

Every loss in leantune is written once over per-target log-probabilities. They come either from the model's
logits (the plain path) or from `chunked_logprobs`, which selects the target positions first, then applies the
output head to `chunk_size` of them at a time (the projection in the head's dtype: a bf16 model's runs on tensor
cores, accumulating in fp32; the log-softmax in fp32; the rows per chunk: `chunk_rows_for`), and never keeps more
than one chunk of logits: the forward pass keeps only the hidden states it was given, and the backward pass
recomputes each chunk's logits to form its gradients (one extra head matmul for the memory of one chunk instead of
tokens x vocabulary).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from ..data.collators import IGNORE_INDEX  # the label of a position that is not learned, set by the collators
from ..models.output_head import OutputHead

# One chunk of fp32 logits is at most this large (x3 while its gradient is formed); vocabulary-independent. The
# CPU's chunk (and every device's when its free memory is unknown); `chunk_rows_for` sizes a GPU's.
CHUNK_BYTES = 64 * 1024 * 1024
# Rows per chunk at which a GPU's head matmuls reach their speed; and the share of free memory a chunk may take.
GPU_CHUNK_ROWS = 2048
GPU_CHUNK_MEMORY_SHARE = 1 / 8


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """The token each position predicts: labels moved one step left, the last position predicting nothing."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels[..., 1:] != IGNORE_INDEX).sum()


@dataclass
class Targets:
    """The positions whose next token is learned, flattened over [batch, time], and those next tokens."""

    index: torch.Tensor
    tokens: torch.Tensor
    shape: torch.Size

    def __len__(self) -> int:
        return int(self.index.numel())

    def scatter(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Per-target values back on the [batch, time] grid (positions without a target get `fill`)."""
        grid = values.new_full((self.shape.numel(),), fill)
        return grid.index_copy(0, self.index, values).view(self.shape)


@dataclass
class TargetScores:
    """What the log-prob engine (trainers/parts/logprob_engine.py) gives a loss for one forward pass: fp32 log-probs
    of the targets, their entropies when asked for, the named TOKEN_STATS, the targets themselves, the model's
    outputs (without logits on the chunked and Liger paths) and, when asked for, the last hidden states at the target
    positions ([num_targets, hidden], with their gradient: a value head reads them)."""

    logps: torch.Tensor
    targets: Targets
    outputs: object = None
    entropy: torch.Tensor | None = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    hidden: torch.Tensor | None = None


def target_sequences(targets: Targets, starts: torch.Tensor) -> torch.Tensor:
    """Which sequence each target belongs to, from the sequences' flat start offsets (any layout)."""
    return torch.searchsorted(starts.to(targets.index.device), targets.index, right=True) - 1


@dataclass
class TargetSequences:
    """Which sequence each target belongs to and its 0-based rank among that sequence's targets, and `total`, which
    turns per-sequence partial sums into whole-sequence sums. A process holding whole sequences needs no `total`;
    under context parallelism each process holds part of every sequence, so its sums are partial and `total` sums
    them over the context-parallel group (trainers/parts/context_parallel.py), before any loss reads them."""

    sequence: torch.Tensor
    known_rank: torch.Tensor | None  # None: contiguous targets, their rank computed when first read (`rank`)
    total: object = None  # (per-sequence partial sums) -> whole-sequence sums; None: they are whole already

    @classmethod
    def contiguous(cls, targets: Targets, starts: torch.Tensor) -> TargetSequences:
        """From the sequences' flat start offsets: the targets of one sequence are contiguous and in order. Their
        ranks are computed only if read (LD-DPO, context parallelism): five small ops every other step skips."""
        return cls(target_sequences(targets, starts), None)

    @property
    def rank(self) -> torch.Tensor:
        if self.known_rank is None:
            sequence = self.sequence
            lengths = torch.bincount(sequence) if sequence.numel() else sequence.new_zeros(0)
            first = torch.cumsum(lengths, 0) - lengths  # index of each sequence's first target among all targets
            self.known_rank = torch.arange(sequence.numel(), device=sequence.device) - first[sequence]
        return self.known_rank

    def sums(self, values: torch.Tensor, num_sequences: int) -> torch.Tensor:
        """Per-target values summed per whole sequence."""
        partial = per_sequence_sum(values, self.sequence, num_sequences)
        return partial if self.total is None else self.total(partial)

    def lengths(self, num_sequences: int) -> torch.Tensor:
        """The number of targets of each whole sequence."""
        partial = torch.bincount(self.sequence, minlength=num_sequences)[:num_sequences]
        return partial if self.total is None else self.total(partial)


def per_sequence_sum(values: torch.Tensor, sequence: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """Per-target values summed per sequence (`sequence`: each target's sequence, e.g. from `target_sequences`)."""
    return values.new_zeros(num_sequences).index_add(0, sequence, values)


def select_targets(labels: torch.Tensor, shifted: bool = False) -> Targets:
    """The targets of `labels` (the token at each position; `shifted`: already the NEXT token at each position)."""
    shifted = (labels if shifted else shifted_targets(labels)).reshape(-1)
    index = (shifted != IGNORE_INDEX).nonzero().squeeze(-1)
    return Targets(index, shifted.index_select(0, index), labels.shape)


def logprobs_from_logits(logits: torch.Tensor, targets: Targets, temperature: float = 1.0) -> torch.Tensor:
    """Plain path: fp32 log-probabilities of the targets from the model's full logits (their rows only)."""
    flat = logits.reshape(-1, logits.shape[-1]).index_select(0, targets.index).float()
    if temperature != 1.0:
        flat = flat / temperature
    return -F.cross_entropy(flat, targets.tokens, reduction="none")


def chunk_tokens_for(vocab_size: int, budget_bytes: int = CHUNK_BYTES) -> int:
    return max(16, budget_bytes // (4 * max(1, vocab_size)))


def chunk_rows_for(vocab_size: int, device_type: str = "cpu", free_bytes: int | None = None) -> int:
    """The chunked head's rows per chunk on this device: matmul efficiency against memory.

    Each chunk runs three head matmuls ([rows, hidden] x [hidden, vocabulary] for its logits, and in the backward
    its recomputation, the hidden states' gradient and the weight's `grad^T @ hidden`, added in place into one
    weight-sized sum). A matmul with `rows` rows does ~2 x rows flops per weight element it reads (and the in-place
    add reads and writes the whole weight-sized sum once per chunk), so with few rows it is memory-bound: on an
    H100 the fixed CHUNK_BYTES gave 110 rows at a 152k vocabulary and 12.9 ms of memory-bound `addmm_` a step. A
    GPU's tensor cores need ~1-2k rows to be compute-bound, so a GPU chunk has GPU_CHUNK_ROWS rows, which also
    makes the weight-gradient adds ~19x fewer. Memory bounds it: the chunk's [rows, vocabulary] fp32 buffers (up
    to three while its gradient forms) stay within GPU_CHUNK_MEMORY_SHARE of the device's free memory, read once
    when the settings are resolved (`free_bytes`). On CPU (or with free memory unknown) the chunk stays CHUNK_BYTES'
    (the CPU's matmuls are fast at any row count, and its memory is the budget), so CPU behaviour is unchanged.
    Never below that figure; a user's `loss_chunk_size` is used instead of this rule, whatever it gives."""
    rows = chunk_tokens_for(vocab_size)
    if device_type == "cpu" or free_bytes is None:
        return rows
    fits = int(free_bytes * GPU_CHUNK_MEMORY_SHARE) // (3 * 4 * max(1, vocab_size))
    return max(rows, min(GPU_CHUNK_ROWS, fits))


# --- which chunks run ---------------------------------------------------------------------------------------
# Which chunks a chunked loss runs (the chunked head below, losses/distillation.py), and which tiles the tiled MLP
# runs (memory/tiled_mlp.py: each full tile allocates and frees the same as the one before it, too).
#
# A real step runs every chunk. The planner's fake step (planning/planned_run.py) runs only the chunks whose memory
# can differ, so that its time does not grow with the length: the first (it creates the running sums of the head's
# gradients that later chunks add to in place), the second (the first in that steady state) and the last (it may be
# shorter). Every full chunk between them allocates and frees exactly what the second did, over the same live tensors,
# so the step's peak and its parts are the same to the byte, and a fake chunk computes no number that anything reads.

_repeats_skipped = False


def chunk_starts(rows, chunk_size: int):
    """The start of each chunk of `rows` (a tensor's first dimension) that runs: all of them, except on a fake tensor
    inside `repeated_chunks_skipped`."""
    starts = range(0, rows.shape[0], chunk_size)
    if not (_repeats_skipped and isinstance(rows, FakeTensor)) or len(starts) <= 3:
        return starts
    return [starts[0], starts[1], starts[-1]]


@contextlib.contextmanager
def repeated_chunks_skipped(skipped: bool = True):
    """Within it, a chunked loss over fake tensors runs its first two chunks and its last only (`skipped=False`: all)."""
    global _repeats_skipped
    before, _repeats_skipped = _repeats_skipped, skipped
    try:
        yield
    finally:
        _repeats_skipped = before


def chunked_logprobs(hidden: torch.Tensor, head: OutputHead, targets: Targets, chunk_size: int | None = None,
                     with_entropy: bool = False, entropy_grad: bool = False, stats: tuple[str, ...] = ()):
    """fp32 [num_targets] log-probs of the targets from the last hidden states ([batch, time, hidden] or flat), one
    chunk's logits at a time; then, with `with_entropy`, their entropies (with gradient for an entropy bonus:
    `entropy_grad`), then one [num_targets] tensor per name in `stats` (TOKEN_STATS, without gradient)."""
    flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, targets.index)
    chunk_size = chunk_size or chunk_tokens_for(head.vocab_size)
    unknown = set(stats) - set(TOKEN_STATS)
    if unknown:
        raise ValueError(f"Unknown token statistics {sorted(unknown)}; known: {sorted(TOKEN_STATS)}.")
    def run(flat):  # as the head's forward: sharding engines gather its weight around it and its backward
        return _ChunkedHeadLogProbs.apply(flat, targets.tokens, head, int(chunk_size), with_entropy,
                                          with_entropy and entropy_grad, tuple(stats), *head.trainable_parameters)

    logps, entropy, values = head.call_as_head(run, flat)
    extra = ([entropy] if with_entropy else []) + [_as_stat(name, values[:, i]) for i, name in enumerate(stats)]
    return (logps, *extra) if extra else logps


# Per-target statistics of the logits (no gradient), from one [tokens, vocabulary] chunk L of them and its log-norm:
# top1: whether the target is the argmax (TRL's mean_token_accuracy); log_sum_sq_probs: log sum_v p_v^2 (WPO).
# The chunked head computes the same values in place on its chunk (`_chunk_scores`); these serve full logits.
TOKEN_STATS = {
    "top1": lambda logits, log_norm, tokens: (logits.argmax(dim=-1) == tokens).float(),
    "log_sum_sq_probs": lambda logits, log_norm, tokens: torch.logsumexp(2 * logits, dim=-1) - 2 * log_norm,
}


BOOL_STATS = ("top1",)  # computed as floats (one buffer for every statistic), returned as bools


def _as_stat(name: str, values: torch.Tensor) -> torch.Tensor:
    return values.bool() if name in BOOL_STATS else values


def token_stats_from_logits(logits: torch.Tensor, tokens: torch.Tensor, stats: tuple[str, ...]) -> list[torch.Tensor]:
    """The same statistics from full [targets, vocabulary] logits."""
    with torch.no_grad():
        logits = logits.float()
        log_norm = torch.logsumexp(logits, dim=-1)
        return [_as_stat(name, TOKEN_STATS[name](logits, log_norm, tokens)) for name in stats]


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_v a[:, v] * b[:, v] as a batched matmul: no [rows, vocabulary] product is formed."""
    return (a.unsqueeze(-2) @ b.unsqueeze(-1)).reshape(a.shape[0])


def _shift_by_row_max(logits: torch.Tensor) -> torch.Tensor:
    """logits - max per row, in place (as torch.logsumexp: an infinite maximum shifts by 0); returns the maxima.
    One op zeroes an infinite maximum (nan_to_num_, not isinf + masked_fill_); it also zeroes a NaN one, whose row
    is NaN either way (its logits hold the NaN)."""
    top = logits.amax(dim=-1, keepdim=True)
    top.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    logits.sub_(top)
    return top


def _chunk_scores(logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool, stats: tuple[str, ...],
                  out: torch.Tensor | None = None, stats_out: torch.Tensor | None = None,
                  entropy_out: torch.Tensor | None = None):
    """(log-probs of `tokens`, entropies or None, the `stats` as TOKEN_STATS defines them) of one chunk's fp32
    logits, which it overwrites. `out` / `entropy_out` / `stats_out`: where the log-probs / entropies / the top-1
    column are written (the chunked head's result rows: no copy op per chunk).

    Why not torch.logsumexp / torch.softmax: logsumexp allocates a [chunk, vocabulary] buffer inside the op and frees
    it before returning, which no dispatch-level meter sees (neither the plan's trace nor MemTracker), and entropy
    as softmax(L) * L forms two more. Here the chunk is shifted by its row maxima in place, so the only other
    [chunk, vocabulary] buffer is its exponentials, and only when entropy is asked for (otherwise they overwrite it
    too); row sums of products are batched matmuls. Same formula as torch.logsumexp: log sum exp(L - max) + max.
    """
    target = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    values = {}
    if "top1" in stats:  # before the shift, which could round two logits into a tie
        column = None if stats_out is None else stats_out[:, stats.index("top1")]
        values["top1"] = (torch.eq(logits.argmax(dim=-1), tokens, out=column) if column is not None
                          else TOKEN_STATS["top1"](logits, None, tokens))
    top = _shift_by_row_max(logits).squeeze(-1)
    exp = logits.exp() if with_entropy else logits.exp_()
    total = exp.sum(-1)
    log_total = total.log()
    log_norm = log_total + top
    if "log_sum_sq_probs" in stats:  # log sum_v p_v^2 = log sum_v exp(2 (L_v - max)) - 2 log sum_v exp(L_v - max)
        values["log_sum_sq_probs"] = _row_dot(exp, exp).log() - 2 * log_total
    entropy = None
    if with_entropy:  # H = log_norm - sum_v p_v L_v = log total - sum_v exp(L_v - max) (L_v - max) / total
        entropy = torch.sub(log_total, _row_dot(exp, logits).div_(total), out=entropy_out)
    return torch.sub(target, log_norm, out=out), entropy, [values[name] for name in stats]


def _projection_gradient(raw: torch.Tensor, tokens: torch.Tensor, grad_logps: torch.Tensor, head: OutputHead,
                         grad_entropy: torch.Tensor | None = None, negated: torch.Tensor | None = None):
    """d(sum grad_logps * logp + sum grad_entropy * H)/d raw, written out so one chunk needs two [chunk, vocabulary]
    buffers at most.

    logp = L[y] - logsumexp(L) and H = -sum p log p with L = softcap(raw * scale) / temperature, so
    dlogp/dL = onehot(y) - p, dH/dL = -p (log p + H), and dL/draw = scale / temperature * (1 - tanh^2) with
    tanh = L * temperature / softcap. `negated`: -grad_logps in fp32 (the caller's, negated once for every chunk).
    """
    logits = head.transform(raw)
    capped = None
    if head.softcap is not None:
        capped = 1.0 - (logits * (head.temperature / head.softcap)).square()
    _shift_by_row_max(logits)  # softmax in place (no torch.logsumexp: see _chunk_scores)
    upstream = grad_logps.float().unsqueeze(-1)
    targets = tokens.unsqueeze(-1)
    if grad_entropy is None:  # (onehot - softmax) g as exp * (-g / sum exp) + onehot g: one pass over the chunk
        grad = logits.exp_()
        negated = upstream.neg() if negated is None else negated.unsqueeze(-1)
        grad.mul_(torch.div(negated, grad.sum(-1, keepdim=True)))
        grad.scatter_add_(-1, targets, upstream)
    else:
        p = logits.exp()
        total = p.sum(-1, keepdim=True)
        p.div_(total)
        log_p = logits.sub_(total.log_())
        entropy = -_row_dot(p, log_p).unsqueeze(-1)
        grad = log_p.add_(entropy).mul_(p).mul_(-grad_entropy.float().unsqueeze(-1))  # dH/dL, weighted
        grad.sub_(p.mul_(upstream))  # - p of dlogp/dL, weighted
        grad.scatter_add_(-1, targets, upstream)
        del p
    if head.scale / head.temperature != 1.0:
        grad.mul_(head.scale / head.temperature)
    if capped is not None:
        grad.mul_(capped)
    return grad.to(raw.dtype)


class HeadGradients:
    """A chunked loss's gradients of the head's trainable parameters, summed over chunks. The weight of a plain
    nn.Linear head (no hooks or replaced forward, whole here, in the compute dtype) takes each chunk's
    `grad(raw)^T @ hidden` in place, into one buffer (addmm_): autograd would return a fresh weight-sized gradient
    every chunk, a second copy of the head at the peak (0.43 GiB for Qwen2.5-1.5B's tied head in bf16). Any other
    parameter (a bias, an adapter, a quantized or hooked head) gets autograd's gradient per chunk, added. Each add
    reads and writes the whole weight-sized sum (in the weight's dtype: an fp32 sum would be that second copy), so
    small chunks make it memory-bound; `chunk_rows_for` gives a GPU chunks of ~2k rows, which makes each add
    compute-bound and the adds (and their roundings) ~19x fewer than the CPU-sized chunk's. `result()`:
    one gradient per wanted parameter, a zero one (not None) where no chunk ran, for an engine that waits for every
    parameter it saw in the forward (DDP, `capture_hidden_states(head_follows=True)`)."""

    def __init__(self, head, wanted: list, compute_dtype):
        module = head.module
        linear = (type(module) is torch.nn.Linear and "forward" not in module.__dict__ and not module._forward_hooks
                  and not module._forward_pre_hooks and module.weight.dtype == compute_dtype
                  and not head.weights_sharded())
        plain = linear and any(p is module.weight for p in wanted)
        self.linear_weight = module.weight if linear else None  # trained or frozen (LoRA)
        self.weight = module.weight if plain else None
        self.wanted, self.by_autograd = wanted, [p for p in wanted if p is not self.weight]  # autograd.grad's inputs
        self.sums = [None] * len(self.by_autograd)
        self.weight_sum = torch.zeros_like(self.weight) if plain else None

    def hidden_gradient_direct(self, hidden: torch.Tensor) -> bool:
        """Whether the hidden states' gradient is `grad(raw) @ weight` written straight into its rows (a plain head,
        frozen or with its weight its only trainable parameter, in the hidden states' dtype): the op the Linear's
        backward runs, without recording the recomputed projection's graph or copying each chunk's result."""
        return (self.linear_weight is not None and not self.by_autograd
                and hidden.dtype == self.linear_weight.dtype)

    def add_weight(self, grad_raw: torch.Tensor, hidden: torch.Tensor) -> None:
        if self.weight is not None:
            self.weight_sum.addmm_(grad_raw.t(), hidden.detach().to(self.weight.dtype))

    def add(self, grads) -> None:
        self.sums = [g if acc is None else acc.add_(g) for acc, g in zip(self.sums, grads)]

    def result(self) -> list:
        rest = iter(torch.zeros_like(p) if g is None else g for p, g in zip(self.by_autograd, self.sums))
        return [self.weight_sum if p is self.weight else next(rest) for p in self.wanted]


class _ChunkedHeadLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, tokens, head, chunk_size, with_entropy, entropy_grad, stats, *params):
        logps = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logps) if with_entropy else logps.new_empty(0)
        values = logps.new_empty(hidden.shape[0], len(stats))
        for start in chunk_starts(hidden, chunk_size):
            end = start + chunk_size
            logits = head.logits(hidden[start:end])
            _, _, chunk_values = _chunk_scores(logits, tokens[start:end], with_entropy, stats, logps[start:end],
                                               values[start:end], entropy[start:end] if with_entropy else None)
            for i, (name, value) in enumerate(zip(stats, chunk_values)):
                if name != "top1":  # written in place
                    values[start:end, i] = value
            del logits
        ctx.save_for_backward(hidden, tokens)
        ctx.head, ctx.chunk_size, ctx.params = head, chunk_size, params
        device_type = hidden.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.mark_non_differentiable(values)
        ctx.entropy_grad = entropy_grad
        return logps, entropy, values

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy, _grad_stats):
        hidden, tokens = ctx.saved_tensors
        want_hidden = ctx.needs_input_grad[0]
        wanted = [p for p, need in zip(ctx.params, ctx.needs_input_grad[7:]) if need]
        if not ctx.entropy_grad:
            grad_entropy = None
        grad_hidden = torch.empty_like(hidden) if want_hidden else None  # every chunk writes its rows
        device_type, autocast_on, autocast_dtype = ctx.autocast
        head_grads = HeadGradients(ctx.head, wanted, autocast_dtype if autocast_on else hidden.dtype)
        direct = head_grads.hidden_gradient_direct(hidden)
        negated = grad_logps.float().neg() if grad_entropy is None else None  # once, not one small op per chunk
        for start in chunk_starts(hidden, ctx.chunk_size):
            end = start + ctx.chunk_size
            piece = hidden[start:end].detach().requires_grad_(want_hidden and not direct)
            inputs = ([piece] if want_hidden and not direct else []) + head_grads.by_autograd
            with torch.set_grad_enabled(bool(inputs)), torch.autocast(device_type, dtype=autocast_dtype,
                                                                      enabled=autocast_on):
                raw = ctx.head.project(piece)
            grad_raw = _projection_gradient(raw.detach(), tokens[start:end], grad_logps[start:end], ctx.head,
                                            None if grad_entropy is None else grad_entropy[start:end],
                                            None if negated is None else negated[start:end])
            head_grads.add_weight(grad_raw, piece)
            if want_hidden and direct:  # what the Linear's backward computes, into its rows: no graph, no copy
                torch.mm(grad_raw, head_grads.linear_weight, out=grad_hidden[start:end])
            grads = torch.autograd.grad(raw, inputs, grad_raw) if inputs else ()
            del raw, grad_raw
            if want_hidden and not direct:
                grad_hidden[start:end] = grads[0]
                grads = grads[1:]
            head_grads.add(grads)
        grads_in = iter(head_grads.result())
        per_param = [next(grads_in) if need else None for need in ctx.needs_input_grad[7:]]
        return (grad_hidden, None, None, None, None, None, None, *per_param)
