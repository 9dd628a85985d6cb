"""Which images each rank reads in an epoch.

``global``: one permutation of all images per epoch, seeded by seed + epoch, padded to a multiple of the
world size and dealt round-robin: exactly what ``torch.utils.data.DistributedSampler`` yields.

``shard``: friendly to the filesystem. Each epoch the shards are shuffled and dealt to ranks (each to
the rank with the fewest images so far), and each rank shuffles the images of its own shards, so a
rank reads only its shards.

Either way every rank yields the same number of indices, so every rank runs the same number of steps
and DDP never waits on a rank that ran out. Padding repeats a rank's own first indices.

A run resumed on another number of ranks continues the epoch with exactly the samples the earlier run had
not reached: its ranks' unread indices, interleaved in the order that run would have trained them (one
global step after another), are dealt round-robin to the new ranks (:meth:`DistributedShardSampler.
load_state_dict` with ``remap=True``). In ``global`` mode that is the very order an uninterrupted run
follows, since each global step takes a contiguous block of the epoch's permutation whatever the number of
ranks; in ``shard`` mode the rest of that one epoch leaves the shard-per-rank locality. The state keeps the
cuts (ranks, position) of the epoch, so a run can be cut again, on any number of ranks.

The position is explicit: it changes only through :meth:`~DistributedShardSampler.set_epoch`,
:meth:`~DistributedShardSampler.load_state_dict` and :meth:`~DistributedShardSampler.advance`, which the
trainer calls with the samples it has trained. Iterating never moves it: a DataLoader's workers read ahead
of training (4 batches each by default) and run the iterator dry several steps before the epoch's end, and a
checkpoint written in that window must still name what was trained, not what was read.

Each index is yielded as a :class:`Sample`, an ``int`` that also carries its epoch and whether it is
evaluation padding. :class:`ShardDataset` seeds a sample's augmentation from (seed, epoch, index), so
augmentations do not depend on the number of workers or on where a run resumed; it labels evaluation
padding (``shuffle=False``) ``PADDING_LABEL`` so that it is not counted.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import Sampler

from hpcdl.errors import ConfigError
from hpcdl.names import SAMPLERS

MODES = SAMPLERS


class Sample(int):
    """A dataset index with its epoch; ``padding``: repeated only to even out the ranks, not to be counted."""

    epoch: int
    padding: bool

    def __new__(cls, index: int, epoch: int = 0, padding: bool = False):
        obj = super().__new__(cls, index)
        obj.epoch, obj.padding = epoch, padding
        return obj

    def __reduce__(self):
        return (Sample, (int(self), self.epoch, self.padding))


class DistributedShardSampler(Sampler[int]):
    def __init__(self, shard_sizes: list[int], num_replicas: int = 1, rank: int = 0, mode: str = "global",
                 shuffle: bool = True, seed: int = 0):
        if mode not in MODES:
            raise ConfigError(f"sampler mode {mode!r} is unknown; choose one of {', '.join(MODES)}")
        if not 0 <= rank < num_replicas:
            raise ConfigError(f"sampler rank {rank} is outside 0..{num_replicas - 1}")
        if mode == "shard" and len(shard_sizes) < num_replicas:
            raise ConfigError(f"sampler mode 'shard' needs a shard per rank: {len(shard_sizes)} shards for "
                              f"{num_replicas} ranks. Repack with a smaller --shard-size, or use mode 'global'")
        self.sizes = [int(s) for s in shard_sizes]
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.total = int(self.starts[-1])
        self.num_replicas, self.rank, self.mode, self.shuffle, self.seed = num_replicas, rank, mode, shuffle, seed
        self.epoch, self.position = 0, 0  # position: this rank's indices of the epoch trained so far
        self.cuts: list[tuple[int, int]] = []  # (ranks, position per rank) of earlier runs of this epoch
        self._dealt: tuple | None = None  # (epoch, cuts, this rank's indices) of a cut epoch, computed once

    @property
    def num_samples(self) -> int:
        """Indices per rank in the current epoch, padding included: the same on every rank."""
        if self.cuts:
            return len(self.indices())
        if self.mode == "global":
            return math.ceil(self.total / self.num_replicas)
        return max(sum(self.sizes[s] for s in shards) for shards in self._deal())

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless a loaded state resumes this very epoch."""
        if epoch != self.epoch:
            self.epoch, self.position, self.cuts = epoch, 0, []

    def __len__(self) -> int:
        """Indices left in this epoch: all of them, or fewer after a mid-epoch resume."""
        return self.num_samples - self.position

    def __iter__(self):
        """This rank's indices from the position on; the position does not move (see :meth:`advance`)."""
        epoch = self.epoch
        for i, padding in self.indices()[self.position:]:
            yield Sample(i, epoch, padding)

    def advance(self, count: int) -> list[Sample]:
        """Mark the next ``count`` indices of this rank as trained; returns them. The loader hands batches out in
        the sampler's order, so these are the samples of the batches the caller took."""
        if count < 0 or self.position + count > self.num_samples:
            raise ValueError(f"sampler: cannot advance {count} from {self.position} of {self.num_samples} indices")
        done = self.indices()[self.position:self.position + count]
        self.position += count
        return [Sample(i, self.epoch, padding) for i, padding in done]

    def fraction_done(self) -> float:
        """The share of the epoch trained, counting what runs before a cut trained."""
        if not self.cuts:
            return self.position / max(self.num_samples, 1)
        ranks, _ = self.cuts[0]
        whole = len(self._rank_list(0, ranks)) * ranks
        before = sum(r * p for r, p in self.cuts)
        return min(1.0, (before + self.position * self.num_replicas) / max(whole, 1))

    def indices(self) -> list[tuple[int, bool]]:
        """This rank's whole epoch as (index, is evaluation padding), padded entries included."""
        if not self.cuts:
            return self._rank_list(self.rank, self.num_replicas)
        key = (self.epoch, tuple(self.cuts))
        if self._dealt is None or self._dealt[:2] != key:
            self._dealt = (*key, self._after_cuts()[self.rank::self.num_replicas])
        return self._dealt[2]

    def _rank_list(self, rank: int, replicas: int) -> list[tuple[int, bool]]:
        """``rank``'s whole epoch among ``replicas`` ranks, before any cut."""
        if self.mode == "global":
            return self._global(rank, replicas)
        return self._padded(self._indices_of(rank, replicas), max(
            sum(self.sizes[s] for s in shards) for shards in self._deal(replicas)))

    def _after_cuts(self) -> list[tuple[int, bool]]:
        """The epoch's samples not reached before the last cut, in training order (global step after global
        step), padded to a multiple of this run's ranks."""
        ranks, position = self.cuts[0]
        lists = [self._rank_list(r, ranks) for r in range(ranks)]
        rest = [lst[j] for j in range(position, len(lists[0])) for lst in lists]
        for ranks, position in self.cuts[1:]:  # a later run dealt ``rest`` round-robin: it trained its head
            rest = self._pad_to(rest, ranks)[position * ranks:]
        return self._pad_to(rest, self.num_replicas)

    def _pad_to(self, order: list[tuple[int, bool]], replicas: int) -> list[tuple[int, bool]]:
        extra = (order * math.ceil(replicas / max(len(order), 1)))[:-len(order) % replicas]
        return order + [(i, not self.shuffle) for i, _ in extra]

    def _global(self, rank: int, replicas: int) -> list[tuple[int, bool]]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.total, generator=g).tolist()
        else:
            order = list(range(self.total))
        total = math.ceil(self.total / replicas) * replicas
        extra = (order * math.ceil(total / max(self.total, 1)))[:total - self.total]
        padded = [(i, False) for i in order] + [(i, not self.shuffle) for i in extra]
        return padded[rank:total:replicas]

    def _deal(self, replicas: int | None = None) -> list[list[int]]:
        """Shards per rank this epoch: shuffled, each to the rank with the fewest images so far."""
        replicas = replicas or self.num_replicas
        order = list(range(len(self.sizes)))
        if self.shuffle:
            np.random.default_rng([self.seed, self.epoch]).shuffle(order)
        load, dealt = [0] * replicas, [[] for _ in range(replicas)]
        for s in order:
            r = load.index(min(load))
            load[r] += self.sizes[s]
            dealt[r].append(s)
        return dealt

    def _indices_of(self, rank: int, replicas: int | None = None) -> list[int]:
        mine = [i for s in self._deal(replicas)[rank] for i in range(self.starts[s], self.starts[s + 1])]
        if self.shuffle:
            np.random.default_rng([self.seed, self.epoch, rank]).shuffle(mine)
        return [int(i) for i in mine]

    def _padded(self, mine: list[int], longest: int | None = None) -> list[tuple[int, bool]]:
        longest = self.num_samples if longest is None else longest
        extra = (mine * math.ceil(longest / max(len(mine), 1)))[:longest - len(mine)]
        return [(i, False) for i in mine] + [(i, not self.shuffle) for i in extra]

    def state_dict(self) -> dict:
        """Where to resume: the epoch, the indices of it trained (:meth:`advance`) and its earlier cuts."""
        return {"epoch": self.epoch, "position": self.position, "mode": self.mode, "seed": self.seed,
                "num_replicas": self.num_replicas, "total": self.total, "shuffle": self.shuffle,
                "cuts": [list(c) for c in self.cuts]}

    def load_state_dict(self, state: dict, remap: bool = False) -> None:
        """Continue where ``state`` stopped. With another number of ranks only when ``remap``: the epoch goes
        on with exactly the samples the saved run had not reached (see the module's docstring)."""
        mine = {"mode": self.mode, "seed": self.seed, "total": self.total, "shuffle": self.shuffle}
        differs = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if state.get("num_replicas") != self.num_replicas and not remap:
            differs["num_replicas"] = (state.get("num_replicas"), self.num_replicas)
        if differs:
            raise ConfigError(f"sampler state does not fit this run: {differs} (saved, now); a resume needs the "
                              "same dataset, seed and mode" + ("" if remap else ", and here the same number of ranks"))
        self.epoch = int(state["epoch"])
        self.cuts = cuts_after(state, self.num_replicas)
        self.position = int(state["position"]) if state["num_replicas"] == self.num_replicas else 0


def cuts_after(state: dict, replicas: int) -> list[tuple[int, int]]:
    """The cuts of the epoch once ``state`` (a sampler's :meth:`~DistributedShardSampler.state_dict`) is loaded on
    ``replicas`` ranks: on another count the saved position is one more cut."""
    cuts = [(int(r), int(p)) for r, p in state.get("cuts", [])]
    if state["num_replicas"] != replicas:
        cuts.append((int(state["num_replicas"]), int(state["position"])))
    return cuts
