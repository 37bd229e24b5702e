"""Test-only: torch's ring attention (`context_parallel`) for the CPU SDPA kernel, so accelerate's context parallelism
runs on CPU processes over gloo (imported by sitecustomize.py when LEANTUNE_TEST_CPU_CP=1).

torch 2.13's context parallelism dispatches SDPA's CUDA kernels (flash, memory-efficient, cuDNN) to its ring
attention; on CPU, SDPA runs `aten._scaled_dot_product_flash_attention_for_cpu`, which has no sharding rule, so the
first attention call under `context_parallel` fails ("... does not have a sharding strategy registered"). This adds
that kernel and its backward to the same machinery: a sharding rule (q, k, v, output and log-sum-exp sharded on the
sequence dimension, as torch's rule for the CUDA flash kernel) installed and removed with torch's own rules, and a
handler that runs torch's `_templated_ring_attention` / `_templated_ring_attention_backward` with the CPU kernel
(the same ring, load balancing and log-sum-exp merging a GPU run uses). Nothing here is in leantune."""

from __future__ import annotations

import torch

aten = torch.ops.aten


def install() -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    from torch.distributed.tensor.experimental._context_parallel import _sharding_rules as rules

    forward = aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    if forward in cp.custom_ops:
        return
    seq = Shard(2)

    def forward_strategy(op_schema):
        # outputs (output, logsumexp), then the tensor inputs (q, k, v): all replicated, or all sharded on time
        strategies = [[Replicate()] * 5, [seq] * 5]
        return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, strategies, input_index=2)

    def backward_strategy(op_schema):
        # outputs (grad q, k, v), then grad_out, q, k, v, out, logsumexp
        strategies = [[Replicate()] * 9, [seq] * 9]
        return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(validate=False), op_schema, strategies,
                                               input_index=3)

    def ring_forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        if attn_mask is not None:
            raise NotImplementedError("context parallel attention takes no attn_mask")
        return cp._templated_ring_attention(mesh.get_group(), 2, forward, query=query, key=key, value=value,
                                            is_causal=is_causal, dropout_p=dropout_p, scale=scale)

    def ring_backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                      scale=None):
        if attn_mask is not None:
            raise NotImplementedError("context parallel attention takes no attn_mask")
        return cp._templated_ring_attention_backward(
            mesh.get_group(), 2, backward, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key,
            value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale)

    ring = {forward: ring_forward, backward: ring_backward}

    def handler(op_call, args, kwargs):  # torch's _sdpa_handler, with the CPU kernel's ring functions
        op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        DTensor._op_dispatcher.sharding_propagator.propagate(op_info)
        output_sharding = op_info.output_sharding
        assert output_sharding is not None and not output_sharding.needs_redistribute
        local = ring[op_call](op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
        return DTensor._op_dispatcher.wrap(local, output_sharding.output_spec)

    cp.custom_ops.update({forward: handler, backward: handler})

    original_register = rules.register_cp_sharding_rules

    def register_cp_sharding_rules():
        original_register()
        for op, strategy, schema_info in ((forward, forward_strategy, RuntimeSchemaInfo(3)),
                                          (backward, backward_strategy, None)):
            if op not in rules._cp_strategy_contexts:  # torch's unregister exits these with its own
                context = rules._op_strategy_context(op, strategy, schema_info)
                rules._original_strategies[op] = context.__enter__()
                rules._cp_strategy_contexts[op] = context

    rules.register_cp_sharding_rules = register_cp_sharding_rules
