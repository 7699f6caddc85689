"""A weighted mixture of datasets as one sample stream: which source, and which of its positions,
a global stream position reads. Pure math, like app/data/order.py (docs/design.md, "Samples, order,
resume", Mixtures).

The weights are quantised to shares of a block of BLOCK positions (each source at least one).
One block is laid out once: source s's j-th draw of the block ideally falls at the fraction
(j + 1/2) / share[s] of it, and the draws are sorted by that (ties: the lower source), so every
prefix of the stream holds each source within about one sample of its weight. Every block is laid
out alike, so position p is block b = p // BLOCK, offset o = p % BLOCK, source s = table[o], and
the source's own position k = b * share[s] + local[o]: O(1) time, O(BLOCK) memory, whatever the
length of the run or the number of sources. Each source then reads its own position k through its
own order (a permutation per epoch of that source), keyed by its own seed (`source_seed`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from app.data.order import mix64

BLOCK = 1 << 16
"""Positions of one laid-out block: weights are kept to 1/65,536."""
MAX_SOURCES = 1024


def quantise(weights: Sequence[float], block: int = BLOCK) -> np.ndarray:
    """Integer shares of `block` in proportion to `weights` (largest remainder, each at least 1,
    ties to the lower index): a pure function of the weights."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not 1 <= w.size <= min(MAX_SOURCES, block):
        raise ValueError(f"a mixture needs 1 to {min(MAX_SOURCES, block)} weights, got {w.size}")
    if not (np.isfinite(w).all() and (w > 0).all()):
        raise ValueError(f"mixture weights must be finite and positive, got {w.tolist()}")
    ideal = w / w.sum() * block
    shares = np.maximum(np.floor(ideal).astype(np.int64), 1)
    missing = block - int(shares.sum())
    if missing > 0:  # the largest remainders get one more
        shares[np.argsort(-(ideal - shares), kind="stable")[:missing]] += 1
    while missing < 0:  # sources raised to 1 took it: the largest surpluses give one back
        surplus = np.where(shares > 1, shares - ideal, -np.inf)
        take = np.argsort(-surplus, kind="stable")[:-missing]
        take = take[shares[take] > 1]
        shares[take] -= 1
        missing += take.size
    return shares


class Mixture:
    """Stream position -> (source, the source's own position), for a list of weights."""

    def __init__(self, weights: Sequence[float], block: int = BLOCK):
        self.block = int(block)
        self.shares = quantise(weights, self.block)
        self.num_sources = int(self.shares.size)
        source = np.repeat(np.arange(self.num_sources), self.shares)
        starts = np.concatenate([[0], np.cumsum(self.shares)[:-1]])
        draw = np.arange(self.block) - np.repeat(starts, self.shares)  # j: the source's j-th
        ideal = (2 * draw + 1) / (2.0 * self.shares[source])
        layout = np.lexsort((source, ideal))
        self.table = source[layout].astype(np.int32)
        """The source of each offset of a block."""
        self.local = draw[layout].astype(np.int64)
        """Which of its source's draws in the block each offset is."""

    @property
    def fractions(self) -> list[float]:
        """Each source's share of the stream, as quantised."""
        return (self.shares / self.block).tolist()

    def locate(self, position: int) -> tuple[int, int]:
        """(source, source position) of stream position `position`."""
        b, o = divmod(int(position), self.block)
        s = int(self.table[o])
        return s, b * int(self.shares[s]) + int(self.local[o])

    def locate_many(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """`locate` over an array of positions: (sources, source positions), int64."""
        p = np.asarray(positions, dtype=np.int64)
        b, o = np.divmod(p, self.block)
        s = self.table[o].astype(np.int64)
        return s, b * self.shares[s] + self.local[o]

    def drawn(self, positions: int) -> np.ndarray:
        """How many of the stream positions [0, positions) each source supplied."""
        b, o = divmod(int(positions), self.block)
        return b * self.shares + np.bincount(self.table[:o], minlength=self.num_sources)


def source_seed(seed: int, source: int) -> int:
    """The seed of source `source` of a mixture (its order and masks): apart from the run's seed
    and from every other source's, so no two sources share a permutation or a mask stream."""
    return mix64(mix64(seed & ((1 << 64) - 1)) + source + 1) & ((1 << 63) - 1)


def describe(names: Sequence[str], fractions: Sequence[float]) -> str:
    """'0.700 web, 0.300 code': a mixture in one line."""
    return ", ".join(f"{f:.3f} {n}" for n, f in zip(names, fractions))

