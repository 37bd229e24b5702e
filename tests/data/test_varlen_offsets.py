"""The offsets FlashAttention's varlen kernels would read, checked on CPU.

On a GPU with flash-attn, transformers hands the collator's `cu_seq_lens_q/k` and `max_length_q/k` straight to
`flash_attn_varlen_func` (tests/trainers/test_gpu.py runs that). FlashAttention needs CUDA, so here the same offsets are
checked three ways: they are what transformers itself would derive from the position ids, they delimit exactly the
dataset's sequences in order, and attention computed by FlashAttention's varlen contract from them (tokens of all
rows laid end to end, causal inside each [cu[i], cu[i+1]) and nowhere else; written below as one masked softmax,
independently of leantune's per-sequence SDPA) gives the per-token losses of padded SDPA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

from ..fixtures.comparisons import rel_diff
from ..fixtures.data import gsm8k_prompt_completion
from ..fixtures.models import tiny_model
from ..fixtures.sft_layouts import make_trainer, sequence_losses, whole_dataset_batch

VARLEN_REFERENCE = "leantune_test_varlen_reference"
# fp32 forward passes whose attention sums run in different orders (one masked softmax over every token vs. one SDPA
# call per padded sequence): per-token losses of about log(32000) ~ 10 agree to a few hundred float32 epsilons.
RTOL = 1e-5


def varlen_reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """FlashAttention's varlen semantics on CPU: [batch, heads, length, dim] flattened to [tokens, heads, dim] as
    transformers does before calling `flash_attn_varlen_func`, attention allowed only inside one cu_seq_lens segment."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    assert cu_q is not None and cu_k is not None, "the collator's offsets did not reach the attention layer"
    assert torch.equal(cu_q, cu_k)
    batch, heads, length, dim = query.shape
    assert int(cu_q[-1]) == batch * length and int(kwargs["max_length_q"]) == int(torch.diff(cu_q).max())
    q, k, v = (states.transpose(1, 2).reshape(batch * length, states.shape[1], dim) for states in (query, key, value))
    if k.shape[1] != heads:  # grouped-query attention: each key/value head serves heads / kv_heads query heads
        k, v = (states.repeat_interleave(heads // states.shape[1], dim=1) for states in (k, v))
    position = torch.arange(batch * length)
    segment = torch.searchsorted(cu_q[1:].long(), position, right=True)
    allowed = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])
    scores = torch.einsum("qhd,khd->hqk", q, k) * (scaling if scaling is not None else dim ** -0.5)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    out = torch.einsum("hqk,khd->qhd", weights, v)
    return out.reshape(batch, length, heads, dim), None


@pytest.fixture(scope="module", autouse=True)
def _register_reference():
    AttentionInterface.register(VARLEN_REFERENCE, varlen_reference_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN_REFERENCE, sdpa_mask)


LAYOUTS = {
    "padding_free": {"padding_free": True},
    "packed_rows": {"packing": True, "per_device_train_batch_size": 8},
    "packed_padding_free": {"packing": True, "padding_free": True, "per_device_train_batch_size": 8},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_collator_offsets_are_flash_attentions_and_give_padded_losses(layout, arch, tokenizer, gsm8k_rows, tmp_path):
    dataset = gsm8k_prompt_completion(gsm8k_rows, 12)
    padded = whole_dataset_batch(make_trainer(tiny_model(arch), tokenizer, dataset, tmp_path / "padded",
                                              per_device_train_batch_size=12))
    trainer = make_trainer(tiny_model(arch), tokenizer, dataset, tmp_path / layout, **LAYOUTS[layout])
    batch = whole_dataset_batch(trainer)
    assert "attention_mask" not in batch

    # 1. What transformers' FlashAttention path derives from position ids when no offsets are given.
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(batch["position_ids"])
    assert batch["cu_seq_lens_q"].tolist() == cu_q.tolist() == batch["cu_seq_lens_k"].tolist() == cu_k.tolist()
    assert batch["max_length_q"] == batch["max_length_k"] == int(max_q) == int(max_k)

    # 2. The segments are the dataset's sequences, in order (a packed row's padding tail is one segment of its own).
    lengths = np.diff(batch["cu_seq_lens_q"].numpy()).tolist()
    if "seq_lengths" in trainer.train_dataset.column_names:
        expected = []
        width = batch["input_ids"].shape[1]
        for row in trainer.train_dataset:
            expected += list(row["seq_lengths"])
            if layout == "packed_rows" and sum(row["seq_lengths"]) < width:
                expected.append(width - sum(row["seq_lengths"]))
    else:
        expected = [len(row["input_ids"]) for row in trainer.train_dataset]
    assert lengths == expected

    # 3. Attention by FlashAttention's varlen contract over these offsets = padded SDPA, per token.
    model = tiny_model(arch)
    model.set_attn_implementation(VARLEN_REFERENCE)
    varlen, reference = sequence_losses(model, batch), sequence_losses(tiny_model(arch), padded)
    assert len(reference) == 12 and set(varlen) >= set(reference)
    for key, losses in reference.items():
        assert rel_diff(varlen[key], losses) <= RTOL
