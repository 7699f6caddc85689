"""MLM masking: rates, 80/10/10, specials, determinism from (seed, position)."""
from __future__ import annotations

import numpy as np
import pytest

from app.data.masking import EVAL_STREAM, IGNORE_INDEX, TRAIN_STREAM, Masker, sample_keys, uniforms

VOCAB = 1000
PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4  # BERT's WordPiece order
SPECIALS = [PAD, UNK, CLS, SEP, MASK]


def make_masker(**kw) -> Masker:
    return Masker(mask_token_id=MASK, vocab_size=VOCAB, special_ids=SPECIALS, **kw)


def bert_like_sample(rng: np.random.Generator, n: int = 512) -> np.ndarray:
    """[CLS] words [SEP] words [SEP] ... [PAD]*: specials spread through a realistic sample."""
    ids = rng.integers(5, VOCAB, size=n)
    ids[0] = CLS
    ids[rng.choice(np.arange(1, n - 40), size=8, replace=False)] = SEP
    ids[-30:] = PAD
    return ids


def test_rates_are_15_percent_and_80_10_10():
    masker = make_masker()
    data_rng = np.random.default_rng(0)
    selected = candidates = to_mask = to_random = unchanged = 0
    for position in range(300):
        ids = bert_like_sample(data_rng)
        out, labels = masker(ids, sample_keys(42, [position])[0])
        sel = labels != IGNORE_INDEX
        assert np.array_equal(labels[sel], ids[sel])
        candidates += int((~np.isin(ids, SPECIALS)).sum())
        selected += int(sel.sum())
        to_mask += int((out[sel] == MASK).sum())
        same = out[sel] == ids[sel]
        unchanged += int(same.sum())
        to_random += int(((out[sel] != MASK) & ~same).sum())
    assert selected / candidates == pytest.approx(0.15, abs=0.003)
    assert to_mask / selected == pytest.approx(0.8, abs=0.015)
    # a random draw equals the original 1 time in ~1000: both shares stay ~10%
    assert to_random / selected == pytest.approx(0.1, abs=0.012)
    assert unchanged / selected == pytest.approx(0.1, abs=0.012)


def test_unselected_positions_untouched_and_specials_never_selected_or_drawn():
    masker = make_masker(mask_prob=0.5)
    data_rng = np.random.default_rng(1)
    for position in range(200):
        ids = bert_like_sample(data_rng, 128)
        out, labels = masker(ids, sample_keys(0, [position])[0])
        sel = labels != IGNORE_INDEX
        assert np.array_equal(out[~sel], ids[~sel])
        assert not np.isin(ids[sel], SPECIALS).any()
        randoms = out[sel & (out != MASK) & (out != ids)]
        assert not np.isin(randoms, SPECIALS).any()
        assert ((randoms >= 0) & (randoms < VOCAB)).all()


def test_random_tokens_cover_the_whole_non_special_vocabulary():
    masker = Masker(mask_token_id=7, vocab_size=20, special_ids=[0, 3, 19])
    drawn = masker.random_tokens(np.random.default_rng(0).random(20_000))
    assert set(drawn.tolist()) == set(range(20)) - {0, 3, 7, 19}
    counts = np.bincount(drawn, minlength=20)[[i for i in range(20) if i not in (0, 3, 7, 19)]]
    assert counts.min() > 0.8 * counts.mean()


def test_same_seed_and_position_give_the_same_masks():
    masker = make_masker()
    ids = bert_like_sample(np.random.default_rng(2))
    a = masker(ids, sample_keys(5, [1234])[0])
    b = masker(ids.copy(), sample_keys(5, [1234])[0])
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    # another position, seed or stream: other masks
    others = (sample_keys(5, [1235]), sample_keys(6, [1234]), sample_keys(5, [1234], EVAL_STREAM))
    for (key,) in others:
        c = masker(ids, key)
        assert not np.array_equal(a[1], c[1])
    assert TRAIN_STREAM != EVAL_STREAM


def test_input_is_not_modified():
    masker = make_masker()
    ids = bert_like_sample(np.random.default_rng(3))
    before = ids.copy()
    masker(ids, sample_keys(0, [0])[0])
    assert np.array_equal(ids, before)


def test_padding_beyond_length_never_selected():
    masker = make_masker(mask_prob=0.9)
    ids = np.arange(10, 74)  # no special ids at all
    out, labels = masker(ids, sample_keys(0, [0])[0], length=20)
    assert (labels[20:] == IGNORE_INDEX).all()
    assert np.array_equal(out[20:], ids[20:])
    assert (labels[:20] != IGNORE_INDEX).sum() >= 17


def test_tiny_sample_gets_at_least_one_masked_token():
    masker = make_masker()
    for position in range(50):
        ids = np.array([CLS, 17, SEP, PAD, PAD])
        out, labels = masker(ids, sample_keys(0, [position])[0])
        assert labels.tolist() == [IGNORE_INDEX, 17, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]


def test_sample_of_only_specials_has_no_labels():
    out, labels = make_masker()(np.array([CLS, SEP, PAD]), sample_keys(0, [0])[0])
    assert (labels == IGNORE_INDEX).all() and out.tolist() == [CLS, SEP, PAD]


def test_bad_settings_raise():
    with pytest.raises(ValueError):
        make_masker(mask_prob=0.0)
    with pytest.raises(ValueError):
        make_masker(replace_mask=0.9, replace_random=0.2)
    with pytest.raises(ValueError):
        Masker(mask_token_id=0, vocab_size=2, special_ids=[1])


def test_a_batch_masks_each_row_as_that_sample_alone():
    """The loader masks a micro batch at once: which other samples share the batch (micro batch
    size, ranks, workers) must not change a sample's masks."""
    masker = make_masker()
    rng = np.random.default_rng(3)
    ids = np.stack([bert_like_sample(rng) for _ in range(6)])
    lengths = np.array([ids.shape[1], 1, 40, ids.shape[1], 0, 77])
    positions = np.array([0, 7, 8, 1 << 40, 3, 12345])
    keys = sample_keys(9, positions)
    out, labels = masker.mask_batch(ids, lengths, keys)
    for r in range(len(ids)):
        alone = masker(ids[r], sample_keys(9, [positions[r]])[0], length=lengths[r])
        assert np.array_equal(out[r], alone[0]) and np.array_equal(labels[r], alone[1]), r
    # reversed order, other batch: the same rows
    back = masker.mask_batch(ids[::-1], lengths[::-1], keys[::-1])
    assert np.array_equal(back[1][::-1], labels)
    assert (labels[4] == IGNORE_INDEX).all() and (labels[1, 1:] == IGNORE_INDEX).all()


def test_sample_keys_and_their_uniforms():
    keys = sample_keys(1, np.arange(5000))
    assert np.unique(keys).size == 5000  # a bijection of the position
    assert not np.array_equal(sample_keys(1, [5]), sample_keys(2, [5]))
    u = uniforms(keys, 0, 64)
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    # neighbouring positions and neighbouring draws are not correlated
    assert abs(np.corrcoef(u[:-1, 0], u[1:, 0])[0, 1]) < 0.05
    assert abs(np.corrcoef(u[:, 0], u[:, 1])[0, 1]) < 0.05
    assert np.array_equal(uniforms(keys[:3], 10, 4), u[:3, 10:14])
