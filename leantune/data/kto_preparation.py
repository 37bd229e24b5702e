"""The KTO data recipe: unpaired (prompt, completion, label) examples, with paired preference data unpaired
automatically; tokenised, truncated, counted; each example given the mismatched completion of its KL term.

Accepted formats:

- unpaired ``{prompt, completion, label}``: strings, or message lists (conversational, through the chat
  template); ``label`` is a bool, True for a desirable completion;
- pre-tokenised unpaired ``{prompt_ids, completion_ids, label}`` (optionally
  ``KL_completion_ids``, ``ref_logps``, ``ref_kl_logps``, kept as given);
- any preference-pair format (`preference_formats`), implicit prompts included: each pair becomes a desirable
  (chosen) and an undesirable (rejected) example, next to each other.

Tokenisation follows the preference tokenizer (same prompt and completion tokens as DPO); truncation is
`PairTruncation`'s with one completion. Nothing is dropped silently: empty completions, pairs whose two
completions are identical, and prompts that fill `max_length` are dropped and counted.

The KL term (KTO paper, eq. 7) needs, for each prompt, a completion written for another prompt. The partner is
fixed here, once: the next example in a seeded permutation of the prepared dataset (skipping partners with the same
prompt), so the mismatched sequences do not depend on how batches are drawn. Batches can then be shuffled (TRL
pairs neighbours within a batch and so must sample sequentially), and the reference log-probs of the mismatched
sequences can be precomputed exactly like those of the matched ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from datasets import concatenate_datasets

from .chat_template import require_chat_template, row_template_kwargs
from .collators import CausalLMCollator, layout_like, prompt_completion_row
from .formats import current_column_names, is_message_list, rename_legacy_token_columns
from .lengths import length_summary_line
from .preference_formats import (
    PreferenceFormat,
    PreferenceTokenizer,
    detect_preference_format,
    is_empty_completion,
    is_preference_dataset,
)
from .preference_preparation import PairTruncation
from .report import NothingLeft, PreparationReport
from .template_spans import split_after_prompt

logger = logging.getLogger("leantune.data")

UNPAIRED_COLUMNS = ("prompt", "completion", "label")
TOKENIZED_UNPAIRED_COLUMNS = ("prompt_ids", "completion_ids", "label")
KL_COLUMN = "KL_completion_ids"
KL_PAIRINGS = ("permutation", "batch")
REFERENCE_COLUMNS = ("ref_logps", "ref_kl_logps")
ACCEPTED_KTO_FORMATS = (
    "unpaired {'prompt': str, 'completion': str, 'label': bool} or the same with message lists; pre-tokenised "
    "{'prompt_ids', 'completion_ids', 'label'}; or preference pairs (unpaired automatically): "
    "{'prompt', 'chosen', 'rejected'}, {'chosen', 'rejected'} with an implicit prompt, or pre-tokenised "
    "{'prompt_ids', 'chosen_ids', 'rejected_ids'}"
)
FLAGS = ("__empty__", "__identical__")


@dataclass
class KTOReport(PreparationReport):
    num_pairs_unpaired: int = 0  # paired input: pairs turned into two examples each
    num_identical_pairs_dropped: int = 0
    num_prompt_truncated: int = 0
    num_completion_truncated: int = 0
    num_prompt_too_long_dropped: int = 0
    num_desirable: int = 0
    num_undesirable: int = 0
    num_kl_partner_same_prompt: int = 0

    UNIT = "row"  # a row read is an example or a pair
    OWN_NAMES = {"num_examples_in": "num_rows_in"}
    REASONS = {
        "num_identical_pairs_dropped": "pair(s) whose chosen and rejected are identical (contradictory labels)",
        "num_empty_dropped": "example(s) with an empty completion",
        "num_prompt_too_long_dropped": "example(s) whose prompt alone fills max_length (no completion token left)",
    }

    def log(self) -> None:
        if self.num_pairs_unpaired:
            logger.info("%s: unpaired %d preference pair(s) into %d desirable (chosen) and %d undesirable (rejected) "
                        "example(s).", self.split, self.num_pairs_unpaired, self.num_pairs_unpaired,
                        self.num_pairs_unpaired)
        for name, reason in self.REASONS.items():
            if getattr(self, name):
                logger.warning("%s: dropped %d %s.", self.split, getattr(self, name), reason)
        if self.num_prompt_truncated or self.num_completion_truncated:
            logger.warning("%s: truncated %d prompt(s) and %d completion(s), dropping %d token(s).", self.split,
                           self.num_prompt_truncated, self.num_completion_truncated, self.tokens_dropped)
        if self.num_kl_partner_same_prompt:
            logger.warning("%s: %d example(s) have a KL completion written for the same prompt (too few distinct "
                           "prompts to mismatch them all, or a batch of one).", self.split, self.num_kl_partner_same_prompt)
        self.log_summary()


def prepare_kto_dataset(dataset, tokenizer, args, split: str = "train"):
    """Return (dataset of prompt/completion ids, label and, for the KL term, KL_completion_ids; KTOReport)."""
    if dataset is None:
        return None, None
    if type(dataset).__name__ in ("DatasetDict", "IterableDatasetDict"):
        raise ValueError(f"Pass one split as the {split} dataset, not a DatasetDict with {list(dataset)}.")
    report = KTOReport(split=split, num_examples_in=len(dataset))
    if report.num_examples_in == 0:
        raise ValueError(f"The {split} dataset is empty.")
    dataset = rename_legacy_token_columns(dataset)
    num_proc = args.dataset_num_proc
    dataset = _to_unpaired_ids(dataset, tokenizer, report, num_proc, split)
    if len(dataset) == 0:  # before the length summary and truncation, which need rows
        report.log()
        raise NothingLeft(f"No {split} example is left after preparation: {report.dropped()}.", report)

    lengths = np.fromiter((len(p) + len(c) for p, c in zip(dataset["prompt_ids"],
                                                           dataset["completion_ids"])), np.int64, len(dataset))
    logger.info(length_summary_line(lengths, args.max_length, split, unit="sequences (prompt + completion)"))
    truncate = CompletionTruncation(args.max_prompt_length, args.max_completion_length, args.max_length,
                                    args.truncation_mode)
    if truncate.active:
        dataset = truncate.apply(dataset, report, num_proc, split)
    labels = np.asarray(dataset["label"], dtype=bool)
    report.num_desirable, report.num_undesirable = int(labels.sum()), int((~labels).sum())
    report.num_examples_out = len(dataset)
    if len(dataset) == 0:
        report.log()
        raise NothingLeft(f"No {split} example is left after preparation: {report.dropped()}.", report)
    if args.uses_kl:
        block = None
        if args.kl_pairing == "batch":
            block = args.per_device_train_batch_size if split == "train" else args.per_device_eval_batch_size
        dataset = add_kl_completions(dataset, args.max_length, args.seed, report, num_proc, block)
    report.log()
    check_label_balance(report, args)
    return dataset, report


# --- formats -> token ids ---------------------------------------------------------------------------------------


def detect_kto_format(dataset) -> None:
    """Raise the format error _to_unpaired_ids would raise, without a tokenizer (for checks before loading)."""
    columns = current_column_names(dataset.column_names)
    if is_preference_dataset(columns):
        detect_preference_format(dataset)
    elif set(TOKENIZED_UNPAIRED_COLUMNS) <= columns:
        _check_labels(dataset)
    else:
        _detect_unpaired(dataset)


def _to_unpaired_ids(dataset, tokenizer, report: KTOReport, num_proc, split: str):
    """Any accepted format -> prompt_ids, completion_ids, label; empty / identical dropped, counted."""
    columns = set(dataset.column_names)
    if is_preference_dataset(columns):
        fmt = detect_preference_format(dataset)
        report.num_pairs_unpaired = len(dataset)
        if fmt.conversational:
            require_chat_template(tokenizer, "conversational preference data")
        tokenized = fmt is PreferenceFormat.TOKENIZED
        encode = _unpair_tokenized if tokenized else PairUnpairer(tokenizer, fmt, tokenizer.eos_token_id)
        dataset = dataset.map(encode, batched=True, remove_columns=dataset.column_names, num_proc=num_proc,
                              desc=f"Unpairing {split}")
    elif set(TOKENIZED_UNPAIRED_COLUMNS) <= columns:
        _check_labels(dataset)
        keep = [c for c in dataset.column_names if c in TOKENIZED_UNPAIRED_COLUMNS + (KL_COLUMN, *REFERENCE_COLUMNS)]
        dataset = dataset.select_columns(keep).map(
            lambda b: {"__empty__": [len(c) == 0 for c in b["completion_ids"]],
                       "__identical__": [False] * len(b["label"])},
            batched=True, num_proc=num_proc, desc=f"Checking {split}")
    else:
        conversational = _detect_unpaired(dataset)
        fmt = PreferenceFormat.CONVERSATIONAL_EXPLICIT_PROMPT if conversational else PreferenceFormat.EXPLICIT_PROMPT
        if conversational:
            require_chat_template(tokenizer, "conversational KTO data")
        dataset = dataset.map(UnpairedTokenizer(tokenizer, fmt, tokenizer.eos_token_id), batched=True,
                              remove_columns=dataset.column_names, num_proc=num_proc, desc=f"Tokenising {split}")
    empty = np.asarray(dataset["__empty__"], dtype=bool)
    identical = np.asarray(dataset["__identical__"], dtype=bool)
    report.num_identical_pairs_dropped = int(identical.sum()) // 2
    report.num_empty_dropped = int((empty & ~identical).sum())
    keep = ~(empty | identical)
    dataset = dataset.remove_columns(list(FLAGS))
    return dataset if keep.all() else dataset.select(np.flatnonzero(keep))


def _detect_unpaired(dataset) -> bool:
    """Check an unpaired {prompt, completion, label} dataset; return whether it is conversational."""
    columns = set(dataset.column_names)
    missing = [c for c in UNPAIRED_COLUMNS if c not in columns]
    if missing:
        raise ValueError(
            f"Not KTO data: missing column(s) {missing}. Columns found: {sorted(columns)}. "
            f"Accepted formats: {ACCEPTED_KTO_FORMATS}."
        )
    _check_labels(dataset)
    sample = dataset.select(range(min(len(dataset), 64)))
    kinds = set()
    for name in ("prompt", "completion"):
        for value in sample[name]:
            if value is None or value == "" or value == []:
                continue
            kinds.add("text" if isinstance(value, str) else "messages" if is_message_list(value)
                      else type(value).__name__)
    if len(kinds) > 1 or kinds - {"text", "messages"}:
        raise ValueError(
            f"'prompt' and 'completion' must both be strings or both be lists of {{'role', 'content'}} messages; "
            f"found {sorted(kinds)}. Accepted formats: {ACCEPTED_KTO_FORMATS}."
        )
    return kinds == {"messages"}


def _check_labels(dataset) -> None:
    feature = dataset.features["label"]
    dtype = getattr(feature, "dtype", type(feature).__name__)
    if dtype != "bool":
        raise ValueError(
            f"Column 'label' must hold booleans (True: desirable, False: undesirable); it holds {dtype} "
            f"(e.g. {dataset[0]['label']!r}). Convert it, e.g. dataset.cast_column('label', Value('bool')) for 0/1."
        )
    missing = sum(value is None for value in dataset["label"])
    if missing:
        raise ValueError(f"Column 'label' has {missing} missing value(s); every example needs True or False.")


class UnpairedTokenizer(PreferenceTokenizer):
    """Batched map: (prompt, completion, label) rows -> ids, by the preference tokenizer's rules.

    Text: the prompt with the tokenizer's special tokens, the completion without them plus EOS. Conversational: the
    prompt rendered with add_generation_prompt=True; the completion, the tokens of the whole conversation after it.
    """

    def __call__(self, batch: dict) -> dict:
        size = len(batch["label"])
        kwargs = [row_template_kwargs({k: batch[k][i] for k in batch}) for i in range(size)]
        prompt_ids, (completion_ids,) = self.encode_sides(batch["prompt"], [batch["completion"]], kwargs)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "label": batch["label"],
                "__empty__": [is_empty_completion(c) for c in batch["completion"]], "__identical__": [False] * size}

    def encode_sides(self, prompts: list, sides: list[list],
                     template_kwargs: list[dict] | None = None) -> tuple[list, list[list]]:
        """Prompt ids once per row, and the ids of each side's completion for it (empty completions: []); each row's
        chat-template arguments (`tools`, `chat_template_kwargs`) go to its template calls."""
        empty = [] if self.fmt.conversational else ""
        prompts = [p if p is not None else empty for p in prompts]
        if not self.fmt.conversational:
            encoded = [self._completions([c or "" for c in side]) for side in sides]
            blank = [[[] if is_empty_completion(c) else ids for c, ids in zip(side, enc)]
                     for side, enc in zip(sides, encoded)]
            return self.tokenizer(prompts)["input_ids"], blank
        prompt_ids, out = [], [[] for _ in sides]
        for i, prompt in enumerate(prompts):
            kwargs = template_kwargs[i] if template_kwargs else {}
            ids = self._prompt_ids(prompt, **kwargs)
            rendered = set()  # the prompt as rendered before each side's completion
            for side, column in zip(sides, out):
                if is_empty_completion(side[i]):
                    column.append([])
                    continue
                side_prompt, completion = split_after_prompt(self.tokenizer, prompt, side[i], ids, **kwargs)
                rendered.add(tuple(side_prompt))
                column.append(completion)
            if len(rendered) > 1:
                raise ValueError(
                    "The chat template renders the prompt differently before the chosen completion than before the "
                    "rejected one (it re-renders earlier turns depending on what follows), so the pair has no one "
                    "prompt to share. Give both completions the same shape, or use a template that renders earlier "
                    "turns the same whatever follows.")
            prompt_ids.append(list(rendered.pop()) if rendered else ids)
        return prompt_ids, out

    def _prompt_ids(self, prompt: list, **template_kwargs) -> list[int]:
        if not prompt:
            return []
        rendered = self.tokenizer.apply_chat_template(prompt, tokenize=True, return_dict=True,
                                                      add_generation_prompt=True, **template_kwargs)
        return list(rendered["input_ids"])


class PairUnpairer(UnpairedTokenizer):
    """Batched map: preference pairs -> two unpaired rows each (chosen: desirable, rejected: undesirable)."""

    def __call__(self, batch: dict) -> dict:
        rows = self.explicit_rows(batch)
        prompt_ids, (chosen_ids, rejected_ids) = self.encode_sides(
            [r["prompt"] for r in rows], [[r["chosen"] for r in rows], [r["rejected"] for r in rows]],
            [r["template_kwargs"] for r in rows])
        out = {name: [] for name in (*TOKENIZED_UNPAIRED_COLUMNS, *FLAGS)}
        for i, row in enumerate(rows):
            identical = row["chosen"] == row["rejected"]
            for completion, ids, label in ((row["chosen"], chosen_ids[i], True),
                                           (row["rejected"], rejected_ids[i], False)):
                _append_row(out, prompt_ids[i], ids, label, is_empty_completion(completion), identical)
        return out


def _unpair_tokenized(batch: dict) -> dict:
    out = {name: [] for name in (*TOKENIZED_UNPAIRED_COLUMNS, *FLAGS)}
    for prompt, chosen, rejected in zip(batch["prompt_ids"], batch["chosen_ids"],
                                        batch["rejected_ids"]):
        identical = list(chosen) == list(rejected)
        _append_row(out, prompt, chosen, True, len(chosen) == 0, identical)
        _append_row(out, prompt, rejected, False, len(rejected) == 0, identical)
    return out


def _append_row(out: dict, prompt, completion, label: bool, empty: bool, identical: bool) -> None:
    out["prompt_ids"].append(list(prompt))
    out["completion_ids"].append(list(completion))
    out["label"].append(label)
    out["__empty__"].append(empty)
    out["__identical__"].append(identical)


# --- truncation ---------------------------------------------------------------------------------------------------


class CompletionTruncation:
    """Batched map: `PairTruncation`'s rules with one completion (given as both sides), counted."""

    COUNT_COLUMNS = PairTruncation.COUNT_COLUMNS

    def __init__(self, max_prompt_length, max_completion_length, max_length, mode: str = "keep_start"):
        self.rules = PairTruncation(max_prompt_length, max_completion_length, max_length, mode)

    @property
    def active(self) -> bool:
        return self.rules.active

    def __call__(self, batch: dict) -> dict:
        out = {name: [] for name in ("prompt_ids", "completion_ids", *self.COUNT_COLUMNS)}
        for prompt, completion in zip(batch["prompt_ids"], batch["completion_ids"]):
            new_prompt, new_completion, _, too_long = self.rules.truncate(list(prompt), list(completion),
                                                                          list(completion))
            out["prompt_ids"].append(new_prompt)
            out["completion_ids"].append(new_completion)
            out["__prompt_truncated__"].append(len(new_prompt) < len(prompt))
            out["__completion_truncated__"].append(int(len(new_completion) < len(completion)))
            out["__tokens_dropped__"].append(len(prompt) + len(completion) - len(new_prompt) - len(new_completion))
            out["__prompt_too_long__"].append(too_long)
        return out

    def apply(self, dataset, report: KTOReport, num_proc, split: str):
        dataset = dataset.map(self, batched=True, num_proc=num_proc, desc=f"Truncating {split}")
        keep = ~np.asarray(dataset["__prompt_too_long__"], dtype=bool)
        counts = {name: int(np.asarray(dataset[name])[keep].sum()) for name in self.COUNT_COLUMNS}
        report.num_prompt_truncated = counts["__prompt_truncated__"]  # of the examples kept
        report.num_completion_truncated = counts["__completion_truncated__"]
        report.tokens_dropped = counts["__tokens_dropped__"]
        report.num_prompt_too_long_dropped = int((~keep).sum())
        dataset = dataset.remove_columns(list(self.COUNT_COLUMNS))
        return dataset if keep.all() else dataset.select(np.flatnonzero(keep))


# --- the KL term's mismatched completions, and label balance ------------------------------------------------------


def kl_partners(prompt_keys: np.ndarray, seed: int, tries: int = 8) -> tuple[np.ndarray, int]:
    """partner[i]: the example whose completion is paired with prompt i; the next one in a seeded permutation, or a
    later one when that has the same prompt. Returns (partners, examples left with a same-prompt partner)."""
    n = len(prompt_keys)
    if n == 1:  # one example (a tiny dataset, or a stream's last buffer): its own completion, counted and logged
        return np.zeros(1, dtype=np.int64), 1
    order = np.random.default_rng(seed).permutation(n)
    partner = np.empty(n, dtype=np.int64)
    partner[order] = np.roll(order, -1)
    same = prompt_keys[partner] == prompt_keys
    for shift in range(2, min(n, tries + 2)):
        if not same.any():
            break
        position = np.flatnonzero(same[order])  # positions in the permutation still matched with their own prompt
        candidates = order[(position + shift) % n]
        fixed = prompt_keys[candidates] != prompt_keys[order[position]]
        partner[order[position[fixed]]] = candidates[fixed]
        same = prompt_keys[partner] == prompt_keys
    return partner, int(same.sum())


def kl_partners_in_blocks(prompt_keys: np.ndarray, block: int) -> tuple[np.ndarray, int]:
    """TRL's pairing (kl_pairing="batch"): in each block of `block` consecutive examples (a batch, when batches are
    drawn in order) the completions rotate by one, so example i takes i-1's and the block's first its last. Returns
    (partners, examples left with a same-prompt partner: a block of one, or neighbours sharing a prompt)."""
    index = np.arange(len(prompt_keys))
    start = index - index % block
    size = np.minimum(block, len(prompt_keys) - start)
    partner = start + (index - start - 1) % size
    return partner, int((prompt_keys[partner] == prompt_keys).sum())


def add_kl_completions(dataset, max_length, seed: int, report: KTOReport, num_proc, block: int | None = None):
    """Add KL_completion_ids (unless given): a partner's completion (kl_partners, or kl_partners_in_blocks of
    `block`), cut (keeping its start) to fit max_length after the example's own prompt."""
    if KL_COLUMN not in dataset.column_names:
        keys = dataset.map(lambda b: {"__key__": [hash(tuple(p)) for p in b["prompt_ids"]]}, batched=True,
                           remove_columns=dataset.column_names, num_proc=num_proc, desc="Hashing prompts")["__key__"]
        keys = np.asarray(keys, dtype=np.int64)
        partner, report.num_kl_partner_same_prompt = (kl_partners(keys, seed) if block is None else
                                                      kl_partners_in_blocks(keys, block))
        partners = dataset.select(partner).select_columns(["completion_ids"]).rename_column(
            "completion_ids", KL_COLUMN)
        dataset = concatenate_datasets([dataset.flatten_indices(), partners.flatten_indices()], axis=1)
    if max_length is None:
        return dataset

    def fit(batch):
        return {KL_COLUMN: [list(kl)[: max(1, max_length - len(p))]
                            for p, kl in zip(batch["prompt_ids"], batch[KL_COLUMN])]}

    return dataset.map(fit, batched=True, num_proc=num_proc, desc="Fitting KL completions")


def check_label_balance(report: KTOReport, args) -> None:
    """Warn on one-sided data, and on weights outside the KTO paper's range (eq. 8) for unbalanced data."""
    desirable, undesirable = report.num_desirable, report.num_undesirable
    if not desirable or not undesirable:
        kind = "desirable" if desirable else "undesirable"
        logger.warning("%s: all %d examples are %s. KTO still trains (each example against the KL reference point), "
                       "but the model never sees the other kind.", report.split, desirable + undesirable, kind)
        return
    if report.split != "train" or desirable == undesirable:
        return
    # Eq. 8: desirable_weight * n_desirable / (undesirable_weight * n_undesirable) in [1, 4/3]; 5% slack so that
    # nearly balanced data (a few pairs dropped on one side) do not warn.
    ratio = args.desirable_weight * desirable / (args.undesirable_weight * undesirable)
    if not 0.95 <= ratio <= 1.4:
        low = undesirable * args.undesirable_weight / desirable
        high = desirable * args.desirable_weight / undesirable
        logger.warning(
            "train: %d desirable vs %d undesirable examples, and desirable_weight=%g / undesirable_weight=%g put the "
            "weighted ratio at %.2f, outside the KTO paper's [1, 4/3] (eq. 8). Consider desirable_weight in "
            "[%.2f, %.2f] or undesirable_weight in [%.2f, %.2f] (not both).", desirable, undesirable,
            args.desirable_weight, args.undesirable_weight, ratio, low, low * 4 / 3, high * 3 / 4, high)


# --- batches ------------------------------------------------------------------------------------------------------


@dataclass
class KTOCollator:
    """The batch's prompt + completion sequences and, as `kl_*` keys, its prompt + mismatched-completion sequences.

    Both are collated by `CausalLMCollator` (padded or padding-free, completion tokens as targets), as two separate
    layouts: the KL sequences only need a forward pass without gradient, so they never hold activations for backward.
    """

    pad_token_id: int
    padding_free: bool = False
    pad_to_multiple_of: int | None = None
    sequences: CausalLMCollator = field(init=False)

    def __post_init__(self):
        self.sequences = CausalLMCollator(self.pad_token_id, ("completion_mask",), self.padding_free,
                                          self.pad_to_multiple_of)

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        sequences = [prompt_completion_row(ex["prompt_ids"], ex["completion_ids"]) for ex in examples]
        batch = self.sequences(sequences)
        # TRL's key: 1 on completion tokens, 0 on prompt and padding (the loss reads `labels`)
        batch["completion_mask"] = layout_like(batch, [seq["completion_mask"] for seq in sequences])
        batch["desirable"] = torch.tensor([bool(ex["label"]) for ex in examples])
        batch["num_examples"] = torch.tensor(len(examples))
        if KL_COLUMN in examples[0]:
            kl = self.sequences([prompt_completion_row(ex["prompt_ids"], ex[KL_COLUMN]) for ex in examples])
            batch.update({f"kl_{name}": value for name, value in kl.items()})
        for name in REFERENCE_COLUMNS:
            if name in examples[0]:
                batch[name] = torch.tensor([float(ex[name]) for ex in examples], dtype=torch.float32)
        return batch


def kl_view(batch: dict) -> dict:
    """The KL sequences of a collated batch, under the plain names (input_ids, labels, ...)."""
    return {name[3:]: value for name, value in batch.items() if name.startswith("kl_")}
