"""The sample order: a keyed bijection per epoch, and the per-rank slicing of global batches."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from app.data.order import (
    Permutation,
    check_batch_geometry,
    eval_positions,
    rank_positions,
    rank_slice,
)
from data_tools.errors import UserError

# 1, 2, primes, powers of 2 and 4, and sizes far below their Feistel domain (cycle-walking)
SIZES = [1, 2, 3, 4, 5, 7, 13, 16, 17, 31, 64, 65, 97, 127, 128, 129, 257, 1000, 1023, 1024,
         1025, 4099, 65537]


@pytest.mark.parametrize("n", SIZES)
def test_permutation_is_a_bijection_of_range(n):
    for seed, epoch in [(0, 0), (1234, 7)]:
        perm = Permutation(n, seed, epoch)
        out = perm.take(np.arange(n))
        assert out.dtype == np.int64
        assert np.array_equal(np.sort(out), np.arange(n))


def test_sizes_include_cycle_walking():
    """At least some sizes must leave the domain: else cycle-walking would be untested."""
    walked = [n for n in SIZES if 4 ** Permutation(n, 0).half_bits > n]
    assert 17 in walked and 65537 in walked


@pytest.mark.parametrize("n", [2, 3, 17, 100, 1025, 65537])
def test_scalar_equals_vectorised(n):
    perm = Permutation(n, 99, 3)
    idx = np.arange(n) if n <= 2000 else np.random.default_rng(0).integers(0, n, 2000)
    assert [perm(int(i)) for i in idx] == perm.take(idx).tolist()


def test_huge_range_is_computable_per_index():
    """7 billion samples (15T tokens at 2048): no array of that size, same answer both paths."""
    n = 7_000_000_000
    perm = Permutation(n, 5, 2)
    idx = np.array([0, 1, 2, n // 2, n - 2, n - 1], dtype=np.int64)
    out = perm.take(idx)
    assert ((out >= 0) & (out < n)).all() and len(set(out.tolist())) == idx.size
    assert out.tolist() == [perm(int(i)) for i in idx]


def test_differs_across_seeds_and_epochs_and_is_repeatable():
    n = 1000
    base = Permutation(n, 0, 0).take(np.arange(n))
    assert np.array_equal(base, Permutation(n, 0, 0).take(np.arange(n)))
    others = [Permutation(n, 1, 0), Permutation(n, 0, 1), Permutation(n, 2**40, 0),
              Permutation(n, -1, 0)]
    for perm in others:
        out = perm.take(np.arange(n))
        # two independent random permutations agree on ~1 position; demand near-independence
        assert (out == base).sum() < 20
    assert not np.array_equal(base, np.arange(n))


def test_permutation_looks_shuffled():
    """Neighbouring indices land far apart: the order is not a rotation or a stride."""
    n = 10_000
    out = Permutation(n, 7, 0).take(np.arange(n))
    gaps = np.abs(np.diff(out))
    assert np.median(gaps) > n / 10
    # the first tenth of an epoch samples every tenth of the data
    assert len(np.unique(out[: n // 10] * 10 // n)) == 10


def test_out_of_range_index_raises():
    perm = Permutation(10, 0)
    with pytest.raises(IndexError):
        perm(10)
    with pytest.raises(IndexError):
        perm.take(np.array([-1]))
    with pytest.raises(ValueError):
        Permutation(0, 0)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_rank_slices_partition_each_global_batch(dp):
    gbs = 16
    for g in range(5):
        slices = [rank_slice(g, gbs, r, dp) for r in range(dp)]
        assert all(len(s) == gbs // dp for s in slices)
        merged = [p for s in slices for p in s]
        assert merged == list(range(g * gbs, (g + 1) * gbs))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_union_over_ranks_is_the_one_rank_stream(dp):
    gbs, steps = 8, 6
    one_rank = list(itertools.islice(rank_positions(0, gbs, 0, 1), gbs * steps))
    per_rank = [list(itertools.islice(rank_positions(0, gbs, r, dp), gbs // dp * steps))
                for r in range(dp)]
    # interleave per global batch: rank 0's slice, rank 1's slice, ...
    rebuilt = []
    for g in range(steps):
        for r in range(dp):
            rebuilt += per_rank[r][g * gbs // dp:(g + 1) * gbs // dp]
    assert rebuilt == one_rank
    # every rank gets the same count: each sees `steps` slices of GBS/dp
    assert {len(p) for p in per_rank} == {gbs // dp * steps}


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_resume_is_the_tail_of_the_uninterrupted_stream(dp):
    gbs = 8
    for rank in range(dp):
        full = list(itertools.islice(rank_positions(0, gbs, rank, dp), 10 * gbs // dp))
        resumed = list(itertools.islice(rank_positions(3 * gbs, gbs, rank, dp), 7 * gbs // dp))
        assert resumed == full[3 * gbs // dp:]


def test_batch_geometry_is_checked():
    check_batch_geometry(32, 4, 2, consumed_samples=64)
    with pytest.raises(UserError, match="not a multiple of micro batch"):
        check_batch_geometry(30, 4, 2)
    with pytest.raises(UserError, match="consumed_samples 40"):
        check_batch_geometry(32, 4, 2, consumed_samples=40)
    with pytest.raises(UserError, match="positive"):
        check_batch_geometry(32, 0, 2)
    with pytest.raises(UserError, match="rank 2 outside"):
        next(rank_positions(0, 8, 2, 2))


@pytest.mark.parametrize("n,mb,dp", [(10, 2, 2), (1, 4, 4), (16, 2, 4), (17, 3, 2)])
def test_eval_positions_cover_everything_with_equal_counts(n, mb, dp):
    parts = [eval_positions(n, mb, r, dp) for r in range(dp)]
    lengths = {len(p) for p in parts}
    assert len(lengths) == 1 and lengths.pop() % mb == 0
    covered = {q % n for p in parts for q in p}
    assert covered == set(range(n))
    assert sum(len(p) for p in parts) < n + mb * dp  # padding stays under one batch round
