"""Sample order: a keyed permutation of each epoch, and the per-rank slicing of the sample stream.

The stream is infinite: position `p` belongs to epoch `p // N` and reads sample
`Permutation(N, seed, epoch)(p % N)`. The permutation is a Feistel network over the smallest
power-of-4 domain that holds [0, N), with cycle-walking back into [0, N): a bijection computable
per index in O(1) memory, so 7 billion samples need no shuffled array (docs/design.md,
"Samples, order, resume").

Global batch `g` is stream positions [g*GBS, (g+1)*GBS); rank `r` of `dp` takes the contiguous
slice [g*GBS + r*GBS/dp, g*GBS + (r+1)*GBS/dp). Everything here is a pure function of its
arguments, so `consumed_samples` is the whole resume state. No torch: the math stays testable alone.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from data_tools.errors import UserError

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
ROUNDS = 6  # Luby-Rackoff needs 4 for a pseudo-random permutation; 2 more mix small domains well


def mix64(z: int) -> int:
    """SplitMix64's finaliser on a Python int: a bijection of 64-bit words with full avalanche."""
    z &= M64
    z = ((z ^ (z >> 30)) * _MUL1) & M64
    z = ((z ^ (z >> 27)) * _MUL2) & M64
    return z ^ (z >> 31)


def mix64_np(z: np.ndarray) -> np.ndarray:
    """`mix64` on a uint64 array (numpy array products wrap modulo 2^64, like the masked ints)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MUL1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MUL2)
    return z ^ (z >> np.uint64(31))


def round_keys(seed: int, epoch: int, rounds: int = ROUNDS) -> tuple[int, ...]:
    """The Feistel round keys for (seed, epoch): distinct, well-mixed 64-bit words."""
    state = mix64(mix64(seed & M64) ^ ((epoch & M64) * GOLDEN & M64))
    return tuple(mix64(state + (i + 1) * GOLDEN) for i in range(rounds))


class Permutation:
    """A keyed bijection of [0, n): `perm(i)` for one index, `perm.take(array)` for many.

    The scalar path uses Python ints (faster than numpy for one index, as a dataset's
    `__getitem__` needs); `take` is the same function vectorised with numpy.
    """

    def __init__(self, n: int, seed: int, epoch: int = 0):
        if n < 1:
            raise ValueError(f"permutation size must be >= 1, got {n}")
        self.n = int(n)
        self.seed = int(seed)
        self.epoch = int(epoch)
        bits = max(2, (self.n - 1).bit_length())
        self.half_bits = (bits + 1) // 2           # domain 4**half_bits is in [n, 4n)
        self.half_mask = (1 << self.half_bits) - 1
        self.keys = round_keys(self.seed, self.epoch)

    def _encrypt(self, x: int) -> int:
        h, m = self.half_bits, self.half_mask
        left, right = x >> h, x & m
        for k in self.keys:
            left, right = right, left ^ (mix64(right ^ k) & m)
        return (left << h) | right

    def __call__(self, i: int) -> int:
        i = int(i)
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} outside [0, {self.n})")
        x = self._encrypt(i)
        while x >= self.n:  # cycle-walking: the cycle through i returns to [0, n)
            x = self._encrypt(x)
        return x

    def _encrypt_np(self, x: np.ndarray) -> np.ndarray:
        h, m = np.uint64(self.half_bits), np.uint64(self.half_mask)
        left, right = x >> h, x & m
        for k in self.keys:
            left, right = right, left ^ (mix64_np(right ^ np.uint64(k)) & m)
        return (left << h) | right

    def take(self, indices) -> np.ndarray:
        """Vectorised `__call__` over an array of indices in [0, n); returns int64."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError(f"indices outside [0, {self.n})")
        x = self._encrypt_np(idx.astype(np.uint64).ravel())
        n = np.uint64(self.n)
        out_of_range = x >= n
        while out_of_range.any():
            x[out_of_range] = self._encrypt_np(x[out_of_range])
            out_of_range = x >= n
        return x.astype(np.int64).reshape(idx.shape)


def check_batch_geometry(global_batch: int, micro_batch: int, dp_size: int,
                         consumed_samples: int = 0) -> None:
    """Refuse a batch layout that would give ranks unequal slices or start mid global batch."""
    if micro_batch < 1 or dp_size < 1 or global_batch < 1:
        raise UserError(f"batch sizes must be positive: global_batch={global_batch}, "
                        f"micro_batch={micro_batch}, dp_size={dp_size}")
    if global_batch % (micro_batch * dp_size):
        raise UserError(f"global batch {global_batch} is not a multiple of micro batch "
                        f"{micro_batch} x data-parallel size {dp_size}")
    if consumed_samples < 0 or consumed_samples % global_batch:
        raise UserError(f"consumed_samples {consumed_samples} is not a non-negative multiple of "
                        f"the global batch {global_batch} (resuming with a different global "
                        f"batch than the checkpoint's?)")


def check_rank(dp_rank: int, dp_size: int) -> None:
    if not 0 <= dp_rank < dp_size:
        raise UserError(f"data-parallel rank {dp_rank} outside [0, {dp_size})")


def rank_slice(global_batch_index: int, global_batch: int, dp_rank: int, dp_size: int) -> range:
    """Stream positions rank `dp_rank` reads in global batch `global_batch_index`."""
    per_rank = global_batch // dp_size
    start = global_batch_index * global_batch + dp_rank * per_rank
    return range(start, start + per_rank)


def rank_positions(consumed_samples: int, global_batch: int, dp_rank: int,
                   dp_size: int, skip: frozenset[int] = frozenset()) -> Iterator[int]:
    """This rank's stream positions from global sample `consumed_samples` on, forever, leaving
    out the global batches in `skip` (batches a run skipped after a loss spike)."""
    check_rank(dp_rank, dp_size)
    g = consumed_samples // global_batch
    while True:
        if g not in skip:
            yield from rank_slice(g, global_batch, dp_rank, dp_size)
        g += 1


def skip_ahead(consumed_samples: int, global_batch: int, skip: frozenset[int]) -> int:
    """The stream position of the next global batch that is not skipped."""
    while consumed_samples // global_batch in skip:
        consumed_samples += global_batch
    return consumed_samples


def eval_positions(num_samples: int, micro_batch: int, dp_rank: int, dp_size: int) -> range:
    """This rank's positions of one eval pass over [0, num_samples), wrapped to equal lengths.

    Every rank gets ceil(num_samples / (micro_batch*dp_size)) micro batches, so collective ops in
    eval never wait on a rank that ran out; positions >= num_samples are read modulo num_samples.
    """
    per_rank = -(-num_samples // (micro_batch * dp_size)) * micro_batch
    return range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
