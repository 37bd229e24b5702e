"""Context parallelism for SFT, DPO, KTO, GRPO, RLOO and Online DPO (accelerate's `parallelism_config_cp_size: 2` with
FSDP2), launched for real as 2 CPU processes by `accelerate launch --config_file
examples/accelerate/fsdp2_context_parallel.yaml`, against one process on the same data: SFT's padded rows, packing,
padding-free, packing + padding-free; DPO's and KTO's padded and padding-free batches (HH-RLHF pairs, a frozen
reference copy; KTO's mismatched completions for its KL reference point are a second layout of the batch, split
alike); GRPO padded (one round of two micro-batches: step 2 off-policy, old log-probs; loss_type "dapo", and "bnpo" at
lr 1) and padding-free (a round per step, loss_type="grpo"), RLOO and Online DPO padding-free, GRPO and Online DPO
with shared-prompt rows, all with a frozen reference (GSM8K prompts); a reward model padding-free (HH-RLHF pairs; padded, cp_run.py's `reward`, measured
once); GKD off-policy, padding-free, with a frozen teacher (another tiny model).

Under cp_size=2 both processes take the same batch and each holds half of every sequence (torch's ring attention
passes keys and values between them); the CPU-only part (the ring for the CPU SDPA kernel) is a helper in
devkit/cpu_engines/.

Tolerances (SGD with momentum 0.9, no clipping, 2 steps, lr 1e-2; tests/scripts/cp_run.py), as tests/launch/test_scale_out.py:
- Per-step losses: 1e-5 relative. Context parallelism changes only how each attention row's softmax is assembled
  (two blocks merged through their log-sum-exp, fp32: ~1e-7 relative) and how the loss's partial sums are all-reduced.
  Measured: padded identical to the last bit, packed / padding-free within 1 ulp (1e-7). Letting packed documents see
  each other (plain causal attention over the packed row, TRL's failure) moves the first step's loss by 3.4e-4
  relative (measured), 34 times the tolerance.
- Final weights: |W_cp - W_1| <= 1e-5 |W_1 - W_0| + 2^-22 |W_1| per parameter: the update is linear in the step's
  gradient, which agrees to fp32 rounding; each of the 2 steps stores W + update rounded to fp32 (half an ulp).
- DPO: each process holds part of every sequence, so its per-sequence log-prob sums are partial; they are summed over
  the context-parallel group (a differentiable all-reduce) before the loss. Those fp32 sums (magnitude ~500, where
  an ulp is 3e-5) are added in another order than one process's: about an ulp, times beta = 0.1 and the sigmoid's
  slope 1/2, ~1.5e-6 absolute on a loss of 0.69 (measured: 2.1e-6 relative padded, 6.8e-7 padding-free, at step 2;
  step 1 is log 2 exactly, policy = reference, so its gradient is checked through the weights). KTO alike (its loss
  0.5 at step 1; at step 2 its KL reference point, 0.038, is in the loss; measured 1.9e-6 padded, 1.2e-7
  padding-free). Negative control, measured once (tests/scripts/cp_run.py's case `dpo_padding_free_unsummed`,
  launched as here beside `dpo_padding_free`: each process's partial sums read as whole sequences, no all-reduce):
  step 2's loss off by 4.8e-3 relative (480 times the tolerance), the weights off by 0.50 of their update.
- GRPO, RLOO, Online DPO: each process of the group generates the same round (the same prompts and seed; the
  first process's completions taken by all), and scores its part of every sequence; the round's old and reference
  log-probs are scored inside the ring too and put together in the batch's target order (exact: each target comes
  from one process, the others add zeros). GRPO sums its token losses per process (the parts add up over the
  group) with each completion's token count made whole; RLOO and Online DPO make each completion's log-prob sums
  whole, as DPO. Measured: weights within 3.1e-5 (GRPO padded), 6.4e-6 (padding-free), 4.2e-6 (RLOO), 4.1e-5
  (Online DPO) of their update, 3% to 6% of the bound; Online DPO's loss within 5.6e-7 relative; GRPO's and RLOO's
  losses (cancelling terms, see CANCELLING) within 2.4e-7 absolute. Negative control, measured once (cp_run.py's
  case `grpo_padding_free_unsummed`, launched alone: each process's partial token counts taken as the completions'
  lengths): the weights off by 1.47 of their update (the loss, a cancellation, moves by 2.4e-7 only: the weights
  carry this check). Generating under accelerate's ring hooks (`grpo_padding_free_masks_dropped`: the left-padded
  prompts' masks dropped), measured once: other completions, the weights off by 0.39 of their update. With a
  data-parallel group over 1, measured once (4 CPU processes, dp_shard 2 x cp 2, cp_run.py's
  grpo_padding_free and rloo_padding_free against a 2-process FSDP2 launch, whose rounds use the same per-process
  seeds and slices): weights within 2.1e-5 (GRPO) and 5.7e-6 (RLOO) of their update, 3% and 5% of the bound.
  GRPO's bnpo (`grpo_bnpo`: divided by the micro-batch's own token count, the whole batch's under the ring), at lr 1 so
  that step 2 logs clip ratios and a KL: losses within 9.3e-8 absolute, weights within 4.7% of the bound. The other
  loss types, measured once as `grpo_bnpo` with each (cp_run.py's grpo_sapo, grpo_cispo, grpo_luspo, grpo_dr_grpo):
  losses within 1.9e-7 absolute, weights within 4.5% to 5.8% of the bound, logged metrics as below.
- Shared-prompt rows (`shared_prompt=True`: GRPO as `grpo`, Online DPO; RLOO measured once, cp_run.py's
  `rloo_shared`) are not run through the ring: each process holds its share of every segment of the row and
  attends to the group's gathered keys and values (trainers/parts/shared_prompt_ring.py; the layout and its
  attention are checked per token in one process above). Measured: weights within 3.8e-5 (GRPO), 3.9e-5 (Online
  DPO) and 8.1e-6 (RLOO) of their update relative, within the bound; Online DPO's step-2 loss within 1.4e-6 relative,
  GRPO's within 4.8e-8 absolute; GRPO's cp=2 shared weights are as close to one process's UNshared run (3.4e-5).
  With a data-parallel group over 1, measured once (4 CPU processes, dp_shard 2 x cp 2, against a 2-process FSDP2
  launch): GRPO's and Online DPO's shared weights within 3.9e-5 and 1.9e-5 of their update, within the bound.
  Negative control, measured once (`grpo_shared_prompt_padding_seen`: each branch also attends to its prompt's
  padding to a multiple of 2 x cp): step 2's loss off by 1.1e-5 absolute (over the 1e-5 tolerance), the weights
  by 0.25 of their update.
- Logged metrics of SFT (entropy, mean_token_accuracy) and of the online methods (`assert_same_metrics`): each
  process's means over its own targets (entropy, accuracy, KL, clip ratios) are made whole over the group, sum and
  count, so the group logs one process's values (negative control for SFT, measured once, each process's means logged as they are: packed rows' step-1
  accuracy 0.005 against 0.006098, 18% off; the entropy 1e-6 to 3e-6 off, within its tolerance).
- Reward: each sequence's reward is read at its last token, on whichever process that token lands; the position
  travels through the split and the rewards are made whole over the group (one process holds each, the other adds
  0). Measured, padded (once) and padding-free: losses identical to the last bit, weights within 5.0e-5 of their
  update (8% of the bound). Negative
  control, measured once (`reward_padding_free_unsummed`: each process's held rewards taken as all): step 1's loss
  off by 5.0e-3 relative, the weights by 0.50 of their update. GKD: the JSD summed per token as SFT's NLL (each
  process's part adds up), the teacher scoring each process's part inside the ring; measured: losses within 1.5e-7
  relative, weights within the bound (its update, lr 1, is ~1e-4: fp32 storage rounding is most of the difference).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from ..fixtures.data import gsm8k_rows
from ..fixtures.launched_runs import assert_same_losses, assert_same_weights
from ..fixtures.launchers import accelerate_launch, cpu_only, launch
from ..fixtures.models import tiny_model
from ..fixtures.paths import CPU_ENGINES, HH_PAIRS, REPO, SCRIPTS, require

SCRIPT = SCRIPTS / "cp_run.py"
HELPERS = CPU_ENGINES
CONFIG = REPO / "examples" / "accelerate" / "fsdp2_context_parallel.yaml"
CASES = ["sft", "sft_packed", "sft_padding_free", "sft_packed_padding_free", "dpo", "dpo_padding_free", "kto",
         "kto_padding_free", "grpo", "grpo_padding_free", "grpo_bnpo", "rloo_padding_free", "online_dpo_padding_free",
         "reward_padding_free", "gkd_padding_free", "grpo_shared", "online_dpo_shared"]
# GRPO's and RLOO's losses are sums of terms of magnitude |advantage| ~ 1 (advantages normalised by their group's
# std) that cancel to ~1e-7 (a group's advantages sum to 0): their values are compared to 1e-5 of those terms, absolute
CANCELLING = {"grpo", "grpo_padding_free", "grpo_bnpo", "rloo_padding_free", "grpo_shared"}
# The logged metrics compared with one process's (see `assert_same_metrics`): SFT's and the online methods'
METRICS_COMPARED = {"sft", "sft_packed", "sft_padding_free", "sft_packed_padding_free", "grpo", "grpo_padding_free", "grpo_bnpo", "rloo_padding_free", "online_dpo_padding_free", "grpo_shared",
          "online_dpo_shared"}
# Logged values that are not the method's: compared elsewhere (loss), the schedule, timings, memory, the gradient's norm
# (the weights carry it) and the padding fraction (context parallelism pads every document to a multiple of 2 x cp)
NOT_METRICS = {"loss", "learning_rate", "epoch", "step", "grad_norm", "real_tokens_per_second", "peak_memory_mb",
               "padding_fraction"}


# --- the layout, in one process -------------------------------------------------------------------------------


def test_each_process_holds_a_balanced_share_of_every_document():
    """torch's own head-tail split of the laid-out row gives process k chunks k and 2cp-1-k of EVERY document (so
    each document's ring sees exactly the head-tail layout torch's ring expects, and no process holds only one
    document's tail); targets are shifted before the split, padding inside a document has no target."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    from leantune.trainers.parts.context_parallel import lay_out_documents

    cp = 2
    lengths = [5, 8, 3]  # one row of three documents, none a multiple of 2 x cp
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    ids = torch.arange(100, 100 + sum(lengths)).unsqueeze(0)
    labels = ids.clone()
    labels[positions == 0] = -100  # the first token of a document is never a target
    laid = lay_out_documents({"input_ids": ids, "position_ids": positions}, labels, cp, pad_token_id=0)
    width = laid["input_ids"].shape[1]
    assert width == 8 + 8 + 4
    split = _HeadTailLoadBalancer(width, cp, "cpu")._generate_indices()[0].view(cp, -1)  # what torch gives each rank
    for rank in range(cp):
        mine = split[rank]
        got_ids, got_positions = laid["input_ids"][0, mine], laid["position_ids"][0, mine]
        assert torch.equal(got_positions, laid["local_positions"][rank][0])
        assert laid["local_lengths"][0] == [4, 4, 2]
        # document by document: chunk rank then chunk 2cp-1-rank of the document padded to a multiple of 4
        start = 0
        for n, local in zip(lengths, laid["local_lengths"][0]):
            chunk = local // 2
            expected = list(range(rank * chunk, (rank + 1) * chunk)) + list(
                range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk))
            assert got_positions[start:start + local].tolist() == expected, (rank, n)
            real = [p for p in expected if p < n]
            doc_start = sum(lengths[: lengths.index(n)])
            assert got_ids[start:start + len(real)].tolist() == [100 + doc_start + p for p in real]
            start += local
    # every target of the original row is kept once, as the token its position predicts
    shift = laid["shift_labels"][0]
    assert sorted(shift[shift != -100].tolist()) == sorted(labels[0, 1:][labels[0, 1:] != -100].tolist())


def test_each_process_part_of_every_sequence_sums_to_the_whole():
    """DPO under context parallelism: each process scores only its part of every sequence. With each target's sequence
    and rank carried through the layout and torch's split, the per-sequence sums of the processes' parts, summed over
    the processes, are one process's sums: plain, LD-DPO's (ranks beyond the pair's shared length weighted) and WPO's
    weights, in padded rows and in a padding-free row (the launch below checks the all-reduce and the training)."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    from leantune.losses.preference import pair_sequence_logps, wpo_weights
    from leantune.losses.token_logprobs import select_targets
    from leantune.trainers.parts.context_parallel import lay_out_documents, target_sequence_grids

    cp, lengths, prompts = 2, [9, 7, 6, 11], [4, 3, 4, 3]  # chosen 0, chosen 1, rejected 0, rejected 1
    generator = torch.Generator().manual_seed(0)

    def labelled(ids, position_ids):  # prompt tokens and padding are no targets
        labels = ids.clone()
        labels[(position_ids < torch.tensor(prompts).repeat_interleave(torch.tensor(lengths)).view_as(ids))] = -100
        return labels

    flat_positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    flat_ids = torch.arange(100, 100 + sum(lengths)).unsqueeze(0)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    padding_free = {"input_ids": flat_ids, "position_ids": flat_positions, "cu_seq_lens_q": offsets}
    padded_ids = torch.zeros(4, 12, dtype=torch.long)
    padded_labels = torch.full((4, 12), -100)
    for row, (n, p) in enumerate(zip(lengths, prompts)):
        padded_ids[row, :n] = torch.arange(100, 100 + n)
        padded_labels[row, p:n] = padded_ids[row, p:n]
    layouts = [(padding_free, labelled(flat_ids, flat_positions)), ({"input_ids": padded_ids}, padded_labels)]
    for batch, labels in layouts:
        # each position's target log-prob and WPO statistic (float64: sums in any order agree to ~1e-16 relative)
        values = torch.randn(labels.shape, dtype=torch.float64, generator=generator)
        stats = torch.randn(labels.shape, dtype=torch.float64, generator=generator)
        targets = select_targets(labels)
        starts = offsets[:-1] if "cu_seq_lens_q" in batch else torch.arange(4) * 12
        logps = values.reshape(-1)[targets.index]
        expected = pair_sequence_logps(logps, targets, starts, 2, ld_alpha=0.5)
        expected_weights = wpo_weights(logps, stats.reshape(-1)[targets.index], targets, starts, expected.lengths)

        carried = {**target_sequence_grids(batch, labels), "value": values, "stat": stats}
        if "cu_seq_lens_q" in batch:
            laid = lay_out_documents(batch, labels, cp, 0, carried)
        else:
            from leantune.losses.token_logprobs import shifted_targets

            laid = {"shift_labels": shifted_targets(labels), **carried}
        width = laid["shift_labels"].shape[1]
        split = _HeadTailLoadBalancer(width, cp, "cpu")._generate_indices()[0].view(cp, -1)
        results = sums_on_each_process(laid, split, logps)
        assert sum(count for *_, count in results) == len(targets)
        for got, weights, count in results:
            assert 0 < count < len(targets)  # each process holds part of the targets, not all
            assert torch.equal(got.lengths, expected.lengths)
            for name in ("logps", "raw_logps"):
                torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(weights, expected_weights, rtol=1e-12, atol=0)
        assert not torch.equal(expected.logps, expected.raw_logps)  # LD-DPO's weighting did apply


@pytest.mark.quick
def test_a_shared_prompt_row_split_over_the_group_attends_as_one_process():
    """A shared-prompt row (two groups, prompts of 5 and 7 tokens, completions of 1 to 6) laid out for cp 2 and 3:
    torch's own head-tail split gives each process its share of every segment, and its queries against the group's
    gathered keys and values (what the all-gather gives, process after process) equal one process's segment
    attention for every real token. The padding each segment gets is filled with large random keys and values, so
    a branch that saw its prompt's padding would differ. Every target lands on one process, at the slot holding the
    position that predicts it, with its token and place in the flat target order. (Gradients through the gather:
    the launch below.)"""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    from leantune.data.collators import SharedPromptCollator
    from leantune.models.gathered_attention import RING_SEGMENTS, attend_gathered
    from leantune.models.segment_attention import segment_sdpa_attention
    from leantune.trainers.parts.context_parallel import ORDINAL_KEY
    from leantune.trainers.parts.shared_prompt_ring import lay_out_shared_row

    groups = [(5, [3, 6, 2]), (7, [4, 1])]  # (prompt length, completion lengths)
    examples, token = [], 10
    for prompt_length, completions in groups:
        prompt = list(range(token, token + prompt_length))
        token += prompt_length
        for n in completions:
            examples.append({"input_ids": prompt + list(range(token, token + n)),
                             "completion_mask": [0] * prompt_length + [1] * n, "prompt_length": prompt_length})
            token += n
    batch = SharedPromptCollator(pad_token_id=0)(examples)
    length = batch["input_ids"].shape[1]
    batch["input_ids"] = 1000 + torch.arange(length).unsqueeze(0)  # each slot's token names its position in the row
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    query = torch.randn(1, heads, length, dim, generator=generator)
    key, value = (torch.randn(1, kv_heads, length, dim, generator=generator) for _ in range(2))
    module = torch.nn.Module().eval()
    expected, _ = segment_sdpa_attention(module, query, key, value, None, cu_seq_lens_q=batch["cu_seq_lens_q"],
                                         prefix_blocks=batch["prefix_blocks"])  # [1, length, heads, dim]
    # fp32 averages of values of magnitude ~4 over at most 13 keys: a few ulps of that, summed in another order
    tolerance = 13 * 2.0 ** -23 * float(value.abs().max())
    for cp in (2, 3):
        laid = [lay_out_shared_row(batch, cp, rank, pad_token_id=-1) for rank in range(cp)]
        width = laid[0][0]["input_ids"].shape[1]
        assert width % (2 * cp) == 0 and width > length  # every segment padded to a multiple of 2 x cp
        split = _HeadTailLoadBalancer(width, cp, "cpu")._generate_indices()[0].view(cp, -1)

        local_ids = [mine["input_ids"][0, split[rank]] for rank, (mine, _) in enumerate(laid)]

        def slots(rank, states):  # each local slot's row: the position's own, large garbage for padding
            ids = local_ids[rank]  # noqa: B023 (used in this iteration only)
            garbage = 10 * torch.randn(*states.shape[:2], len(ids), dim, generator=generator)
            real = ids >= 1000
            garbage[:, :, real] = states[:, :, ids[real] - 1000]
            return garbage

        keys = torch.cat([slots(rank, key) for rank in range(cp)], dim=2)  # the all-gather's order
        values = torch.cat([slots(rank, value) for rank in range(cp)], dim=2)
        ordinals = []
        for rank, (mine, positions) in enumerate(laid):
            ids = local_ids[rank]
            assert torch.equal(mine["position_ids"][0, split[rank]], positions[0])
            real = ids >= 1000
            assert torch.equal(positions[0, real], batch["position_ids"][0, ids[real] - 1000])
            got = attend_gathered(slots(rank, query), keys, values, mine[RING_SEGMENTS]).transpose(1, 2)
            torch.testing.assert_close(got[0, real], expected[0, ids[real] - 1000], rtol=0, atol=tolerance)
            whole = mine[ORDINAL_KEY]
            assert torch.equal(ids[mine["target_index"]] - 1000, batch["target_index"][whole])
            assert torch.equal(mine["target_tokens"], batch["target_tokens"][whole])
            ordinals += whole.tolist()
        assert sorted(ordinals) == list(range(len(batch["target_index"])))


def sums_on_each_process(laid: dict, split: torch.Tensor, whole_values: torch.Tensor) -> list:
    """Each process's (pair sums, WPO weights, target count) from its part `split[rank]` of the laid-out batch, the
    processes run as threads whose `total` sums the group's partial sums, as the all-reduce does (`whole_values`:
    the per-target values in the whole batch's flat target order)."""
    import threading

    from leantune.losses.preference import pair_sequence_logps, wpo_weights
    from leantune.losses.token_logprobs import TargetSequences, select_targets
    from leantune.trainers.parts.context_parallel import ORDINAL_KEY, RANK_KEY, SEQUENCE_KEY

    cp = split.shape[0]
    partials, barrier, results = [None] * cp, threading.Barrier(cp), [None] * cp

    def process(rank):
        def total(partial):
            partials[rank] = partial
            barrier.wait()
            whole = sum(partials)
            barrier.wait()
            return whole

        local = {name: laid[name][:, split[rank]]
                 for name in ("shift_labels", SEQUENCE_KEY, RANK_KEY, ORDINAL_KEY, "value", "stat")}
        mine = select_targets(local["shift_labels"], shifted=True)
        # each target's ordinal finds it in the whole batch's flat target order (the online methods' round inputs)
        ordinal = local[ORDINAL_KEY].reshape(-1)[mine.index]
        assert torch.equal(whole_values[ordinal], local["value"].reshape(-1)[mine.index])
        placed = TargetSequences(local[SEQUENCE_KEY].reshape(-1)[mine.index], local[RANK_KEY].reshape(-1)[mine.index],
                                 total)
        logps = local["value"].reshape(-1)[mine.index]
        got = pair_sequence_logps(logps, mine, None, 2, ld_alpha=0.5, placed=placed)
        weights = wpo_weights(logps, local["stat"].reshape(-1)[mine.index], mine, None, got.lengths, placed)
        results[rank] = (got, weights, len(mine))

    threads = [threading.Thread(target=process, args=(rank,)) for rank in range(cp)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_pad_to_multiple_of_follows_cp_size(monkeypatch):
    """TRL's rule: under context parallelism rows are padded to a multiple of 2 x cp_size; an explicit value that is
    not one is refused (cp_size from the accelerate config file arrives as environment variables)."""
    import leantune

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    assert leantune.SFTConfig(output_dir="unused", report_to=[]).pad_to_multiple_of == 4
    assert leantune.SFTConfig(output_dir="unused", report_to=[], pad_to_multiple_of=8).pad_to_multiple_of == 8
    with pytest.raises(ValueError, match=r"`pad_to_multiple_of=6` must be a multiple of 2 x cp_size = 4"):
        leantune.SFTConfig(output_dir="unused", report_to=[], pad_to_multiple_of=6)
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "1")
    assert leantune.SFTConfig(output_dir="unused", report_to=[]).pad_to_multiple_of is None


def test_models_the_ring_cannot_run_exactly_are_named():
    from transformers import MistralConfig, MistralForCausalLM

    from leantune.trainers.parts.context_parallel import attention_problem

    assert attention_problem(tiny_model()) is None
    assert "'eager'" in attention_problem(tiny_model(attn_implementation="eager"))
    mistral = MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               sliding_window=16, attn_implementation="sdpa"))
    assert "sliding_attention" in attention_problem(mistral)


def test_only_right_padded_rows_pass():
    from leantune.trainers.parts.context_parallel import check_padded_rows

    check_padded_rows(torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="padded on the right"):
        check_padded_rows(torch.tensor([[0, 1, 1, 1]]))
    with pytest.raises(ValueError, match="4-D mask"):
        check_padded_rows(torch.ones(1, 1, 4, 4))


# --- 2 processes (cp_size=2) against one ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer_dir):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("context_parallel")
    tiny_model().save_pretrained(root / "model")
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(root / "model")
    tiny_model(seed=1).save_pretrained(root / "teacher")  # GKD's teacher
    rows = gsm8k_rows(64)
    # short examples of varied lengths (none a multiple of 4 by design), so packed rows of 96 tokens hold several
    with open(root / "sft.jsonl", "w", encoding="utf-8") as handle:
        for i, row in enumerate(rows):
            handle.write(json.dumps({"prompt": row["question"][: 40 + 7 * (i % 9)],
                                     "completion": " " + row["answer"][: 30 + 5 * (i % 7)]}) + "\n")
    with gzip.open(require(HH_PAIRS), "rt", encoding="utf-8") as source, open(root / "pairs.jsonl", "w") as handle:
        for _, line in zip(range(8), source):
            handle.write(line.rstrip("\n") + "\n")
    return root


def run(assets: Path, name: str, cases: list[str], context_parallel: bool) -> Path:
    out = assets / name
    if context_parallel:
        command = [*accelerate_launch("--config_file", str(CONFIG)), str(SCRIPT), str(out), str(assets), *cases]
        env = {"PYTHONPATH": os.pathsep.join([str(HELPERS), str(REPO)]), "LEANTUNE_TEST_CPU_FSDP": "1",
               "LEANTUNE_TEST_CPU_CP": "1"}
    else:
        command, env = [sys.executable, str(SCRIPT), str(out), str(assets), *cases], {}
    result, _ = launch(command, timeout=600, extra_env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def ranks(out: Path, case: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / case).glob("rank*.json"))]


# A completion's summed log-probs: up to 16 tokens (max_completion_length), each near -log(32000) (the tiny model is
# near uniform over the 32k vocabulary)
COMPLETION_LOGPS = 16 * math.log(32000)


def terms_magnitude(case: str, name: str, value: float) -> float:
    """The magnitude of the terms a logged metric is formed from: GRPO's k3 KL is exp(d) - d - 1 (terms ~1, cancelling
    to ~1e-2 or less); RLOO's KL and Online DPO's rewards, log-probs and KL are (differences of) whole completions'
    log-prob sums; any other metric is a mean of values of its own magnitude."""
    if case.startswith("grpo") and name == "kl":
        return 1.0
    if case.startswith(("rloo", "online_dpo")) and (name == "kl" or name.startswith(("objective/", "rewards/",
                                                                                      "logps/"))):
        return max(abs(value), COMPLETION_LOGPS)
    return abs(value)


def assert_same_metrics(case: str, got: list[dict], expected: list[dict]) -> None:
    """Every logged metric of each step (entropy, KL, clip ratios, rewards, lengths, Online DPO's log-ratios) equals
    one process's, to 1e-6 (metrics are logged rounded to 6 decimals: one step of rounding) plus 2 fp32 ulps of the
    terms it is formed from (2^-22 x `terms_magnitude`: the per-token values differ by about an ulp between one
    process and the ring, as the losses do). Each process of a group computes its means over its own targets; they
    are made whole over the group (sum and count) before they are logged, so a group logs what one process logs.
    Negative control, measured once (cp_run.py's `grpo_bnpo_metrics_per_process`, launched after `grpo_bnpo`: each
    process's means logged as they are, the group's average of them): step 2's clip ratios off by 20% (low and region
    0.0375 against 0.046875, where a token of the 64 is 0.016), the KL by 9.5% (0.005257 against 0.005808, 550 times
    its tolerance), the entropy by 8e-6 (tolerance 3.5e-6); made whole, the clip ratios and KL are equal and the
    entropy within 1e-6."""
    assert len(got) == len(expected) == 2
    for step, (cp_log, one_log) in enumerate(zip(got, expected), 1):
        names = set(one_log) - NOT_METRICS
        assert names == set(cp_log) - NOT_METRICS, step
        for name in names:
            tolerance = 1e-6 + 2.0 ** -22 * terms_magnitude(case, name, one_log[name])
            assert abs(cp_log[name] - one_log[name]) <= tolerance, (step, name, cp_log[name], one_log[name])


def weights(out: Path, case: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / case / "model.safetensors"))


@pytest.mark.slow
@cpu_only
@pytest.mark.skipif(sys.platform != "linux", reason="gloo multi-process runs on Linux")
def test_sft_under_context_parallelism_matches_one_process(assets):
    from safetensors.torch import load_file

    one = run(assets, "one", CASES, context_parallel=False)
    split = run(assets, "cp", CASES + ["refusals"], context_parallel=True)
    initial = load_file(str(assets / "model" / "model.safetensors"))
    for case in CASES:
        first, second = ranks(split, case)
        assert (first["world"], first["engine"], first["cp_size"], first["pad_to_multiple_of"]) == (2, "FSDP", 2, 4)
        assert first["losses"] == second["losses"]
        if case in CANCELLING:
            assert all(abs(g - e) <= 1e-5 for g, e in zip(first["losses"], ranks(one, case)[0]["losses"]))
        else:
            assert_same_losses(first["losses"], ranks(one, case)[0]["losses"])
        assert_same_weights(weights(split, case), weights(one, case), initial)
        if case in METRICS_COMPARED:
            assert_same_metrics(case, first["logs"], ranks(one, case)[0]["logs"])
    # packing changes the batches (several documents per row), so its losses are not the padded ones: the packed
    # comparison is of documents kept apart, not of a layout that happens to hold one document per row
    assert ranks(one, "sft_packed")[0]["losses"] != ranks(one, "sft")[0]["losses"]

    refused = ranks(split, "refusals")[0]
    assert "sliding_attention" in refused["sliding_window"]
    assert "attn_implementation='sdpa'" in refused["eager"]
    assert "compute_loss_func" in refused["compute_loss_func"]
    assert "OnlineDPOTrainer only; PPOTrainer" in refused["ppo"]
    assert "`cp_size=2`" in refused["gkd_on_policy"] and "`lmbda=0.5`" in refused["gkd_on_policy"]
    assert "must be a multiple of 2 x cp_size = 4" in refused["pad_to_multiple_of"]
    assert "`cp_size=2`" in refused["grpo_sequence_level"]
    assert "importance_sampling_level='sequence'" in refused["grpo_sequence_level"]
    assert refused["pad_to_multiple_of_default"] == "4"
    # a direct evaluate() runs the evaluation rounds that `eval_strategy` would, outside the ring: refused alike
    assert "`cp_size=2`" in refused["online_evaluate"] and "GRPOTrainer.evaluate()" in refused["online_evaluate"]
