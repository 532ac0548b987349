"""Rule 7 and 8 of ``torchimpl.distributed``: each rank's share of the data, and its seed."""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Sequence

import torch

__all__ = ["ShardedData", "rank_seed", "shard_data"]

_SEED_STRIDE = 1_000_003


def rank_seed(seed: int, rank: int) -> int:
    """Rule 8: the seed of rank ``rank``'s generators (rank 0 keeps ``seed``)."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return (seed + rank * _SEED_STRIDE) % (2**63)



class ShardedData:
    """Rank ``rank``'s share of a re-iterable of batches: every ``world_size``-th batch.

    Positional sources (with ``iter_from(epoch, index)`` or ``batch(epoch, index)``, or a
    sequence) give ``iter_from`` too, so a resume starts mid-epoch without replaying. Other
    iterables are iterated with the global generator seeded from ``(seed, epoch)`` identically
    on every rank, so a shuffling ``DataLoader`` gives all ranks the same order to share.
    """

    def __init__(self, base: Any, rank: int, world_size: int, seed: int = 0):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        self.base, self.rank, self.world_size, self.seed = base, rank, world_size, seed
        self.epoch = 0
        try:
            total = len(base)
        except TypeError:
            total = None
        if total is not None and total < world_size:
            raise ValueError(f"train_data has {total} batches per epoch, fewer than the {world_size} ranks")
        self._per_rank = None if total is None else total // world_size
        self.positional = hasattr(base, "iter_from") or hasattr(base, "batch") or isinstance(base, Sequence)

    def __len__(self) -> int:
        if self._per_rank is None:
            raise TypeError("the underlying data has no length")
        return self._per_rank

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        for target in (self.base, getattr(self.base, "sampler", None), getattr(self.base, "batch_sampler", None)):
            if hasattr(target, "set_epoch"):
                target.set_epoch(epoch)

    def _indices(self, index: int) -> range:
        stop = None if self._per_rank is None else self._per_rank * self.world_size
        return range(self.rank + index * self.world_size, stop if stop is not None else 2**62, self.world_size)

    def iter_from(self, epoch: int, index: int) -> Iterator[Any]:
        if not self.positional:
            raise TypeError("iter_from needs a positional source (iter_from, batch, or a sequence)")
        self.epoch = epoch
        wanted = self._indices(index)
        base = self.base
        if hasattr(base, "batch"):
            return (base.batch(epoch, i) for i in wanted)
        if isinstance(base, Sequence) and not hasattr(base, "iter_from"):
            return (base[i] for i in wanted)
        return self._take(base.iter_from(epoch, index * self.world_size))

    def __iter__(self) -> Iterator[Any]:
        if self.positional:
            return self.iter_from(self.epoch, 0)
        return self._iterate_shared_order()

    def _iterate_shared_order(self) -> Iterator[Any]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(rank_seed(self.seed, 0) * 7919 + self.epoch)
            it = iter(self.base)
            # A sampler draws its seed lazily, at the first batch: draw it under the shared seed.
            first = next(it, _END)
        return self._take(it if first is _END else itertools.chain([first], it))

    def _take(self, source: Iterator[Any]) -> Iterator[Any]:
        # Whole groups of W batches only: an incomplete last group is dropped on every rank, so
        # all ranks run the same number of windows even when the length is unknown.
        for group in zip(*[iter(source)] * self.world_size):
            yield group[self.rank]


_END = object()


def shard_data(data: Any, rank: int, world_size: int, seed: int = 0) -> Any:
    """Rule 7: ``data`` as rank ``rank`` sees it (unchanged on one rank or with a DistributedSampler)."""
    if world_size == 1:
        return data
    sampler = getattr(data, "sampler", None)
    if isinstance(sampler, torch.utils.data.distributed.DistributedSampler):
        return data
    return ShardedData(data, rank, world_size, seed)
