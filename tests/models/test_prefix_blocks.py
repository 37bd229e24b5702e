"""A shared-prompt row's attention (models/segment_attention.py's prefix blocks): one SDPA call per layer,
whose outputs and gradients equal each completion's unshared causal attention over cat(prompt, completion)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from leantune.data.collators import SharedPromptCollator
from leantune.models.segment_attention import (
    BlockCache,
    build_prefix_blocks,
    prefix_block_attention,
    use_segment_attention,
)

from ..fixtures.models import tiny_model

SDPA_OPS = {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
            "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention"}


class AttentionKernelCalls(TorchDispatchMode):
    """Counts SDPA's kernels as torch dispatches them (whichever backend SDPA picks)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func._schema.name in SDPA_OPS
        return func(*args, **(kwargs or {}))


# Two groups (prompts of 7 and 12 tokens; completions of 5, 9, 3 and 6, 6), then a padding segment
LENGTHS = [7, 5, 9, 3, 12, 6, 6, 4]
PROMPT_OF = [-1, 0, 0, 0, -1, 4, 4, -1]


def unshared_attention(query, key, value):
    """Each segment as its own causal sequence: a completion over cat(its prompt, itself), its prompt's part dropped."""
    starts = [sum(LENGTHS[:n]) for n in range(len(LENGTHS))]
    pieces = []
    for start, length, prompt in zip(starts, LENGTHS, PROMPT_OF):
        index = torch.arange(start, start + length)
        if prompt >= 0:
            index = torch.cat((torch.arange(starts[prompt], starts[prompt] + LENGTHS[prompt]), index))
        out = F.scaled_dot_product_attention(query[:, index], key[:, index], value[:, index], is_causal=True,
                                             enable_gqa=True)
        pieces.append(out[:, -length:])
    return torch.cat(pieces, dim=1)


@pytest.mark.quick
@pytest.mark.parametrize("block", [None, 4])
def test_prefix_blocks_equal_unshared_attention_and_its_gradients(block):
    """The chosen block length, and blocks of 4 that cut completions too (their prefix: prompt + earlier blocks)."""
    generator = torch.Generator().manual_seed(0)
    length = sum(LENGTHS)
    query, key, value = (torch.randn(heads, length, 16, generator=generator, requires_grad=True)
                         for heads in (4, 2, 2))
    blocks = build_prefix_blocks(LENGTHS, PROMPT_OF, block=block)
    if block is None:  # Lq = the longest completion (9): the 12-token prompt is 2 blocks, the second after the first
        assert blocks.block_length == 9 and blocks.count == 1 + 3 + 2 + 2 + 1
    else:
        assert blocks.count == sum(-(-n // 4) for n in LENGTHS)
    weights = torch.randn(4, length, 16, generator=generator)
    got = prefix_block_attention(query, key, value, blocks.queries, blocks.keys, blocks.mask, blocks.output)
    got_grads = torch.autograd.grad((got * weights).sum(), (query, key, value))
    expected = unshared_attention(query, key, value)
    expected_grads = torch.autograd.grad((expected * weights).sum(), (query, key, value))
    # outputs are convex combinations of values of |v| ~ 1-3, summed in another order: fp32 rounding ~1e-7 of them;
    # gradients sum over up to 12 queries: rel 1e-5 with a 1e-5 floor of the largest entry
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for got_grad, expected_grad in zip(got_grads, expected_grads):
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-5 * float(expected_grad.abs().max()))


def test_a_shared_row_is_one_attention_call_per_layer():
    """A row of 2 groups x 4 completions: 2 layers -> 2 SDPA kernels in the forward, whatever G is (a call per
    completion would be 2 x 10)."""
    model = tiny_model("llama")
    assert use_segment_attention(model)
    generator = torch.Generator().manual_seed(1)
    examples = []
    for prompt_length in (11, 6):
        prompt = torch.randint(3, 1000, (prompt_length,), generator=generator).tolist()
        for completion_length in (4, 7, 2, 5):
            completion = torch.randint(3, 1000, (completion_length,), generator=generator).tolist()
            examples.append({"input_ids": prompt + completion, "completion_mask": [0] * prompt_length + [1] * len(completion),
                             "prompt_length": prompt_length})
    batch = SharedPromptCollator(pad_token_id=0, pad_to_multiple_of=8)(examples)
    inputs = {k: batch[k] for k in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                    "max_length_k", "shared_prompt_of")}
    with AttentionKernelCalls() as counted:
        model(**inputs).logits.sum().backward()
    assert counted.calls == model.config.num_hidden_layers


def test_the_blocks_go_with_their_batch():
    """The cache keeps a batch's blocks (its block mask) only while that batch lives: a run that ended holds nothing
    of its last shared row (the suite's live-tensor check of a later run once found its mask)."""
    cache = BlockCache()
    prompt_of, cu_seq_lens = torch.tensor([-1, 0, 0]), torch.tensor([0, 4, 7, 10])
    blocks = cache.blocks_of(prompt_of, cu_seq_lens, torch.device("cpu"))
    assert cache.blocks_of(prompt_of, cu_seq_lens, torch.device("cpu")) is blocks  # the batch's layers share them
    newer_prompt_of = torch.tensor([-1, 0, 0])
    newer = cache.blocks_of(newer_prompt_of, cu_seq_lens, torch.device("cpu"))
    del prompt_of  # the older batch's end must not drop the newer batch's blocks
    assert cache.blocks is newer
    del newer_prompt_of
    assert cache.blocks is None and cache.sources == ()

