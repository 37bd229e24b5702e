"""A shared-prompt row's attention (models/segment_attention.py's prefix blocks): one SDPA call per layer,
whose outputs and gradients equal each completion's unshared causal attention over cat(prompt, completion); the
blocks' layout (data/collators.py's `prefix_blocks`, one vectorised pass) equals the block-by-block build it
replaced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from leantune.data.collators import PREFIX_BLOCKS, SharedPromptCollator, block_length, prefix_blocks
from leantune.models.segment_attention import prefix_block_attention, use_segment_attention

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
    blocks = prefix_blocks(LENGTHS, PROMPT_OF, block=block)
    count, _, block_length_, _ = blocks["mask"].shape
    if block is None:  # Lq = the longest completion (9): the 12-token prompt is 2 blocks, the second after the first
        assert block_length_ == 9 and count == 1 + 3 + 2 + 2 + 1
    else:
        assert count == sum(-(-n // 4) for n in LENGTHS)
    weights = torch.randn(4, length, 16, generator=generator)
    got = prefix_block_attention(query, key, value, blocks["queries"], blocks["keys"], blocks["mask"], blocks["output"])
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
                                    "max_length_k", "shared_prompt_of", PREFIX_BLOCKS)}
    with AttentionKernelCalls() as counted:
        model(**inputs).logits.sum().backward()
    assert counted.calls == model.config.num_hidden_layers


def loop_built_blocks(lengths: list[int], prompt_of: list[int], block: int) -> dict[str, torch.Tensor]:
    """The layout as leantune built it before (at 9e52970, in the model's first layer): block by block, with small
    tensor ops (about 700 aten ops a GRPO step in bench/grpo_step.py); kept here as the reference of the
    vectorised build."""
    starts = [sum(lengths[:n]) for n in range(len(lengths))]
    spans = []  # (query start, query length, prefix ranges [(start, length), ...])
    for start, length, prompt in zip(starts, lengths, prompt_of):
        shared = [(starts[prompt], lengths[prompt])] if prompt >= 0 else []
        for offset in range(0, length, block):
            spans.append((start + offset, min(block, length - offset), shared + [(start, offset)]))
    prefix = max(sum(n for _, n in span[2]) for span in spans)
    width = prefix + block
    queries = torch.zeros(len(spans), block, dtype=torch.long)
    keys = torch.zeros(len(spans), width, dtype=torch.long)
    mask = torch.zeros(len(spans), 1, block, width, dtype=torch.bool)
    output = torch.empty(sum(lengths), dtype=torch.long)
    own = torch.arange(block)
    causal = own[:, None] >= own[None, :]
    for n, (start, length, ranges) in enumerate(spans):
        queries[n, :length] = own[:length] + start
        seen = torch.cat([torch.arange(first, first + count) for first, count in ranges])
        keys[n, :len(seen)] = seen
        keys[n, prefix:prefix + length] = own[:length] + start
        mask[n, 0, :, :len(seen)] = True
        mask[n, 0, :, prefix:prefix + length] = causal[:, :length]
        mask[n, 0, length:, prefix:prefix + length] = True
        output[start:start + length] = own[:length] + n * block
    return {"queries": queries.flatten(), "keys": keys.flatten(), "mask": mask, "output": output}


def loop_block_length(lengths: list[int], prompt_of: list[int], smallest: int = 16) -> int:
    """The block length as chosen before: the least E x (P + Lq) x (Lq + 16) over the candidates, from every span."""
    branches = [length for length, prompt in zip(lengths, prompt_of) if prompt >= 0]
    candidates = [max(branches) if branches else max(lengths)]
    while candidates[-1] // 2 >= smallest:
        candidates.append(-(-candidates[-1] // 2))

    def work(block):
        spans = [(prompt, offset) for length, prompt in zip(lengths, prompt_of) for offset in range(0, length, block)]
        prefix = max((lengths[prompt] if prompt >= 0 else 0) + offset for prompt, offset in spans)
        return len(spans) * (prefix + block) * (block + 16)

    return min(candidates, key=lambda block: (work(block), -block))


@pytest.mark.parametrize("lengths, prompt_of", [
    (LENGTHS, PROMPT_OF),  # two groups, a completion shorter than a block (padding queries), a padding segment
    ([0, 5, 3, 6], [-1, 0, 0, -1]),  # an empty prompt, then a segment without one (a lone sequence)
    ([40, 100, 7, 30, 64, 64, 2, 90, 33, 16], [-1, 0, 0, -1, 3, 3, -1, 6, 6, -1]),  # three groups, long completions
    ([9, 3], [-1, -1]),  # no prompt at all
])
@pytest.mark.parametrize("block", [None, 4, 16])
def test_prefix_blocks_equal_the_loop_built_ones(lengths, prompt_of, block):
    """Every tensor equal, element for element (integers and booleans: exact), and the same block length chosen;
    a collated row's blocks are those of its own segments."""
    chosen = block or loop_block_length(lengths, prompt_of)
    assert block_length(lengths, prompt_of) == loop_block_length(lengths, prompt_of)
    got, expected = prefix_blocks(lengths, prompt_of, block), loop_built_blocks(lengths, prompt_of, chosen)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_a_collated_row_carries_its_own_blocks():
    """Two groups (a 3-token prompt with completions of 2 and 4, an empty completion; a 5-token prompt with 1), padded
    to a multiple of 8: the batch's blocks are those of its segments and their prompts."""
    examples = [{"input_ids": [5, 6, 7] + completion, "completion_mask": [0, 0, 0] + [1] * len(completion),
                 "prompt_length": 3} for completion in ([8, 9], [10, 11, 12, 13], [])]
    examples.append({"input_ids": [20, 21, 22, 23, 24, 25], "completion_mask": [0] * 5 + [1], "prompt_length": 5})
    batch = SharedPromptCollator(pad_token_id=0, pad_to_multiple_of=8)(examples)
    lengths, prompt_of = torch.diff(batch["cu_seq_lens_q"]).tolist(), batch["shared_prompt_of"].tolist()
    assert lengths == [3, 2, 4, 5, 1, 1] and prompt_of == [-1, 0, 0, -1, 3, -1]
    expected = loop_built_blocks(lengths, prompt_of, loop_block_length(lengths, prompt_of))
    for name, tensor in expected.items():
        assert torch.equal(batch[PREFIX_BLOCKS][name], tensor), name
