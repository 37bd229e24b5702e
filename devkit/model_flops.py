"""Model FLOPs of one training step, the numerator of MFU: bench/real_shapes.py reports MFU with it, and
tests/benchmarks/test_bench_real_shapes.py checks its count on Qwen2.5-0.5B's shape."""

from __future__ import annotations


def model_flops(config, tokens: int) -> dict:
    """FLOPs of one training step (forward + backward = 3 x forward) of one sequence of `tokens` tokens.

    Layers: 6 x their parameters x tokens. Causal attention: QK^T and AV, each 2 x tokens^2 x (heads x head_dim) a
    layer forward, halved by the causal mask, x 3 for the backward. The LM head: 6 x hidden x vocab x tokens (its
    weight is the tied embedding's, so it is not in the non-embedding count). The checkpointing's recompute (one more
    forward of the layers) is not model FLOPs: `recompute` gives it apart."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = (hidden * hidden + hidden) + 2 * (hidden * kv + kv) + hidden * hidden  # q (bias), k, v (bias), o
    per_layer += 3 * hidden * config.intermediate_size + 2 * hidden  # gate, up, down; two RMSNorm weights
    non_embedding = layers * per_layer + hidden  # + the final norm
    dense = 6 * non_embedding * tokens
    attention = 3 * layers * (2 * 2 * tokens * tokens * config.num_attention_heads * head_dim) // 2
    head = 6 * hidden * config.vocab_size * tokens
    recompute = (dense + attention) // 3  # one more forward of the layers
    return {"non_embedding_parameters": non_embedding, "dense": dense, "attention": attention, "head": head,
            "model": dense + attention + head, "recompute": recompute}
