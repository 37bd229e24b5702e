"""Qwen2.5-0.5B's shape, as its config.json gives it: bench/real_shapes.py trains it with random weights (no Hub; the
shape, not the weights, sets memory and time), its shape flags defaulting to these fields; the tests count its FLOPs."""

from __future__ import annotations

QWEN25_05B = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151_936)


def qwen2_config(**shape):
    """Qwen2.5-0.5B's configuration (as its config.json says), with the shape fields given (QWEN25_05B's names)
    changed; sdpa attention."""
    from transformers import Qwen2Config

    unknown = set(shape) - set(QWEN25_05B)
    if unknown:
        raise TypeError(f"qwen2_config: unknown shape fields {sorted(unknown)}; choose from {list(QWEN25_05B)}")
    s = {**QWEN25_05B, **shape}
    config = Qwen2Config(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        hidden_act="silu", use_sliding_window=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    config._attn_implementation = "sdpa"
    return config
