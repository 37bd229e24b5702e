"""liger-kernel's fused linear cross-entropy, fed the same targets as leantune's own losses.

leantune uses one piece of Liger for every trainer: the fused linear cross-entropy kernel (a Triton kernel: no
[tokens, vocabulary] logits are kept). With `reduction="none"` it gives minus the log-probability of every target,
and its backward takes a different upstream gradient per target (liger-kernel >= 0.8 recomputes each chunk's logits
in backward for that), so every loss leantune writes over per-target log-probs (DPO's, KTO's, GRPO's and RLOO's, in
any layout) runs on it unchanged. SFT's plain NLL uses `reduction="sum"`, whose gradient Liger forms in the forward
pass. Liger's `chunked_loss` classes are not used: they are plain torch, like leantune's chunked head, cover a subset
of the loss options and only the padded layout (docs/liger.md has the measurements).

The kernels run on CUDA, or on CPU tensors when Triton's interpreter is on (TRITON_INTERPRET=1 before liger-kernel is
imported); the log-prob engine (trainers/parts/logprob_engine.py) decides.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ..models.output_head import OutputHead
from .token_logprobs import Targets


def liger_head_problem(head: OutputHead, device_type: str) -> str | None:
    """Why Liger's kernel cannot compute this head's log-probs here (None: it can). It fuses a plain Linear head:
    optionally soft-capped, its logit scale and (without soft-capping) the sampling temperature folded into its inputs.
    Other heads take the chunked head."""
    module = head.module
    if type(module) is not torch.nn.Linear:
        return f"the output head is a {type(module).__name__}, not a plain Linear (a PEFT adapter on lm_head?)"
    if "forward" in module.__dict__ and not getattr(module, "_leantune_fp32", False):
        return "the output head's forward is replaced (an accelerate hook?)"
    if head.softcap is not None and head.temperature != 1.0:
        return "soft-capped logits divided by a sampling temperature are not one fused linear cross-entropy"
    if head.softcap is not None and device_type != "cuda":
        return "Triton's CPU interpreter cannot pass the soft-capping value to Liger's kernel (a float argument)"
    return None


def per_target_gradients_supported() -> bool:
    """Whether liger-kernel's reduction="none" backward applies each target's own upstream gradient: since 0.8.2
    (Liger-Kernel PR #1298); before, every target's gradient was scaled by the first target's, silently wrong for any
    loss but a plain sum. Checked by the feature, not the version number."""
    from liger_kernel.ops import fused_linear_cross_entropy as ops

    return "token_grad_output" in inspect.signature(ops.fused_linear_cross_entropy_forward).parameters


OLD_LIGER = ("this liger-kernel's reduction='none' backward scales every token's gradient by the first token's "
             "(fixed in 0.8.2), so per-token losses that train (DPO, KTO, GRPO, RLOO, SFT's dft) use leantune's "
             "chunked head; pip install -U 'liger-kernel>=0.8.2'")


def liger_can_run(head: OutputHead, device_type: str = "cuda") -> bool:
    return liger_head_problem(head, device_type) is None


def _fused_inputs(hidden: torch.Tensor, head: OutputHead, targets: Targets):
    """(target rows of `hidden`, weight, bias), scaled so that Liger's softcap(x @ W.T + b) equals the head's logits:
    softcap(raw * scale) / temperature, the temperature only without soft-capping (liger_can_run)."""
    module = head.module
    flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, targets.index)
    weight, bias = module.weight, module.bias
    if getattr(module, "_leantune_fp32", False):  # cast_lm_head_to_fp32: project in fp32, as the head's forward does
        flat, weight = flat.float(), weight.float()
        bias = None if bias is None else bias.float()
    factor = head.scale / head.temperature
    if factor != 1.0:
        flat = flat * factor
        bias = None if bias is None else bias * factor
    return flat, weight, bias


def chunk_rows_supported() -> bool:
    """Whether this liger-kernel takes `chunk_mem_const` (0.8.5+), the budget that sets its rows per chunk."""
    from liger_kernel.ops import fused_linear_cross_entropy as ops

    return "chunk_mem_const" in inspect.signature(ops.fused_linear_cross_entropy_forward).parameters


@functools.lru_cache(maxsize=256)
def liger_chunk_const(rows: int, hidden_size: int, vocab_size: int, chunk_rows: int) -> int:
    """The `chunk_mem_const` that gives Liger's kernel the most rows per chunk, up to `chunk_rows` (the chunked head's).

    By default Liger bounds its transient logits to rows x hidden elements, so it runs ~vocabulary / hidden chunks
    whatever the batch (89 chunks of ~110 rows at Qwen2.5-1.5B's shape on the H100: memory-bound matmuls, the same
    fault the chunked head's CPU-sized chunk had). Its chunk is next_pow2(ceil(rows / ceil(V / (C x H)))) rows, never
    more than `rows`, growing with C; the largest C whose chunk stays within `chunk_rows` gives Liger the chunked
    head's matmul shapes at no more memory (its chunk's logits are in the compute dtype, the chunked head's up to
    three fp32 copies). C = 1 (Liger's own budget) where even that chunk is larger."""
    def chunk(const):
        steps = -(-vocab_size // (const * hidden_size))
        return min(1 << max(0, (-(-rows // steps) - 1).bit_length()), rows)

    low, high = 1, max(1, -(-vocab_size // hidden_size))
    while low < high:  # the largest const in [1, high] whose chunk fits (chunk grows with const)
        middle = (low + high + 1) // 2
        if chunk(middle) <= chunk_rows:
            low = middle
        else:
            high = middle - 1
    return low


def _fused_cross_entropy(flat, weight, bias, tokens, reduction: str, softcap, with_top1: bool, chunk_rows):
    """Liger's fused linear cross-entropy, its chunks sized by `chunk_rows` where this liger-kernel allows it."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    extra = {}
    if chunk_rows and chunk_rows_supported():
        extra["chunk_mem_const"] = liger_chunk_const(int(flat.shape[0]), int(flat.shape[1]), int(weight.shape[0]),
                                                     int(chunk_rows))
    return liger_fused_linear_cross_entropy(flat, weight, tokens, bias, reduction=reduction, softcap=softcap,
                                            return_token_accuracy=with_top1, **extra)


def liger_target_logprobs(hidden: torch.Tensor, head: OutputHead, targets: Targets, with_top1: bool = False,
                          chunk_rows: int | None = None):
    """fp32 log-probabilities of the targets (and, with `with_top1`, whether each target is the argmax), from Liger's
    fused kernel with reduction="none": differentiable per target, logits never held whole. `chunk_rows`: rows per
    chunk at most (`liger_chunk_const`; None: Liger's own rule)."""
    flat, weight, bias = _fused_inputs(hidden, head, targets)
    out = _fused_cross_entropy(flat, weight, bias, targets.tokens, "none", head.softcap, with_top1, chunk_rows)
    if with_top1:
        return -out.loss.float(), out.token_accuracy.bool()
    return -out.float()


def liger_nll_sum(hidden: torch.Tensor, head: OutputHead, targets: Targets,
                  chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed negative log-likelihood of the targets, their top-1 accuracy), by Liger's fused kernel with
    reduction="sum" (its gradient is formed in the forward pass: no recomputation in backward)."""
    flat, weight, bias = _fused_inputs(hidden, head, targets)
    out = _fused_cross_entropy(flat, weight, bias, targets.tokens, "sum", head.softcap, True, chunk_rows)
    return out.loss.float(), out.token_accuracy.float()


def liger_jsd_problem(student: OutputHead, teacher: OutputHead, device_type: str) -> str | None:
    """Why Liger's fused linear JSD cannot compute this student/teacher divergence (None: it can). It fuses two plain
    Linear heads without bias or soft-capping (a logit scale is folded into the inputs)."""
    for name, head in (("student", student), ("teacher", teacher)):
        problem = liger_head_problem(head, device_type)
        if problem is not None:
            return f"the {name}'s {problem.removeprefix('the ')}"
        if head.module.bias is not None:
            return f"the {name}'s output head has a bias, which Liger's fused linear JSD does not take"
        if head.softcap is not None:
            return f"the {name}'s logits are soft-capped, which Liger's fused linear JSD does not do"
    return None


def liger_jsd_sum(student_hidden: torch.Tensor, student_head: OutputHead, teacher_hidden: torch.Tensor,
                  teacher_head: OutputHead, targets: Targets, beta: float) -> torch.Tensor:
    """The generalised JSD (losses/distillation.py) summed over the targets, by liger-kernel's
    LigerFusedLinearJSD: its gradient is formed chunk by chunk in the forward pass, logits never held whole.

    Liger's `jsd_beta` weighs the teacher's KL to the mixture (its `target` is the teacher, its `input` the student),
    which is TRL's `beta` as liger-kernel 0.8 computes it: checked numerically against the chunked path per beta in
    tests/trainers/test_gkd.py, not assumed. Liger returns the mean over rows; times the row count it is the sum."""
    from liger_kernel.transformers import LigerFusedLinearJSD

    student, student_weight, _ = _fused_inputs(student_hidden, student_head, targets)
    teacher, teacher_weight, _ = _fused_inputs(teacher_hidden, teacher_head, targets)
    loss_fn = LigerFusedLinearJSD(jsd_beta=float(beta), temperature=1.0)
    mean = loss_fn(student, student_weight, teacher.detach(), teacher_weight.detach(), None)
    return mean.float() * len(targets)
