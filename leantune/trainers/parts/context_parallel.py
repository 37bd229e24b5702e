"""Context parallelism (accelerate's `ParallelismConfig(cp_size=...)` with FSDP2): every sequence of a batch is split
along time over the `cp_size` processes of a context-parallel group, and torch's ring attention
(`torch.distributed.tensor.experimental.context_parallel`, entered by `Accelerator.maybe_context_parallel`) passes
keys and values around the group. Nothing here is an engine: accelerate builds the mesh, shards the model with FSDP2
over data x context, attaches its attention hooks and shards the batch; this module only lays the batch out so that
what torch computes is exactly what one process computes.

- Targets are shifted before the batch is split (`shift_labels`: the token each position predicts), so no target is
  lost or misplaced at a shard's edge, and the chunked head scores each process's hidden states against them.
- Padded rows: right padding, so plain causal attention (the only mask the ring computes; accelerate's hooks drop the
  model's mask) gives every real token exactly its own row's attention. The row is padded to a multiple of
  2 x cp_size, which torch's head-tail load balancing needs.
- Packed and padding-free rows: plain causal attention would let each document see the documents before it. Each
  document (and the row's trailing padding) is padded to a multiple of 2 x cp_size and the row is reordered so that
  torch's head-tail split gives every process, for EVERY document, that document's chunk k and chunk 2 x cp_size - 1 - k:
  each process holds an equal, balanced share of each document. Attention then runs one causal SDPA call per
  document (leantune's segment attention, with this process's document lengths); under `context_parallel` each call
  is torch's ring attention over that document alone, its head-tail layout being exactly the one the ring expects.
  Every document attends only to itself across the ring.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from accelerate.big_modeling import _attach_context_parallel_hooks  # what Accelerator.prepare runs for the policy
from torch.distributed.nn.functional import all_reduce

from ...data.collators import sequence_starts
from ...losses.token_logprobs import IGNORE_INDEX, TargetSequences, select_targets, shifted_targets
from .ring_order import ORDINAL_KEY, RANK_KEY, SEQUENCE_KEY, group_order
from .shared_prompt_ring import lay_out_shared_row

# The keys of one layout of a batch; KTO's batches hold a second one, of its mismatched sequences, under this prefix
LAYOUT_KEYS = ("input_ids", "labels", "attention_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
               "max_length_q", "max_length_k")
KL_PREFIX = "kl_"
SUPPORTED_TRAINERS = (
    "SFTTrainer, DPOTrainer, KTOTrainer, RewardTrainer, GKDTrainer, GRPOTrainer, RLOOTrainer and OnlineDPOTrainer")


def cp_size_of(accelerator) -> int:
    """The context-parallel size the accelerator runs with (1 without context parallelism)."""
    config = getattr(accelerator, "parallelism_config", None)
    return int(config.cp_size) if config is not None and config.cp_enabled else 1


def data_parallel_place(accelerator) -> tuple[int, int]:
    """(this process's data-parallel rank, the data-parallel size): the processes of a context-parallel group hold the
    same data. accelerate's mesh nests cp inside the data-parallel dimensions (its data loader gives a process the
    batch of process_index // cp_size), so the online rounds split their prompts the same way."""
    cp = cp_size_of(accelerator)
    return accelerator.process_index // cp, accelerator.num_processes // cp


def gather_once_per_group(accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """`accelerator.gather` with each context-parallel group's copy kept once (its first process's): a round's
    rewards and lengths, in round order, as data parallelism alone would gather them."""
    gathered = accelerator.gather(tensor)
    cp = cp_size_of(accelerator)
    if cp == 1:
        return gathered
    return gathered.view(-1, cp, *tensor.shape)[:, 0].reshape(-1, *tensor.shape[1:])


def from_group_first(accelerator, value):
    """`value` as the first process of this context-parallel group has it (a picklable object), on every process
    of the group: what a group generates must be one round, token for token, whatever a sampler's last bit does."""
    if cp_size_of(accelerator) <= 1:
        return value
    group = accelerator.torch_device_mesh["cp"].get_group()
    box = [value]
    torch.distributed.broadcast_object_list(box, src=torch.distributed.get_global_rank(group, 0), group=group)
    return box[0]


def generation_group(accelerator):
    """How a context-parallel group generates one round together (`generate_in_group`, as the generation session's
    `in_group`); None without context parallelism."""
    return functools.partial(generate_in_group, accelerator) if cp_size_of(accelerator) > 1 else None


def generate_in_group(accelerator, model, generate):
    """`generate()` as a context-parallel group runs it: outside the ring (its hooks suspended), the group's first
    process's completions kept by all (see `ring_hooks_suspended`, `from_group_first`)."""
    with ring_hooks_suspended(model):
        completions = generate()
    return from_group_first(accelerator, completions)


RING_HOOK_NAME = "_self_attn_pre_forward_hook"  # accelerate's (big_modeling._attach_context_parallel_hooks)


@contextlib.contextmanager
def ring_hooks_suspended(model: torch.nn.Module):
    """Inside: the model's attention modules without accelerate's ring hooks, which drop every attention mask for
    the ring's plain causal attention. Generation runs outside the ring on left-padded prompts, whose mask must hold.
    The hooks are put back first in their modules' order, as accelerate placed them."""
    removed = []
    for module in model.modules():
        for key, hook in list(module._forward_pre_hooks.items()):
            if getattr(hook, "__name__", "") == RING_HOOK_NAME:
                removed.append((module, key, hook))
                del module._forward_pre_hooks[key]
    try:
        yield model
    finally:
        for module, key, hook in removed:
            module._forward_pre_hooks[key] = hook
            module._forward_pre_hooks.move_to_end(key, last=False)


def attention_problem(model) -> str | None:
    """Why context parallelism cannot run this model's attention exactly (None when it can)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "leantune_segment_sdpa"):
        return (f"its attention implementation is {implementation!r}; torch's ring attention replaces SDPA only, so "
                f"load the model with attn_implementation='sdpa'")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        other = sorted({t for t in layer_types if t != "full_attention"})
    else:  # models that predate layer_types (Mistral) apply their window to every layer when it is set
        other = ["sliding_attention"] if getattr(config, "sliding_window", None) else []
    if other:
        return (f"it has {other} layers; the ring computes full causal attention only, so those layers would attend "
                f"beyond their window")
    if getattr(config, "attention_chunk_size", None):
        return "it uses chunked attention (`attention_chunk_size`); the ring computes full causal attention only"
    return None


def prepare_frozen_for_ring(accelerator, model: torch.nn.Module, role: str) -> None:
    """A frozen model run beside the policy under context parallelism (DPO's reference copy) gets what accelerate
    gives the trained model only: its attention modules' hooks that drop the mask for the ring's plain causal
    attention. A model the ring cannot run exactly is refused, as the policy is."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is None or not config.cp_enabled:
        return
    problem = attention_problem(accelerator.unwrap_model(model))
    if problem is not None:
        raise ValueError(f"Context parallelism (`cp_size={config.cp_size}`) cannot run the {role} exactly: {problem}.")

    _attach_context_parallel_hooks(model)


def _segments(position_ids: torch.Tensor) -> list[list[int]]:
    """The lengths of each row's segments (positions restart at 0 at every sequence, and at the row's padding)."""
    rows = []
    for row in position_ids.tolist():
        starts = [i for i, p in enumerate(row) if p == 0] + [len(row)]
        if starts[0] != 0:
            starts.insert(0, 0)
        rows.append([b - a for a, b in zip(starts, starts[1:]) if b > a])
    return rows


def lay_out_documents(batch: dict, labels: torch.Tensor, cp: int, pad_token_id: int,
                      carried: dict[str, torch.Tensor] | None = None, width: int = 0) -> dict:
    """A batch of segmented rows (packed or padding-free) laid out for context parallelism: every segment padded to a
    multiple of 2 x cp (padding continues its positions and has no target), the rows made one width, and the tokens
    of each row reordered so that torch's head-tail split gives each process chunks k and 2cp-1-k of every
    segment. Returns input_ids, shift_labels, position_ids (reordered, not yet split) and the per-process segment
    lengths (`local_lengths`) and the expected local position ids (`local_positions`, one row per process).
    `carried`: more per-position values aligned with the shifted targets (-1 where padding is added), laid out
    with them and returned under their names. `width`: the rows' width at least (a multiple of 2 x cp)."""
    multiple = 2 * cp
    device = batch["input_ids"].device
    input_ids, labels, positions = batch["input_ids"].cpu(), labels.cpu(), batch["position_ids"].cpu()
    shift = shifted_targets(labels)  # before any reordering: the next token of each position in its own row
    carried = {name: values.cpu() for name, values in (carried or {}).items()}
    rows = []
    for r, lengths in enumerate(_segments(positions)):
        ids, tgt, pos, padded, more, start = [], [], [], [], {name: [] for name in carried}, 0
        for n in lengths:
            m = -(-n // multiple) * multiple
            ids.append(torch.cat([input_ids[r, start:start + n], input_ids.new_full((m - n,), pad_token_id)]))
            tgt.append(torch.cat([shift[r, start:start + n], shift.new_full((m - n,), IGNORE_INDEX)]))
            pos.append(torch.cat([positions[r, start:start + n],
                                  positions[r, start + n - 1] + 1 + torch.arange(m - n, dtype=positions.dtype)]))
            for name, values in carried.items():
                more[name].append(torch.cat([values[r, start:start + n], values.new_full((m - n,), -1)]))
            padded.append(m)
            start += n
        rows.append((torch.cat(ids), torch.cat(tgt), torch.cat(pos), {k: torch.cat(v) for k, v in more.items()},
                     padded))
    width = max(width, max(sum(padded) for *_, padded in rows))
    out_ids, out_tgt, out_pos, local_lengths, local_positions = [], [], [], [], [[] for _ in range(cp)]
    out_more = {name: [] for name in carried}
    for ids, tgt, pos, more, padded in rows:
        extra = width - sum(padded)
        if extra:  # a padding segment of its own, so the rows have one width
            ids = torch.cat([ids, ids.new_full((extra,), pad_token_id)])
            tgt = torch.cat([tgt, tgt.new_full((extra,), IGNORE_INDEX)])
            pos = torch.cat([pos, torch.arange(extra, dtype=pos.dtype)])
            more = {name: torch.cat([values, values.new_full((extra,), -1)]) for name, values in more.items()}
            padded = padded + [extra]
        wanted, order = group_order(padded, cp)
        out_ids.append(ids[order])
        out_tgt.append(tgt[order])
        out_pos.append(pos[order])
        for name, values in more.items():
            out_more[name].append(values[order])
        local_lengths.append([m // cp for m in padded])
        for rank, block in enumerate(pos[wanted].view(cp, -1)):
            local_positions[rank].append(block)
    return {
        "input_ids": torch.stack(out_ids).to(device),
        "shift_labels": torch.stack(out_tgt).to(device),
        "position_ids": torch.stack(out_pos).to(device),
        "local_lengths": local_lengths,
        "local_positions": [torch.stack(p) for p in local_positions],
        **{name: torch.stack(values).to(device) for name, values in out_more.items()},
    }


def laid_width(view: dict, cp: int) -> int:
    """The width of a batch's rows once laid out: padded rows keep theirs, segmented rows pad every segment to a
    multiple of 2 x cp."""
    if "cu_seq_lens_q" not in view:
        return int(view["input_ids"].shape[1])
    multiple = 2 * cp
    return max(sum(-(-n // multiple) * multiple for n in row) for row in _segments(view["position_ids"].cpu()))


def target_sequence_grids(batch: dict, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per position of the batch's [rows, width] grid, the sequence of the target that position predicts, that
    target's 0-based rank among its sequence's targets and its place in the batch's flat target order (-1 where the
    position predicts nothing). Computed before the batch is laid out and split, so that after the split each process
    still knows which sequence, and where in it, each of its targets is: its per-sequence sums are partial, and these
    say which partial sum each target joins; per-target inputs of the whole batch (the online methods' old and
    reference log-probs) are read at the ordinals."""
    targets = select_targets(labels)
    placed = TargetSequences.contiguous(targets, sequence_starts(batch).to(labels.device))
    ordinal = torch.arange(len(targets), device=labels.device)
    return {SEQUENCE_KEY: targets.scatter(placed.sequence, fill=-1), RANK_KEY: targets.scatter(placed.rank, fill=-1),
            ORDINAL_KEY: targets.scatter(ordinal, fill=-1)}


def local_segment_offsets(local_lengths: list[list[int]], device) -> tuple[torch.Tensor, int]:
    """cu_seq_lens over this process's flattened rows (segment attention / FlashAttention varlen) and the longest."""
    flat = [n for row in local_lengths for n in row]
    offsets = torch.tensor([0] + flat, dtype=torch.int32).cumsum(0).to(torch.int32)
    return offsets.to(device), max(flat)


def check_padded_rows(attention_mask: torch.Tensor) -> None:
    """Padded rows are exact under the ring's causal attention only when padded on the right (each row: ones, then
    zeros); any other mask would be dropped by accelerate's hooks and change what real tokens attend to."""
    if attention_mask.dim() != 2:
        raise ValueError(f"Context parallelism drops the attention mask (torch's ring attention computes plain causal "
                         f"attention); a {attention_mask.dim()}-D mask cannot be honoured. Use leantune's collator "
                         f"(right-padded rows, or packing / padding_free for several sequences per row).")
    mask = attention_mask.bool()
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise ValueError("Context parallelism drops the attention mask (torch's ring attention computes plain causal "
                         "attention), so rows must be padded on the right; these rows have padding before real tokens.")


class ContextParallelism:
    """What a trainer holds for context parallelism: it refuses at construction what the ring cannot run exactly, and
    lays each batch out before accelerate splits it (the trainer's `_prepare_context_parallel_inputs` hands the batch
    here). `batch_targets`: the target count of the whole batch being split (the loss normaliser divides by it)."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.size = cp_size_of(accelerator)
        # known once: this process's data-parallel (rank, size) and the round's gather (`gather_once_per_group`;
        # without a ring, accelerate's own), for the parts that split and gather a round (trainers/online/)
        self.data_parallel_rank, self.data_parallel_size = data_parallel_place(accelerator)
        self.gather_once_per_group = (accelerator.gather if self.size == 1
                                      else functools.partial(gather_once_per_group, accelerator))
        self.batch_targets = None
        self._local_positions = None  # {layout prefix: this process's expected position ids} of segmented rows

    def check(self, trainer_name: str, supported: bool, model, compute_loss_func, pad_to_multiple_of: int | None,
              option_problem: str | None = None) -> None:
        """Refuse, when the trainer is built, what context parallelism cannot run exactly (`option_problem`: an
        option of the method's that it cannot, said by the trainer; `pad_to_multiple_of`: the resolved layout's)."""
        cp = self.size
        if cp <= 1:
            return
        if not supported:
            raise ValueError(f"Context parallelism (`cp_size={cp}`) is supported by {SUPPORTED_TRAINERS} only; "
                             f"{trainer_name}'s loss would read each process's part of every sequence as the whole "
                             f"sequence. Set `cp_size` to 1.")
        if option_problem is not None:
            raise ValueError(f"Context parallelism (`cp_size={cp}`) cannot run {trainer_name} with {option_problem}; "
                             f"set `cp_size` to 1 or change that option.")
        problem = attention_problem(self.accelerator.unwrap_model(model))
        if problem is not None:
            raise ValueError(f"Context parallelism (`cp_size={cp}`) cannot run this model exactly: {problem}.")
        if compute_loss_func is not None:
            raise ValueError(f"A `compute_loss_func` would get one process's part of each sequence under context "
                             f"parallelism (`cp_size={cp}`); leave it out or set `cp_size` to 1.")
        if not pad_to_multiple_of or pad_to_multiple_of % (2 * cp):
            raise ValueError(f"`pad_to_multiple_of` must be a multiple of 2 x cp_size = {2 * cp} under context "
                             f"parallelism, got {pad_to_multiple_of!r}; leave it unset for {2 * cp}.")

    def lay_out(self, inputs, pad_token_id, per_sequence: bool = False, position_grids=None):
        """(accelerate's context manager, the batch): see `_lay_out_for_the_ring`; without a ring, as it is."""
        if self.size <= 1:
            return contextlib.nullcontext, inputs
        return self._lay_out_for_the_ring(inputs, pad_token_id, per_sequence, position_grids)

    def _lay_out_for_the_ring(self, inputs, pad_token_id, per_sequence: bool, position_grids):
        """Lay the batch out for context parallelism (targets shifted before the split; packed and padding-free
        rows so that each document attends only to itself across the ring) and hand it to accelerate's
        `maybe_context_parallel`, which splits input_ids, shift_labels and position_ids along time. `per_sequence`
        (a loss over per-sequence sums, DPO's and KTO's): each target's sequence and rank travel with it through the
        split (`target_sequence_grids`), for `placed_targets`. `position_grids` (view -> {name: [rows, width]
        values, -1 where none}): more per-position values, read from the batch as collated and carried through the
        split (the reward model's: which sequence's reward each position holds). KTO's mismatched sequences (`kl_*`
        keys) are a second layout of the batch, laid out alike; torch splits every buffer with one load balancer,
        so both get one width."""
        inputs = dict(inputs)
        pad = 0 if pad_token_id is None else pad_token_id
        if "shared_prompt_of" in inputs:  # a shared-prompt row: its own layout (one position predicts several tokens)
            return self._lay_out_shared_row(inputs, pad)
        prefixes = ("", KL_PREFIX) if KL_PREFIX + "input_ids" in inputs else ("",)
        views = {prefix: {name: inputs.pop(prefix + name) for name in LAYOUT_KEYS if prefix + name in inputs}
                 for prefix in prefixes}
        width = max(laid_width(view, self.size) for view in views.values())
        self._local_positions, buffers = {}, []
        for prefix, view in views.items():
            labels = view.pop("labels")
            grids = position_grids(view) if position_grids is not None else {}
            if "cu_seq_lens_q" in view:  # packed or padding-free rows: per-document layout
                carried = {**(target_sequence_grids(view, labels) if per_sequence else {}), **grids}
                self._lay_out_documents(view, labels, pad, carried, width, prefix)
            else:
                labels = self._lay_out_rows(view, labels, width, pad)
                carried = {**(target_sequence_grids(view, labels) if per_sequence else {}),
                           **{name: F.pad(grid, (0, labels.shape[1] - grid.shape[1]), value=-1)
                              for name, grid in grids.items()}}
                view.update(carried)
            view["input_ids"] = view["input_ids"].clone()
            inputs.update({prefix + name: value for name, value in view.items()})
            buffers += [view["input_ids"], view["shift_labels"], view["position_ids"], *(view[k] for k in carried)]
        self.batch_targets = (inputs["shift_labels"] != IGNORE_INDEX).sum()
        return functools.partial(self.accelerator.maybe_context_parallel, buffers=buffers,
                                 buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)), inputs

    def _lay_out_shared_row(self, inputs: dict, pad: int):
        """A shared-prompt row: not through the ring (a completion attends to another segment, its prompt) but
        split alike, its attention over the group's gathered keys and values (parts/shared_prompt_ring.py)."""
        mesh = self.accelerator.torch_device_mesh["cp"]
        laid, positions = lay_out_shared_row(inputs, self.size, mesh.get_local_rank(), pad, mesh.get_group())
        self.batch_targets = inputs["target_index"].numel()
        self._local_positions = {"": positions}
        inputs.update(laid)
        buffers = [inputs["input_ids"], inputs["position_ids"]]
        return functools.partial(self.accelerator.maybe_context_parallel, buffers=buffers,
                                 buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)), inputs

    @staticmethod
    def _per_target(inputs: dict, key: str, targets) -> torch.Tensor:
        """A target place of this process's targets: a shared-prompt row carries one value per target, other
        layouts a grid over positions (read at the targets' positions)."""
        if "shared_prompt_of" in inputs:
            return inputs[key].to(targets.index.device)
        return inputs[key].reshape(-1).index_select(0, targets.index)

    def _lay_out_documents(self, inputs: dict, labels: torch.Tensor, pad: int, carried: dict, width: int,
                           prefix: str) -> None:
        cp = self.size
        rank = self.accelerator.torch_device_mesh["cp"].get_local_rank()
        laid = lay_out_documents(inputs, labels, cp, pad, carried, width)
        offsets, longest = local_segment_offsets(laid["local_lengths"], labels.device)
        inputs.update(input_ids=laid["input_ids"], shift_labels=laid["shift_labels"],
                      position_ids=laid["position_ids"], cu_seq_lens_q=offsets, cu_seq_lens_k=offsets,
                      max_length_q=longest, max_length_k=longest, **{k: laid[k] for k in carried})
        self._local_positions[prefix] = laid["local_positions"][rank]

    def placed_targets(self, inputs: dict, targets) -> TargetSequences | None:
        """This process's targets' sequences and ranks (None for a batch not laid out with `per_sequence`), with
        `total` summing per-sequence values over the context-parallel group: every process of it holds part of
        every sequence, so a sequence's sum is the sum of its processes' partial sums."""
        if SEQUENCE_KEY not in inputs:
            return None
        sequence, rank = self._per_target(inputs, SEQUENCE_KEY, targets), self._per_target(inputs, RANK_KEY, targets)
        return TargetSequences(sequence, rank, self.total)

    @classmethod
    def target_ordinals(cls, inputs: dict, targets) -> torch.Tensor:
        """Where each of this process's targets is in the whole batch's flat target order (a batch laid out with
        `per_sequence`): per-target values of the whole batch are read there."""
        return cls._per_target(inputs, ORDINAL_KEY, targets)

    def whole_order(self, local: torch.Tensor, ordinals: torch.Tensor, count: int) -> torch.Tensor:
        """This process's per-target values -> the whole batch's, in its flat target order, on every process of the
        group (no gradient): each target is held by one process, the others add zeros, so the sum is exact."""
        whole = local.new_zeros(count).index_copy(0, ordinals.to(local.device), local.detach())
        torch.distributed.all_reduce(whole, group=self.accelerator.torch_device_mesh["cp"].get_group())
        return whole

    def total(self, partial: torch.Tensor) -> torch.Tensor:
        """Per-sequence partial sums -> whole-sequence sums on every process of the context-parallel group; the
        sum's gradient flows back to every process's part (torch.distributed.nn's differentiable all-reduce). A loss
        formed from these sums is then the same on every process of the group, so the step's loss normaliser divides
        it by cp_size (base.py's StepLoss: the all-reduce's backward sums the group's cp_size copies)."""
        group = self.accelerator.torch_device_mesh["cp"].get_group()
        if partial.requires_grad:
            return all_reduce(partial, group=group)
        whole = partial.clone()
        torch.distributed.all_reduce(whole, group=group)
        return whole

    def whole_means(self, metrics: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
        """A micro-batch's logged metrics as one process holding the whole sequences computes them, on every process
        of the group. Each metric is either a mean over this process's `count` targets (entropy, KL, clip ratios:
        its part of every sequence, whose mean is not the whole's when the parts' counts differ) or a value the group
        holds alike (computed from sums already made whole: RLOO's, Online DPO's). For both, the group's summed
        mean x count over its summed count is the whole value (in float64: a shared value comes back to its fp32
        bits). A process without targets (NaN means) adds nothing."""
        if not metrics:
            return metrics
        names = list(metrics)
        means = torch.stack([metrics[name].detach().reshape(()).double() for name in names]).to(self.accelerator.device)
        held = torch.tensor(float(count), dtype=torch.float64, device=means.device)
        sums = torch.cat([means * held if count else torch.zeros_like(means), held.reshape(1)])
        torch.distributed.all_reduce(sums, group=self.accelerator.torch_device_mesh["cp"].get_group())
        return dict(zip(names, sums[:-1] / sums[-1]))

    def _lay_out_rows(self, inputs: dict, labels: torch.Tensor, width: int, pad: int) -> torch.Tensor:
        """Right-padded rows as they are (padded further to `width`); returns the labels at that width."""
        cp = self.size
        mask = inputs.pop("attention_mask", None)
        if mask is not None:
            check_padded_rows(mask)
        positions = inputs.get("position_ids")
        if positions is not None and (positions[:, 1:] <= positions[:, :-1]).any():
            raise ValueError("These rows hold several sequences (their position_ids restart) but no "
                             "`cu_seq_lens_q` offsets: context parallelism would let each sequence attend to the "
                             "ones before it. Use leantune's collator with `packing` / `padding_free`.")
        own = inputs["input_ids"].shape[1]
        if own % (2 * cp):
            raise ValueError(f"A batch of width {own} cannot be split into 2 x cp_size = {2 * cp} equal chunks; "
                             f"set `pad_to_multiple_of` to a multiple of {2 * cp}.")
        if positions is None:
            positions = torch.arange(own, device=labels.device).expand(labels.shape[0], -1)
        if width > own:  # right padding up to the other layout's width (KTO's KL sequences): no targets
            extra = width - own
            inputs["input_ids"] = F.pad(inputs["input_ids"], (0, extra), value=pad)
            labels = F.pad(labels, (0, extra), value=IGNORE_INDEX)
            positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(extra, device=labels.device)], 1)
        inputs["shift_labels"] = shifted_targets(labels).contiguous()
        inputs["position_ids"] = positions.clone()
        return labels

    def check_layout(self, inputs: dict, prefix: str = "") -> None:
        """Inside the split: this process holds the positions leantune's layout put there (a safety net should
        torch's split ever change). `prefix`: the layout's (KTO's `kl_`)."""
        expected = (self._local_positions or {}).get(prefix)
        if expected is not None and not torch.equal(inputs["position_ids"].cpu(), expected):
            raise RuntimeError("torch's context-parallel split did not give this process the tokens leantune laid out "
                               "for it (its head-tail load balancing changed?); packed documents would mix.")
