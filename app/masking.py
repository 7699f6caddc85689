"""Dynamic MLM masking (BERT's 15%, 80/10/10) as a pure function of (seed, sample position).

A resumed run, a different worker count or a different number of ranks masks every sample exactly
as the uninterrupted run would: the random numbers come from a generator keyed by
(seed, position, stream), never from a worker's global state.

Choices (documented because BERT and RoBERTa leave them open):
- special tokens are never selected: [CLS], [SEP] (= the end-of-document token), [PAD], [MASK],
  [UNK] and any other id in `special_ids`, like Hugging Face's collator; padding beyond `length`
  is never selected either;
- the number selected is exactly floor(p*n + u) of the n candidates with u ~ U[0, 1) (expected
  p*n, lower variance than per-token coin flips), and at least 1 when there is a candidate, so a
  tiny sample never yields a NaN loss;
- the 10% random replacements are uniform over the vocabulary minus the special ids.
"""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np

IGNORE_INDEX = -100  # the label of positions without loss (PyTorch's and Hugging Face's)
TRAIN_STREAM = 0         # separates the random streams of training and eval samples
EVAL_STREAM = 1


def mlm_slots(seq_len: int, mask_prob: float) -> int:
    """The most positions `Masker` selects in a sample of `seq_len` tokens: a fixed width for
    the batch's list of masked positions (`floor(p*n + u) <= floor(p*seq_len) + 1`)."""
    return math.floor(mask_prob * seq_len) + 1


def sample_rng(seed: int, position: int, stream: int = TRAIN_STREAM) -> np.random.Generator:
    """The generator of one sample: a pure function of (seed, position, stream)."""
    key = np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, int(position), int(stream)])
    return np.random.Generator(np.random.PCG64(key))


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

    def random_tokens(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` ids uniform over the non-special vocabulary."""
        j = rng.integers(0, self.num_random, size=count, dtype=np.int64)
        return j + np.searchsorted(self._skip, j, side="right")

    def __call__(self, input_ids: np.ndarray, rng: np.random.Generator,
                 length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Return (masked input ids, labels) as new int64 arrays; `input_ids` is not modified.

        Only the first `length` positions (default: all) are candidates; labels hold the original
        id at selected positions and IGNORE_INDEX elsewhere.
        """
        ids = np.array(input_ids, dtype=np.int64, copy=True)
        n = ids.size if length is None else int(length)
        candidate = ~np.take(self._is_special, ids, mode="clip")
        candidate[n:] = False
        num_candidates = int(np.count_nonzero(candidate))
        labels = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)
        if num_candidates == 0:
            return ids, labels
        u = rng.random(ids.size + 1)
        count = max(1, int(self.mask_prob * num_candidates + u[-1]))
        # the `count` candidates with the smallest keys: a uniform subset of that size
        keys = np.where(candidate, u[:ids.size], np.inf)
        selected = np.argpartition(keys, count - 1)[:count]
        labels[selected] = ids[selected]
        how = rng.random(count)
        to_mask = selected[how < self.replace_mask]
        to_random = selected[(how >= self.replace_mask)
                             & (how < self.replace_mask + self.replace_random)]
        ids[to_mask] = self.mask_token_id
        if to_random.size:
            ids[to_random] = self.random_tokens(rng, to_random.size)
        return ids, labels
