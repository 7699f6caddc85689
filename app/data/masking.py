"""Dynamic MLM masking (BERT's 15%, 80/10/10) as a pure function of (seed, sample position),
vectorised over a micro batch.

A resumed run, a different worker count or a different number of ranks masks every sample exactly
as the uninterrupted run would: each sample's random numbers are SplitMix64 outputs keyed by
(seed, position, stream) (`sample_keys`), computed for the whole micro batch at once with numpy,
never drawn from a worker's global state. Row r of a batch is masked exactly as that sample alone.
(Until 2026-11-22 each sample had its own numpy PCG64 generator: ~40 us a sample to build, the
loader's bottleneck; docs/benchmarks.md, "loader".)

Choices (documented because BERT and RoBERTa leave them open):
- special tokens are never selected: [CLS], [SEP] (= the end-of-document token), [PAD], [MASK],
  [UNK] and any other id in `special_ids`, like Hugging Face's collator; padding beyond `length`
  is never selected either;
- the number selected is exactly floor(p*n + u) of the n candidates with u ~ U[0, 1) (expected
  p*n, lower variance than per-token coin flips), and at least 1 when there is a candidate, so a
  tiny sample never yields a NaN loss; which ones: the candidates with the smallest random keys;
- the 10% random replacements are uniform over the vocabulary minus the special ids.
"""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from app.data.order import GOLDEN, M64, mix64, mix64_np

IGNORE_INDEX = -100  # the label of positions without loss (PyTorch's and Hugging Face's)
TRAIN_STREAM = 0         # separates the random streams of training and eval samples
EVAL_STREAM = 1


def mlm_slots(seq_len: int, mask_prob: float) -> int:
    """The most positions `Masker` selects in a sample of `seq_len` tokens: a fixed width for
    the batch's list of masked positions (`floor(p*n + u) <= floor(p*seq_len) + 1`)."""
    return math.floor(mask_prob * seq_len) + 1


def sample_keys(seed: int, positions, stream: int = TRAIN_STREAM) -> np.ndarray:
    """One 64-bit key per sample (uint64 array): a pure function of (seed, position, stream),
    distinct for distinct positions (a bijection of the position)."""
    base = mix64(mix64(seed & M64) ^ (int(stream) * GOLDEN & M64))
    pos = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    return mix64_np((pos * np.uint64(GOLDEN)) ^ np.uint64(base))


def uniforms(keys: np.ndarray, first: int, count: int) -> np.ndarray:
    """[len(keys), count] floats in [0, 1): outputs first..first+count-1 of each key's SplitMix64
    sequence (53 bits each)."""
    bits = _bits(np.asarray(keys, dtype=np.uint64).reshape(-1, 1),
                 np.arange(first, first + count, dtype=np.uint64))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def _bits(keys: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Output `steps` (0-based, broadcast against `keys`) of SplitMix64 seeded with each key."""
    return mix64_np(keys + (steps + np.uint64(1)) * np.uint64(GOLDEN))


class Masker:
    """Applies MLM masking to one sample; holds the vocabulary facts so each call is cheap."""

    def __init__(self, *, mask_token_id: int, vocab_size: int, special_ids: Iterable[int],
                 mask_prob: float = 0.15, replace_mask: float = 0.8, replace_random: float = 0.1):
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob}")
        if replace_mask < 0 or replace_random < 0 or replace_mask + replace_random > 1:
            raise ValueError("replace_mask + replace_random must be within [0, 1]")
        self.mask_token_id = int(mask_token_id)
        self.vocab_size = int(vocab_size)
        self.mask_prob = float(mask_prob)
        self.replace_mask = float(replace_mask)
        self.replace_random = float(replace_random)
        specials = {int(i) for i in special_ids if i is not None} | {self.mask_token_id}
        self.special_ids = np.array(sorted(i for i in specials if 0 <= i < self.vocab_size),
                                    dtype=np.int64)
        self.num_random = self.vocab_size - self.special_ids.size
        if self.num_random < 1:
            raise ValueError("the vocabulary has no non-special token to draw from")
        self._is_special = np.zeros(self.vocab_size, dtype=bool)  # a lookup beats np.isin 10x
        self._is_special[self.special_ids] = True
        # j-th non-special id = j + #specials s with s - rank(s) <= j (rank = position among them)
        self._skip = self.special_ids - np.arange(self.special_ids.size, dtype=np.int64)

    def random_tokens(self, u: np.ndarray) -> np.ndarray:
        """Uniforms in [0, 1) -> ids uniform over the non-special vocabulary."""
        j = np.minimum((u * self.num_random).astype(np.int64), self.num_random - 1)
        return j + np.searchsorted(self._skip, j, side="right")

    def __call__(self, input_ids: np.ndarray, key: int,
                 length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One sample: (masked input ids, labels) as new int64 arrays; `input_ids` is not
        modified. `key` is the sample's `sample_keys` entry. Only the first `length` positions
        (default: all) are candidates; labels hold the original id at selected positions and
        IGNORE_INDEX elsewhere."""
        ids = np.asarray(input_ids).reshape(1, -1)
        n = ids.shape[1] if length is None else int(length)
        out, labels = self.mask_batch(ids, np.array([n]), np.array([key], dtype=np.uint64))
        return out[0], labels[0]

    def mask_batch(self, input_ids: np.ndarray, lengths: np.ndarray,
                   keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A micro batch at once: `input_ids` [B, S], `lengths` [B] (candidates are the first
        lengths[r] positions of row r), `keys` [B] (`sample_keys`). Returns new int64 arrays
        (masked ids, labels); row r is what `__call__` gives that sample alone.

        Each row's SplitMix64 outputs: 0..S-1 rank the positions (the `count` candidates with
        the smallest are selected), S is the u of the count, S+1+c decides mask/random/keep at a
        selected position c and 2S+1+c draws its random replacement id."""
        ids = np.array(input_ids, dtype=np.int64, copy=True)
        rows, seq = ids.shape
        keys = np.asarray(keys, dtype=np.uint64).reshape(rows)
        candidate = ~np.take(self._is_special, ids, mode="clip")
        candidate &= np.arange(seq) < np.asarray(lengths, dtype=np.int64).reshape(rows, 1)
        n = np.count_nonzero(candidate, axis=1)
        bits = _bits(keys.reshape(rows, 1), np.arange(seq + 1, dtype=np.uint64))
        u = (bits[:, seq] >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
        count = np.where(n > 0, np.maximum(1, np.floor(self.mask_prob * n + u)
                                           .astype(np.int64)), 0)
        labels = np.full_like(ids, IGNORE_INDEX)
        most = int(count.max(initial=0))
        if most == 0:
            return ids, labels
        # the outputs' top 53 bits rank the candidates (distinct: the selected set is unique)
        rank = np.where(candidate, bits[:, :seq] >> np.uint64(11), np.uint64(1 << 53))
        first = np.argpartition(rank, most - 1, axis=1)[:, :most] if most < seq else \
            np.broadcast_to(np.arange(seq), (rows, seq))
        first = np.take_along_axis(first, np.argsort(np.take_along_axis(rank, first, axis=1),
                                                     axis=1), axis=1)
        r, slot = np.nonzero(np.arange(most) < count[:, None])
        c = first[r, slot]
        labels[r, c] = ids[r, c]
        how = self._uniform(keys[r], c + seq + 1)
        masked = how < self.replace_mask
        ids[r[masked], c[masked]] = self.mask_token_id
        swap = ~masked & (how < self.replace_mask + self.replace_random)
        if swap.any():
            ids[r[swap], c[swap]] = self.random_tokens(
                self._uniform(keys[r[swap]], c[swap] + 2 * seq + 1))
        return ids, labels

    @staticmethod
    def _uniform(keys: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Output `steps` of each key's SplitMix64 sequence, as floats in [0, 1) (as `uniforms`)."""
        return (_bits(keys, steps.astype(np.uint64)) >> np.uint64(11)).astype(np.float64) \
            * 2.0 ** -53
