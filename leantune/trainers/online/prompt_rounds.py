"""Rounds of prompts from the train set: each round's prompt rows, yielded once per micro-batch trained on it, so
the Trainer's epoch and step counting stay right (a sampler for a dataset, an iterable for a stream)."""

from __future__ import annotations

import logging

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from ...data.streaming import STREAM_BUFFER_ROWS, is_stream

logger = logging.getLogger("leantune.online")


class RoundSampler(Sampler):
    """Each round's prompt indices (one list), yielded `repeats` times: once per micro-batch trained on the round.

    Every process draws the same rounds (same seed); each keeps its own slice of the round's completions. The
    last incomplete round of an epoch is left out (its prompts come back in other epochs' shuffles).
    """

    def __init__(self, num_prompts: int, prompts_per_round: int, repeats: int, shuffle: bool, seed: int):
        self.num_prompts, self.prompts_per_round, self.repeats = num_prompts, prompts_per_round, repeats
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return (self.num_prompts // self.prompts_per_round) * self.repeats

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_prompts, generator=generator).tolist()
        else:
            order = list(range(self.num_prompts))
        for start in range(0, len(order) - self.prompts_per_round + 1, self.prompts_per_round):
            indices = order[start:start + self.prompts_per_round]
            for _ in range(self.repeats):
                yield indices


class RoundLoader(DataLoader):
    """A DataLoader whose epoch reaches its round sampler (the Trainer calls `set_epoch` on the loader)."""

    def set_epoch(self, epoch: int) -> None:
        (self.batch_sampler or self.dataset).set_epoch(epoch)


class StreamRounds(IterableDataset):
    """`RoundSampler`'s rounds for a stream of prompts (datasets.IterableDataset, no length, no indices).

    Rounds are consecutive rows of the stream, each yielded `repeats` times; an incomplete last round is left out.
    With `shuffle` (GRPO/RLOO's `shuffle_dataset`, on by default, as in TRL) the stream first goes through datasets'
    seeded buffered shuffle (`STREAM_BUFFER_ROWS` rows, reseeded each epoch): a full permutation needs the whole
    dataset, a buffer is what a stream allows. Every process reads the whole stream and draws the same rounds, as
    with the sampler; each keeps its own slice of the round's completions.
    """

    def __init__(self, stream, prompts_per_round: int, repeats: int, shuffle: bool, seed: int):
        self.stream, self.prompts_per_round, self.repeats = stream, prompts_per_round, repeats
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        stream = self.stream
        if self.shuffle:
            stream = stream.shuffle(seed=self.seed, buffer_size=STREAM_BUFFER_ROWS)
            stream.set_epoch(self.epoch)
        prompts = []
        for row in stream:
            prompts.append(row)
            if len(prompts) == self.prompts_per_round:
                for _ in range(self.repeats):
                    yield prompts
                prompts = []


def as_rows(rows: list[dict]) -> list[dict]:
    """The collate function of rounds: a round is its prompt rows as they are."""
    return rows


def row_batches(dataset, size: int):
    """Consecutive lists of `size` rows (the last one shorter) of a dataset or a stream, in order."""
    if not is_stream(dataset):
        for start in range(0, len(dataset), size):
            yield [dataset[i] for i in range(start, min(start + size, len(dataset)))]
        return
    rows = []
    for row in dataset:
        rows.append(row)
        if len(rows) == size:
            yield rows
            rows = []
    if rows:
        yield rows


def round_loader(dataset, prompts_per_round: int, repeats: int, args, stream: bool) -> RoundLoader:
    """The train loader of rounds: `prompts_per_round` prompts, each round yielded `repeats` times; `stream`: the
    dataset is a stream (data/streaming.py's `is_stream`, decided when the trainer is built)."""
    if stream:
        if args.dataloader_num_workers:
            logger.info("A streamed train set is read in rounds by the main process (worker processes would split "
                        "its generation groups): dataloader_num_workers=%d is not used.", args.dataloader_num_workers)
        rounds = StreamRounds(dataset, prompts_per_round, repeats, args.shuffle_dataset, args.seed)
        return RoundLoader(rounds, batch_size=None, collate_fn=as_rows)
    if len(dataset) < prompts_per_round:
        raise ValueError(f"The train dataset has {len(dataset)} prompts, fewer than one generation "
                         f"round needs ({prompts_per_round}).")
    left_out = len(dataset) % prompts_per_round
    if left_out:
        logger.info("%d of %d prompts per epoch fall in an incomplete last round and are left out of that epoch.",
                    left_out, len(dataset))
    sampler = RoundSampler(len(dataset), prompts_per_round, repeats, args.shuffle_dataset, args.seed)
    return RoundLoader(dataset, batch_sampler=sampler, collate_fn=as_rows, num_workers=args.dataloader_num_workers)
