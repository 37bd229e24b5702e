"""The log-prob engine: where a trainer's target log-probabilities come from, in one place.

It chooses the path once (the model's full logits, leantune's chunked head, or liger-kernel's fused kernels: the
config's request and what this machine can run), says so once (every Liger notice of every trainer is logged here),
and runs every forward pass of the trained model that feeds a loss: inside the activation-offloading scope, with the
hidden states captured for the chunked head or Liger, the router loss handed to the step's loss normaliser.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import weakref
from collections.abc import Callable
from enum import Enum

import torch
from accelerate.utils import DistributedType

from ...losses.head_choice import LIGER, LigerHeadChoice, choose_liger_head
from ...losses.liger import (
    OLD_LIGER,
    liger_can_run,
    liger_head_problem,
    liger_jsd_problem,
    liger_nll_sum,
    liger_target_logprobs,
    per_target_gradients_supported,
)
from ...losses.token_logprobs import (
    Targets,
    TargetScores,
    chunked_logprobs,
    logprobs_from_logits,
    select_targets,
    token_stats_from_logits,
)
from ...memory import offloading
from ...memory.offloading import log_offloading_scope
from ...models.output_head import OutputHead, head_kind
from ...utils.imports import is_available

logger = logging.getLogger("leantune.trainer")

# Values of TRITON_INTERPRET that turn Triton's interpreter on (Triton reads the variable the same way).
INTERPRETER_ON = ("1", "true", "on", "yes")
LIGER_ON_CPU = "set TRITON_INTERPRET=1 before Python starts"
INSTALL = "pip install 'leantune[liger]'"
# TRL spells the Liger request use_liger_kernel (SFT) or use_liger_loss (the other trainers); either one asks for it.
LIGER_FLAGS = ("use_liger_kernel", "use_liger_loss")


class LogProbPath(str, Enum):
    FULL = "full"  # the model computes [tokens, vocabulary] logits
    CHUNKED = "chunked"  # leantune's chunked head (any device): one chunk of logits at a time
    LIGER = "liger"  # liger-kernel's fused Triton kernels (CUDA, or CPU under Triton's interpreter)


def triton_interpreter_on() -> bool:
    """Whether Triton runs kernels on CPU tensors in its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in INTERPRETER_ON


def _liger_compiled_without_interpreter() -> bool:
    """Liger's kernels are wrapped when liger-kernel is imported: imported before TRITON_INTERPRET was set, they are
    compiled kernels, which cannot take CPU tensors. Checked without importing anything."""
    module = sys.modules.get("liger_kernel.ops.cross_entropy")
    kernel = getattr(module, "liger_cross_entropy_kernel", None)
    return kernel is not None and type(kernel).__name__ != "InterpretedFunction"


def liger_unavailable_reason(device_type: str) -> str | None:
    if device_type == "cpu" and not triton_interpreter_on():
        steps = LIGER_ON_CPU if is_available("liger_kernel") else f"{INSTALL} and {LIGER_ON_CPU}"
        return (f"liger-kernel's Triton kernels run on CUDA, or on CPU under Triton's interpreter (slow, for testing: "
                f"{steps})")
    if device_type not in ("cuda", "cpu"):
        return f"liger-kernel runs on CUDA only (training runs on {device_type})"
    if not is_available("liger_kernel"):
        return f"liger-kernel is not installed ({INSTALL})"
    if device_type == "cpu" and _liger_compiled_without_interpreter():
        return f"liger-kernel was imported before TRITON_INTERPRET was set ({LIGER_ON_CPU})"
    return None


def choose_logprob_path(fused_requested: bool, device_type: str, flag: str, chunked: bool = True) -> LogProbPath:
    """`flag` is the config field that asked for Liger (`use_liger_kernel` or `use_liger_loss`), for the notice;
    without it, `chunked` (the default) picks the built-in chunked path over the model's full logits."""
    if not fused_requested:
        return LogProbPath.CHUNKED if chunked else LogProbPath.FULL
    reason = liger_unavailable_reason(device_type)
    if reason is None:
        return LogProbPath.LIGER
    logger.warning("%s=True: %s; using leantune's chunked loss instead (same memory saving, exact).", flag, reason)
    return LogProbPath.CHUNKED


def engine_head_kind(accelerator) -> type[OutputHead]:
    """The heads' class the configured engine needs (models/output_head.py's `head_kind`), from accelerate's
    distributed type, DeepSpeed's ZeRO stage and the processes, all known when the trainer is built."""
    engine = accelerator.distributed_type
    zero3 = engine == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3
    return head_kind(engine == DistributedType.FSDP or zero3, accelerator.num_processes)


class LogProbEngine:
    """Target log-probs (and entropies, top-1 and the other TOKEN_STATS) of a trained model's forward pass, by the
    chosen path. `metrics_need_logits()`: an evaluation whose metrics read the logits (compute_metrics); `on_forward`:
    called with every forward pass's outputs of the trained model (the router loss; None: nothing to note); `head_kind`: the heads' class
    the engine needs (`engine_head_kind`)."""

    def __init__(self, settings, path: LogProbPath, metrics_need_logits: Callable[[], bool],
                 on_forward: Callable[[torch.nn.Module, object], None] | None, notice_temperature: float = 1.0,
                 head_kind: type[OutputHead] = OutputHead):
        self.settings = settings  # HeadSettings (trainers/settings.py)
        self.head_kind = head_kind
        self.path = path
        self.metrics_need_logits = metrics_need_logits
        self.on_forward = on_forward
        self.notice_temperature = notice_temperature
        self._offloader = None
        self._heads = weakref.WeakKeyDictionary()  # model object -> {temperature: its OutputHead}
        self.chunk_rows = {}  # vocabulary size -> the chunked head's rows per chunk (HeadSettings.chunk_rows)
        self.liger_choice = LigerHeadChoice()  # which head each loss uses under Liger: chosen in `announce`
        if settings.offloading.enabled:
            log_offloading_scope(logger)

    # --- what the path gives, said once ------------------------------------------------------------------------

    def announce(self, model, notes: list[tuple[int, str]] = ()) -> None:
        """The Liger notices, once, when the trainer is built: the head that keeps Liger from running, the head
        chosen for each loss (losses/head_choice.py: timed on a GPU, or the `liger_head` setting), and the method's
        own `notes` ((level, text): what its loss takes from Liger and what it does not)."""
        if self.path is not LogProbPath.LIGER:
            return
        try:
            head = self.head_kind.of(model, self.notice_temperature)
        except ValueError:
            head = None
        problem = liger_head_problem(head, self.settings.device_type) if head is not None else None
        if problem is not None:
            logger.warning("Liger was asked for, but %s; using leantune's chunked loss instead (same memory saving, "
                           "exact).", problem)
        elif head is not None and not per_target_gradients_supported():
            logger.warning("Liger was asked for, but %s.", OLD_LIGER)
        if problem is None and head is not None:
            self.liger_choice = choose_liger_head(self.settings.liger_head, head, self.settings.device_type,
                                                  self.settings.chunk_rows(head.vocab_size))
            logger.info(self.liger_choice.describe())
        for level, text in notes:
            logger.log(level, text)

    def needs_full_logits(self, model) -> bool:
        if self.path is LogProbPath.FULL:
            return True
        return not model.training and self.metrics_need_logits()

    def liger_scores(self, head: OutputHead, with_entropy: bool = False, stats: tuple[str, ...] = ()) -> bool:
        """Whether Liger's fused kernel gives these per-target values: it yields each target's log-prob and whether
        the target is the argmax (`top1`), nothing else (no entropies, no other statistics: those batches take the
        chunked head, as the notices say when the trainer starts), and only where it is the head chosen for
        per-target log-probs (`liger_choice`)."""
        return (self.path is LogProbPath.LIGER and self.liger_choice.per_target == LIGER
                and liger_can_run(head, self.settings.device_type)
                and not with_entropy and set(stats) <= {"top1"} and len(stats) <= 1)

    def fused_nll_runs(self, model) -> bool:
        """Whether the summed NLL comes from Liger's summing kernel (its gradient formed in the forward pass, no
        per-token values). CUDA only: its backward scales the weight gradient one vocabulary row per Triton program,
        which Triton's CPU interpreter runs one at a time (measured ~70 s per step at a 32000 vocabulary, against
        ~1 s for the per-target kernel), so on CPU the per-target kernel computes the NLL. And only where it is the
        head chosen for the summed NLL (`liger_choice`)."""
        return (self.settings.device_type == "cuda" and self.liger_choice.summed == LIGER
                and self.path is LogProbPath.LIGER and not self.needs_full_logits(model)
                and liger_can_run(self.head_of(model), self.settings.device_type))

    def liger_jsd_runs(self, head: OutputHead, teacher_head: OutputHead) -> bool:
        """Whether distillation's JSD comes from Liger's fused linear JSD (both heads fusable here)."""
        return self.path is LogProbPath.LIGER and liger_jsd_problem(head, teacher_head, self.settings.device_type) is None

    def liger_chunk_rows(self, head: OutputHead) -> int | None:
        """Liger's rows per chunk on CUDA: the chunked head's (losses/liger.py's `liger_chunk_const`: its own rule
        runs ~vocabulary / hidden chunks of a few rows, memory-bound on a GPU). On CPU, where Liger runs only in
        Triton's interpreter for tests, its own rule (None): the interpreter holds a host view of each chunk's logits
        that a plan on fake weights cannot see, which Liger's own small chunks keep negligible."""
        return self.chunk_rows[head.vocab_size] if self.settings.device_type == "cuda" else None

    # --- the forward pass ---------------------------------------------------------------------------------------

    def head_of(self, model, temperature: float = 1.0) -> OutputHead:
        """The model's output head at `temperature`, found once per model object (the trained model as each wrapper
        holds it, a reference), not in every forward pass: its module and fixed transform do not change."""
        heads = self._heads.setdefault(model, {})
        if temperature not in heads:
            heads[temperature] = head = self.head_kind.of(model, temperature)
            self.chunk_rows.setdefault(head.vocab_size, self.settings.chunk_rows(head.vocab_size))
        return heads[temperature]

    def offloading_scope(self, model):
        """Saved activations of the forward pass go to CPU memory (without offloading: no scope)."""
        if not (self.settings.offloading.enabled and model.training and torch.is_grad_enabled()):
            return contextlib.nullcontext()
        return self._offloading(model)

    def _offloading(self, model):
        """The offloader, made once and reused (it keeps its streams)."""
        offload = self.settings.offloading
        if self._offloader is None:
            self._offloader = offloading.offloading_context(
                True,
                model,
                min_offload_bytes=offload.min_bytes,
                use_streams=offload.use_streams,
            )
        return self._offloader

    def forward(self, model, inputs: dict, keep_hidden: bool = False):
        """(outputs with their full logits, last hidden states or None): the full-logits forward pass."""
        kept = {}
        hook = self.head_of(model).module.register_forward_pre_hook(
            lambda module, args: kept.__setitem__("hidden", args[0])) if keep_hidden else None
        try:
            with self.offloading_scope(model):
                outputs = model(**inputs, use_cache=False)
        finally:
            if hook is not None:
                hook.remove()
        if self.on_forward is not None:
            self.on_forward(model, outputs)
        return outputs, kept.get("hidden")

    def forward_hidden(self, model, inputs: dict, head: OutputHead):
        """(last hidden states, outputs without logits): the forward pass whose head the loss runs itself."""
        with self.offloading_scope(model), head.capture_hidden_states(head_follows=True) as captured:
            outputs = model(**inputs, use_cache=False)
        outputs.logits = None
        if self.on_forward is not None:
            self.on_forward(model, outputs)
        return captured["hidden"], outputs

    # --- target log-probs ---------------------------------------------------------------------------------------

    def target_logprobs(self, model, inputs: dict, labels: torch.Tensor, temperature: float = 1.0,
                        with_entropy: bool = False, entropy_grad: bool = False, stats: tuple[str, ...] = (),
                        shifted: bool = False, with_hidden: bool = False,
                        entropy_where_free: bool = False) -> TargetScores:
        """The targets' fp32 log-probs (with entropies and the named `stats` of losses/token_logprobs.py's
        TOKEN_STATS when asked for) by the chosen path. The entropies carry a gradient only with `entropy_grad` (an
        entropy bonus in the loss). `entropy_where_free`: the entropies too where the path computes them in its own
        pass (the chunked head, full logits: a metric), not where Liger's kernel runs (it computes none). `shifted`: `labels` already hold each position's next token (context
        parallelism's `shift_labels`). `with_hidden`: also the last hidden states at the target positions
        (`TargetScores.hidden`, what PPO's value head reads), on every path. `labels` may be the `Targets` themselves
        (shared-prompt rows, where one position predicts several tokens)."""
        targets = labels if isinstance(labels, Targets) else select_targets(labels, shifted)
        scores = self._scores(model, inputs, targets, temperature, with_entropy, entropy_grad, stats, with_hidden,
                              entropy_where_free)
        if with_hidden:
            scores.hidden = scores.hidden.reshape(-1, scores.hidden.shape[-1]).index_select(0, scores.targets.index)
        else:
            scores.hidden = None  # not held past the loss that did not ask for it
        return scores

    def _scores(self, model, inputs, targets: Targets, temperature, with_entropy, entropy_grad, stats,
                with_hidden, entropy_where_free) -> TargetScores:
        """By the path: the model's full logits where they are needed, else the loss runs the head itself: Liger's
        kernel where it gives what is asked, else the chunked head."""
        if self.needs_full_logits(model):
            return self._full_logits_scores(model, inputs, targets, temperature, with_entropy or entropy_where_free,
                                            entropy_grad, stats, with_hidden)
        head = self.head_of(model, temperature)
        hidden, outputs = self.forward_hidden(model, inputs, head)
        if self.path is LogProbPath.LIGER and self.liger_scores(head, with_entropy, stats) and len(targets):
            scores = self._liger_scores(hidden, head, targets, outputs, stats)
            if scores is not None:
                return scores
        with_entropy = with_entropy or entropy_where_free
        result = chunked_logprobs(hidden, head, targets, self.chunk_rows[head.vocab_size], with_entropy, entropy_grad,
                                  stats)
        if not (with_entropy or stats):
            return TargetScores(result, targets, outputs, hidden=hidden)
        logps, *extra = result
        entropy = extra.pop(0) if with_entropy else None
        return TargetScores(logps, targets, outputs, entropy, dict(zip(stats, extra)), hidden=hidden)

    def _full_logits_scores(self, model, inputs, targets: Targets, temperature, with_entropy, entropy_grad, stats,
                            with_hidden) -> TargetScores:
        """From the model's full logits (`chunked_loss=False`, or an evaluation whose metrics read them)."""
        outputs, hidden = self.forward(model, inputs, keep_hidden=with_hidden)
        scores = TargetScores(logprobs_from_logits(outputs.logits, targets, temperature), targets, outputs,
                              hidden=hidden)
        if with_entropy:
            scores.entropy = entropy_from_logits(outputs.logits, targets, temperature, entropy_grad)
        if stats:
            flat = outputs.logits.reshape(-1, outputs.logits.shape[-1]).index_select(0, targets.index)
            scores.stats = dict(zip(stats, token_stats_from_logits(flat / temperature, targets.tokens, stats)))
        return scores

    def _liger_scores(self, hidden, head: OutputHead, targets: Targets, outputs, stats) -> TargetScores | None:
        """Liger's per-target log-probs (with top-1 when `stats` asks), or None where its kernel cannot give this
        step's gradient (a liger-kernel without per-target gradients): the chunked head then."""
        trains = torch.is_grad_enabled() and (hidden.requires_grad or bool(head.trainable_parameters))
        if trains and not per_target_gradients_supported():
            return None
        result = liger_target_logprobs(hidden, head, targets, bool(stats), self.liger_chunk_rows(head))
        if stats:
            return TargetScores(result[0], targets, outputs, stats={"top1": result[1]}, hidden=hidden)
        return TargetScores(result, targets, outputs, hidden=hidden)

    def target_nll_sum(self, model, inputs: dict, labels: torch.Tensor, shifted: bool = False):
        """(summed next-token NLL of the targets, their top-1 accuracy or None, Targets, model outputs): Liger's
        fused kernel where it runs, else -sum(target_logprobs)."""
        if self.fused_nll_runs(model):
            head = self.head_of(model)
            targets = select_targets(labels, shifted)
            hidden, outputs = self.forward_hidden(model, inputs, head)
            if len(targets):
                return (*liger_nll_sum(hidden, head, targets, self.liger_chunk_rows(head)), targets, outputs)
            return -chunked_logprobs(hidden, head, targets, self.chunk_rows[head.vocab_size]).sum(), None, targets, outputs
        scores = self.target_logprobs(model, inputs, labels, shifted=shifted)
        return -scores.logps.sum(), None, scores.targets, scores.outputs


def entropy_from_logits(logits: torch.Tensor, targets: Targets, temperature: float, grad: bool = False) -> torch.Tensor:
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        flat = logits.reshape(-1, logits.shape[-1]).index_select(0, targets.index).float() / temperature
        return torch.logsumexp(flat, -1) - (torch.softmax(flat, -1) * flat).sum(-1)
