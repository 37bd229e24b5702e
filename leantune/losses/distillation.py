"""The generalised Jensen-Shannon divergence between a student's and a teacher's next-token distributions (GKD).

Written once over [targets, vocabulary] log-probabilities (`generalized_jsd`); the full-logits path feeds it the
models' logits at the target positions, and `chunked_jsd` feeds it one chunk of target positions at a time from the
two models' last hidden states, so neither model's [tokens, vocabulary] logits ever exist. The chunked forward keeps
only the two hidden-state slices; backward recomputes each chunk's student and teacher logits to form its gradient.

beta (TRL's meaning): 0 = KL(teacher || student) (forward KL), 1 = KL(student || teacher) (reverse KL), in between
beta * KL(teacher || M) + (1 - beta) * KL(student || M) with M = beta * teacher + (1 - beta) * student.
"""

from __future__ import annotations

import math

import torch

from ..models.output_head import OutputHead
from .token_logprobs import Targets, chunk_tokens_for, _vocab_size


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
        chunk_size = chunk_tokens_for(_vocab_size(student_head))

    def run(flat):  # as the student head's forward: sharding engines gather its weight around it and its backward
        return _ChunkedJSD.apply(flat, teacher, student_head, teacher_head, float(beta), int(chunk_size),
                                 *student_head.trainable_parameters)

    return student_head.call_as_head(run, student)


def _teacher_logps(head: OutputHead, hidden: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(head.logits(hidden), -1)


class _ChunkedJSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, student_head, teacher_head, beta, chunk_size, *params):
        out = torch.empty(student.shape[0], dtype=torch.float32, device=student.device)
        for start in range(0, student.shape[0], chunk_size):
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
        param_grads = [None] * len(wanted)
        device_type, autocast_on, autocast_dtype = ctx.autocast
        for start in range(0, student.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            piece = student[start:end].detach().requires_grad_(want_hidden)
            inputs = ([piece] if want_hidden else []) + wanted
            if not inputs:
                break
            with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                teacher_logps = _teacher_logps(teacher_head, teacher[start:end])
            with torch.enable_grad(), torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                raw = student_head.project(piece)
            with torch.enable_grad():  # the loss itself in fp32, outside autocast, as in forward
                divergence = generalized_jsd(torch.log_softmax(student_head.transform(raw), -1), teacher_logps,
                                             ctx.beta)
            grads = torch.autograd.grad(divergence, inputs, grad_out[start:end])
            del raw, divergence, teacher_logps
            if want_hidden:
                grad_hidden[start:end] = grads[0]
                grads = grads[1:]
            param_grads = [g if acc is None else acc.add_(g) for acc, g in zip(param_grads, grads)]
        grads_in = iter(param_grads)
        per_param = [next(grads_in) if need else None for need in ctx.needs_input_grad[6:]]
        return (grad_hidden, None, None, None, None, None, *per_param)
