"""The real models' shapes, written out (no Hub on the GPU machine): their config.json fields that set memory and
speed, and the tiny stand-ins that `--dry` trains on CPU with the same architecture and code paths."""

from __future__ import annotations

# Qwen/Qwen2.5-1.5B config.json (tied embeddings, q/k/v biases are part of the Qwen2 architecture).
QWEN25_1_5B = dict(
    model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, hidden_act="silu", use_sliding_window=False,
)

# meta-llama/Llama-3.1-8B config.json (llama3 RoPE scaling to 128k positions).
LLAMA31_8B = dict(
    model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=False, hidden_act="silu", attention_bias=False, mlp_bias=False,
)

SHAPES = {"qwen2.5-1.5b": QWEN25_1_5B, "llama-3.1-8b": LLAMA31_8B}

# --dry: the same model types and options at a size that trains in well under a second a step on one CPU core.
# The vocabulary stays larger than the tokenizer's (~100 ids) so the head still scores ids no text uses.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512)


def model_config(name: str, tokenizer, dry: bool):
    """The transformers config of shape `name` (tiny with `dry`), its special ids the tokenizer's."""
    from transformers import AutoConfig

    fields = dict(SHAPES[name])
    model_type = fields.pop("model_type")
    if dry:
        fields.update(TINY)
        if model_type == "llama":  # llama3 RoPE needs its original length below the positions
            fields["max_position_embeddings"] = 16384
    fields.update(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    return AutoConfig.for_model(model_type, **fields)


def parameter_count(name: str) -> int:
    """Parameters of the full-size shape, from its fields (for the progress line; no model built)."""
    f = SHAPES[name]
    h, i, n, v = f["hidden_size"], f["intermediate_size"], f["num_hidden_layers"], f["vocab_size"]
    kv = h // f["num_attention_heads"] * f["num_key_value_heads"]
    layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return n * layer + v * h * (1 if f["tie_word_embeddings"] else 2) + h
