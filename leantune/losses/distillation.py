"""The generalised Jensen-Shannon divergence between a student's and a teacher's next-token distributions (GKD).

Written once over [targets, vocabulary] log-probabilities (`generalized_jsd`); the full-logits path feeds it the
models' logits at the target positions, and `chunked_jsd` feeds it one chunk of target positions at a time from the
two models' last hidden states, so neither model's [tokens, vocabulary] logits ever exist. The chunked forward keeps
only the two hidden-state slices; backward recomputes each chunk's student and teacher logits to form its gradient.

beta (TRL's meaning): 0 = KL(teacher || student) (forward KL), 1 = KL(student || teacher) (reverse KL), in between
beta * KL(teacher || M) + (1 - beta) * KL(student || M) with M = beta * teacher + (1 - beta) * student.

A trainer needs only the sum over the targets: `chunked_jsd_sum` forms each chunk's gradient in the forward pass from
the divergence's closed-form derivative (`jsd_and_logit_gradient`), so backward only scales the kept gradients and
neither model's head runs twice (what full logits cost in matmuls, at the memory of one chunk).
"""

from __future__ import annotations

import math

import torch

from ..models.output_head import OutputHead
from .token_logprobs import HeadGradients, Targets, chunk_starts, chunk_tokens_for


def generalized_jsd(student_logps: torch.Tensor, teacher_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-row divergence of [rows, vocabulary] log-probabilities (fp32), summed over the vocabulary."""
    if beta == 0.0:
        return (teacher_logps.exp() * (teacher_logps - student_logps)).sum(-1)
    if beta == 1.0:
        return (student_logps.exp() * (student_logps - teacher_logps)).sum(-1)
    mixture = torch.logaddexp(student_logps + math.log1p(-beta), teacher_logps + math.log(beta))
    to_teacher = (teacher_logps.exp() * (teacher_logps - mixture)).sum(-1)
    to_student = (student_logps.exp() * (student_logps - mixture)).sum(-1)
    return beta * to_teacher + (1.0 - beta) * to_student


def jsd_from_logits(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: Targets,
                    beta: float) -> torch.Tensor:
    """Plain path: the divergence at each target position from the two models' full [batch, time, vocabulary]
    logits (the rows of the targets only)."""
    rows = [logits.reshape(-1, logits.shape[-1]).index_select(0, targets.index).float()
            for logits in (student_logits, teacher_logits)]
    return generalized_jsd(torch.log_softmax(rows[0], -1), torch.log_softmax(rows[1], -1).detach(), beta)


def chunked_jsd(student_hidden: torch.Tensor, student_head: OutputHead, teacher_hidden: torch.Tensor,
                teacher_head: OutputHead, targets: Targets, beta: float,
                chunk_size: int | None = None) -> torch.Tensor:
    """The divergence at each target position ([num_targets], fp32, differentiable in the student's hidden states
    and head) from the two models' last hidden states ([batch, time, hidden] each, or already flat), never holding
    more than one chunk's logits of either model."""
    student = student_hidden.reshape(-1, student_hidden.shape[-1]).index_select(0, targets.index)
    teacher = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).index_select(0, targets.index).detach()
    if chunk_size is None:
        chunk_size = jsd_chunk_tokens(student_head)

    def run(flat):  # as the student head's forward: sharding engines gather its weight around it and its backward
        return _ChunkedJSD.apply(flat, teacher, student_head, teacher_head, float(beta), int(chunk_size),
                                 *student_head.trainable_parameters)

    return student_head.call_as_head(run, student)


def jsd_and_logit_gradient(student_logps: torch.Tensor, teacher_logps: torch.Tensor, beta: float):
    """(per-row divergence, its gradient in the student's logits) of [rows, vocabulary] fp32 log-probabilities.

    With s = softmax(z), d/dz_j of sum_v s_v g_v-type terms is s_j (dL/ds_j - sum_v s_v dL/ds_v):
    beta = 0: s - t;  beta = 1: s (log s - log t - L);  else, since dL/ds_j = (1 - beta) log(s_j / m_j):
    (1 - beta) s (log(s / m) - KL(s || m))."""
    s = student_logps.exp()
    if beta == 0.0:
        t = teacher_logps.exp()
        return (t * (teacher_logps - student_logps)).sum(-1), s.sub_(t)
    if beta == 1.0:
        log_ratio = student_logps - teacher_logps
        loss = (s * log_ratio).sum(-1)
        return loss, s.mul_(log_ratio.sub_(loss.unsqueeze(-1)))
    mixture = torch.logaddexp(student_logps + math.log1p(-beta), teacher_logps + math.log(beta))
    to_teacher = (teacher_logps.exp() * (teacher_logps - mixture)).sum(-1)
    log_ratio = student_logps - mixture
    del mixture
    to_student = (s * log_ratio).sum(-1)
    grad = s.mul_(log_ratio.sub_(to_student.unsqueeze(-1))).mul_(1.0 - beta)
    return beta * to_teacher + (1.0 - beta) * to_student, grad


def chunked_jsd_sum(student_hidden: torch.Tensor, student_head: OutputHead, teacher_hidden: torch.Tensor,
                    teacher_head: OutputHead, targets: Targets, beta: float,
                    chunk_size: int | None = None) -> torch.Tensor:
    """The divergence summed over the targets (a scalar), its gradient formed chunk by chunk in the forward pass.
    Where the student head's weights are sharded at this point (ZeRO-3, FSDP2 head wrapped alone), the engine
    gathers them around the head's own forward and backward: the per-target function (recomputed in backward) runs
    there instead."""
    if student_head.weights_sharded():
        return chunked_jsd(student_hidden, student_head, teacher_hidden, teacher_head, targets, beta,
                           chunk_size).sum()
    student = student_hidden.reshape(-1, student_hidden.shape[-1]).index_select(0, targets.index)
    teacher = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).index_select(0, targets.index).detach()
    if chunk_size is None:
        chunk_size = jsd_chunk_tokens(student_head)
    return _ChunkedJSDSum.apply(student, teacher, student_head, teacher_head, float(beta), int(chunk_size),
                                torch.is_grad_enabled(), *student_head.trainable_parameters)


def jsd_chunk_tokens(head: OutputHead) -> int:
    """Tokens per chunk: a chunk holds ~8 [chunk, vocabulary] fp32 buffers at once (both models' log-probs, the
    mixture, products), so it is an eighth of the chunked head's single-buffer budget."""
    return max(16, chunk_tokens_for(head.vocab_size) // 8)


def _logit_gradient_to_raw(head: OutputHead, logits: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """d/d(projection output) from d/d(logits): logits = softcap(raw * scale) / temperature, in place on `grad`."""
    grad.mul_(head.scale / head.temperature)
    if head.softcap is not None:
        grad.mul_(1.0 - (logits * (head.temperature / head.softcap)).square())
    return grad


class _ChunkedJSDSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, student_head, teacher_head, beta, chunk_size, wants_grad, *params):
        want_hidden = wants_grad and student.requires_grad
        wanted = [p for p in params if wants_grad and p.requires_grad]
        grad_hidden = torch.zeros_like(student) if want_hidden else None
        device_type = student.device.type
        head_grads = HeadGradients(student_head, wanted, torch.get_autocast_dtype(device_type)
                                   if torch.is_autocast_enabled(device_type) else student.dtype)
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        for start in chunk_starts(student, chunk_size):
            end = start + chunk_size
            piece = student[start:end].detach().requires_grad_(want_hidden)
            inputs = ([piece] if want_hidden else []) + head_grads.by_autograd
            with torch.enable_grad() if inputs else torch.no_grad():
                raw = student_head.project(piece)
            logits = student_head.transform(raw.detach())
            loss, grad = jsd_and_logit_gradient(torch.log_softmax(logits, -1),
                                                _teacher_logps(teacher_head, teacher[start:end]), beta)
            total += loss.sum()
            if inputs or head_grads.weight is not None:
                grad = _logit_gradient_to_raw(student_head, logits, grad).to(raw.dtype)
                del logits
                head_grads.add_weight(grad, piece)
                grads = torch.autograd.grad(raw, inputs, grad) if inputs else ()
                if want_hidden:
                    grad_hidden[start:end] = grads[0]
                    grads = grads[1:]
                head_grads.add(grads)
            del raw, grad
        grads_in = iter(head_grads.result())
        ctx.grads = [grad_hidden] + [next(grads_in) if wants_grad and p.requires_grad else None for p in params]
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, *per_param = (None if g is None else g * grad_out.to(g.dtype) for g in ctx.grads)
        ctx.grads = None
        return (grad_hidden, None, None, None, None, None, None, *per_param)


def _teacher_logps(head: OutputHead, hidden: torch.Tensor) -> torch.Tensor:
    # As the teacher head's forward: a frozen teacher sharded by the engine (ZeRO-3 partitions it as the student)
    # has its weight gathered around the call; a whole one is used as it is.
    with torch.no_grad():
        return torch.log_softmax(head.call_as_head(head.logits, hidden), -1)


class _ChunkedJSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, student_head, teacher_head, beta, chunk_size, *params):
        out = torch.empty(student.shape[0], dtype=torch.float32, device=student.device)
        for start in chunk_starts(student, chunk_size):
            end = start + chunk_size
            student_logps = torch.log_softmax(student_head.logits(student[start:end]), -1)
            out[start:end] = generalized_jsd(student_logps, _teacher_logps(teacher_head, teacher[start:end]), beta)
            del student_logps
        ctx.save_for_backward(student, teacher)
        ctx.heads, ctx.beta, ctx.chunk_size, ctx.params = (student_head, teacher_head), beta, chunk_size, params
        device_type = student.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        student, teacher = ctx.saved_tensors
        student_head, teacher_head = ctx.heads
        want_hidden = ctx.needs_input_grad[0]
        wanted = [p for p, need in zip(ctx.params, ctx.needs_input_grad[6:]) if need]
        grad_hidden = torch.zeros_like(student) if want_hidden else None
        device_type, autocast_on, autocast_dtype = ctx.autocast
        head_grads = HeadGradients(student_head, wanted, autocast_dtype if autocast_on else student.dtype)
        for start in chunk_starts(student, ctx.chunk_size):
            end = start + ctx.chunk_size
            piece = student[start:end].detach().requires_grad_(want_hidden)
            inputs = ([piece] if want_hidden else []) + head_grads.by_autograd
            if not inputs and head_grads.weight is None:
                break
            with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                teacher_logps = _teacher_logps(teacher_head, teacher[start:end])
            with torch.enable_grad(), torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                raw = student_head.project(piece)
            with torch.enable_grad():  # the loss itself in fp32, outside autocast, as in forward
                divergence = generalized_jsd(torch.log_softmax(student_head.transform(raw), -1), teacher_logps,
                                             ctx.beta)
            # d/d(raw) first, then the weight in place and the rest through the projection's own backward
            (grad_raw,) = torch.autograd.grad(divergence, [raw], grad_out[start:end])
            del divergence, teacher_logps
            head_grads.add_weight(grad_raw, piece)
            grads = torch.autograd.grad(raw, inputs, grad_raw) if inputs else ()
            del raw, grad_raw
            if want_hidden:
                grad_hidden[start:end] = grads[0]
                grads = grads[1:]
            head_grads.add(grads)
        grads_in = iter(head_grads.result())
        per_param = [next(grads_in) if need else None for need in ctx.needs_input_grad[6:]]
        return (grad_hidden, None, None, None, None, None, *per_param)
