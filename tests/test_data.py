"""TokenWindows and the train/eval loaders over real .bin/.idx shards and dataset.json."""
from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from app.data.loader import (
    BatchLayout,
    DataSpec,
    TokenWindows,
    build_eval_loader,
    build_train_loader,
    dataset_stats,
    default_num_workers,
)
from app.data.masking import IGNORE_INDEX
from app.data.order import Permutation
from data_tools.errors import UserError
from data_tools.indexed import ShardWriter, token_dtype
from data_tools.manifest import FORMAT, FORMAT_VERSION, file_checksum, load_manifest, write_manifest
from tests.helpers import script_ranks

VOCAB = 500
PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
SPECIALS = {PAD, UNK, CLS, SEP, MASK}


def write_dataset(root: Path, splits: dict[str, list[list[list[int]]]], *,
                  mask_token_id: int | None = MASK, cls_token_id: int | None = CLS) -> Path:
    """A dataset dir as prepare writes it: shards per split (lists of documents) + dataset.json."""
    root.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(VOCAB)
    manifest_splits = {}
    for split, shards in splits.items():
        entries = []
        for i, docs in enumerate(shards):
            name = f"{split}_{i:05d}"
            w = ShardWriter(root / name, dtype)
            for doc in docs:
                w.add_document(doc)
            w.finalize(fsync=False)
            entries.append({"name": name, "documents": len(docs), "tokens": w.num_tokens,
                            "bin_bytes": (root / f"{name}.bin").stat().st_size,
                            "idx_bytes": (root / f"{name}.idx").stat().st_size,
                            "bin_checksum": file_checksum(root / f"{name}.bin"),
                            "idx_checksum": file_checksum(root / f"{name}.idx")})
        manifest_splits[split] = {"documents": sum(e["documents"] for e in entries),
                                  "tokens": sum(e["tokens"] for e in entries), "shards": entries}
    write_manifest(root, {
        "format": FORMAT, "format_version": FORMAT_VERSION, "dtype": str(dtype),
        "vocab_size": VOCAB, "eod_token_id": SEP, "pad_token_id": PAD,
        "mask_token_id": mask_token_id, "cls_token_id": cls_token_id,
        "tokenizer": {"dir": "tokenizer", "fingerprint": "xxh3_128:0", "files": []},
        "checksum_algorithm": "xxh3_128", "splits": manifest_splits,
        "fingerprint": "xxh3_128:test"})
    return root


def random_docs(rng: np.random.Generator, count: int, low: int, high: int) -> list[list[int]]:
    """Documents of words (ids >= 5), each ending with the end-of-document token [SEP]."""
    return [rng.integers(5, VOCAB, size=int(rng.integers(low, high))).tolist() + [SEP]
            for _ in range(count)]


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> tuple[Path, list[list[list[int]]]]:
    """Three train shards, one smaller than a window (so windows straddle shards), a val split."""
    rng = np.random.default_rng(0)
    train = [random_docs(rng, 20, 3, 40), random_docs(rng, 1, 4, 5), random_docs(rng, 15, 3, 60)]
    val = [random_docs(rng, 6, 3, 30)]
    root = write_dataset(tmp_path_factory.mktemp("data") / "ds", {"train": train, "val": val})
    return root, train


def flat_tokens(shards: list[list[list[int]]]) -> np.ndarray:
    return np.array([t for docs in shards for d in docs for t in d], dtype=np.int64)


def spec(root: Path, **kw) -> DataSpec:
    args = {"dataset_dir": root, "split": "train", "seq_len": 16, "objective": "clm", "seed": 3}
    args.update(kw)
    return DataSpec(**args)


def originals(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The unmasked token ids of an MLM batch (or sample), from full-length labels or from the
    loader's masked positions and their labels."""
    labels = batch["labels"] if "labels" in batch else full_labels(batch)
    return torch.where(labels != IGNORE_INDEX, labels, batch["input_ids"])


def full_labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """An MLM batch's labels over every position (IGNORE_INDEX where nothing is masked)."""
    full = torch.full_like(batch["input_ids"], IGNORE_INDEX)
    for row, pos, labels in zip(full, batch["mlm_positions"], batch["mlm_labels"]):
        keep = labels != IGNORE_INDEX
        row[pos[keep]] = labels[keep]
    return full


def in_layout(s: DataSpec, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """TokenWindows samples as the loader hands them to the model (app.data.loader.BatchLayout)."""
    layout = BatchLayout.of(s)
    return layout.unpack(layout.pack(samples))


def take_batches(loader, count: int) -> list[dict[str, torch.Tensor]]:
    return list(itertools.islice(iter(loader), count))


# -- samples ------------------------------------------------------------------------------------


def test_concat_epoch_reads_every_window_once_across_shards(small_dataset):
    root, train = small_dataset
    ds = TokenWindows(spec(root))
    stream = flat_tokens(train)
    assert len(ds) == ds.num_samples == stream.size // 16
    seen = []
    for p in range(len(ds)):
        item = ds[p]
        w = ds.sample_index(p)
        seen.append(w)
        assert item["input_ids"].dtype == torch.int64
        assert item["input_ids"].tolist() == stream[w * 16:(w + 1) * 16].tolist()
        assert torch.equal(item["labels"], item["input_ids"])  # CLM: the model shifts
        assert item["attention_mask"].tolist() == [1] * 16
    assert sorted(seen) == list(range(len(ds)))
    assert seen != sorted(seen)  # shuffled


@pytest.mark.parametrize("packing", ["concat", "doc"])
def test_a_shard_cut_short_after_open_is_an_error_not_a_bus_error(tmp_path, packing):
    """Before: the read of a memory-mapped page past the file's new end was a SIGBUS (this
    process would die here). Each read asks the mapped file's size first: the batch becomes its
    one-line error (raised by the loader in the training process) naming the shard."""
    rng = np.random.default_rng(1)
    root = write_dataset(tmp_path / "ds", {"train": [random_docs(rng, 40, 3, 40)]})
    ds = TokenWindows(spec(root, packing=packing))
    assert "error" not in ds.batch(list(range(len(ds))))  # every page mapped and read once
    shard = root / "train_00000.bin"
    os.truncate(shard, 16)
    batch = ds.batch(list(range(len(ds))))
    assert f"{shard}: 16 bytes now" in batch["error"]
    assert "truncated under the running job" in batch["error"]
    with pytest.raises(UserError, match="truncated under the running job"):
        BatchLayout.of(ds.spec).unpack(batch["error"])


def test_epoch_crossing_uses_the_next_epochs_permutation(small_dataset):
    root, _ = small_dataset
    ds = TokenWindows(spec(root))
    n = len(ds)
    epoch1 = [ds.sample_index(n + k) for k in range(n)]
    assert epoch1 == Permutation(n, 3, 1).take(np.arange(n)).tolist()
    assert epoch1 != [ds.sample_index(k) for k in range(n)]
    assert ds.sample_index(5 * n + 2) == Permutation(n, 3, 5)(2)


def test_mlm_concat_masks_are_a_function_of_seed_and_position(small_dataset):
    root, train = small_dataset
    a = TokenWindows(spec(root, objective="mlm"))
    b = TokenWindows(spec(root, objective="mlm"))
    stream = flat_tokens(train)
    n = len(a)
    for p in [0, 1, n - 1, n, 3 * n + 1]:
        x, y = a[p], b[p]
        assert all(torch.equal(x[k], y[k]) for k in x)
        w = a.sample_index(p)
        original = stream[w * 16:(w + 1) * 16]
        sel = (x["labels"] != IGNORE_INDEX).numpy()
        assert sel.any()
        assert np.array_equal(x["labels"].numpy()[sel], original[sel])
        assert np.array_equal(x["input_ids"].numpy()[~sel], original[~sel])
        assert not np.isin(original[sel], list(SPECIALS)).any()
    # the same window in another epoch is masked afresh (dynamic masking)
    k = next(k for k in range(n) if a.sample_index(n + k) == a.sample_index(0))
    assert not torch.equal(a[0]["labels"], a[n + k]["labels"])
    # another seed: another order or other masks
    c = TokenWindows(spec(root, objective="mlm", seed=4))
    assert any(not torch.equal(a[p]["labels"], c[p]["labels"]) for p in range(4))


def test_doc_packing_clm_truncates_and_pads(small_dataset):
    root, train = small_dataset
    ds = TokenWindows(spec(root, packing="doc", seq_len=24))
    docs = [d for shard in train for d in shard]
    assert len(ds) == len(docs)
    for p in range(len(ds)):
        item = ds[p]
        doc = docs[ds.sample_index(p)]
        n = min(len(doc), 24)
        assert item["input_ids"][:n].tolist() == doc[:n]
        assert item["input_ids"][n:].tolist() == [PAD] * (24 - n)
        assert item["attention_mask"].tolist() == [1] * n + [0] * (24 - n)
        assert item["labels"].tolist() == doc[:n] + [IGNORE_INDEX] * (24 - n)


def test_doc_packing_mlm_is_bert_layout(small_dataset):
    root, train = small_dataset
    ds = TokenWindows(spec(root, packing="doc", seq_len=24, objective="mlm"))
    docs = [d for shard in train for d in shard]
    truncated = 0
    for p in range(len(ds)):
        item = ds[p]
        doc = docs[ds.sample_index(p)]
        n = min(len(doc) + 1, 24)
        mask = item["attention_mask"].tolist()
        assert mask == [1] * n + [0] * (24 - n)
        labels = item["labels"].numpy()
        ids = item["input_ids"].numpy()
        sel = labels != IGNORE_INDEX
        assert sel[:n].any() and not sel[n:].any() and not sel[0] and not sel[n - 1]
        original = ids.copy()
        original[sel] = labels[sel]
        expected = [CLS] + doc[:n - 1]
        if len(doc) + 1 > 24:
            expected[-1] = SEP  # a truncated document still ends with [SEP]
            truncated += 1
        assert original[:n].tolist() == expected
        assert ids[n:].tolist() == [PAD] * (24 - n)
    assert truncated > 0


def test_doc_packing_does_not_double_cls(tmp_path):
    root = write_dataset(tmp_path / "ds", {"train": [[[CLS, 10, 11, SEP], [12, SEP]]]})
    ds = TokenWindows(spec(root, packing="doc", seq_len=6, objective="mlm"))
    rows = {}
    for p in range(2):
        item = ds[p]
        ids, labels = item["input_ids"].numpy(), item["labels"].numpy()
        ids = np.where(labels != IGNORE_INDEX, labels, ids)
        rows[ds.sample_index(p)] = ids.tolist()
    assert rows == {0: [CLS, 10, 11, SEP, PAD, PAD], 1: [CLS, 12, SEP, PAD, PAD, PAD]}


# -- loaders ------------------------------------------------------------------------------------


def test_train_loader_batches_are_this_ranks_slices(small_dataset):
    root, _ = small_dataset
    s = spec(root, objective="mlm")
    ds = TokenWindows(s)
    loader = build_train_loader(s, micro_batch=2, global_batch=8, dp_rank=1, dp_size=2,
                                consumed_samples=0, num_workers=0)
    batches = take_batches(loader, 6)
    for i, batch in enumerate(batches):
        g, m = divmod(i, 2)  # 2 micro batches per rank per global batch
        positions = [g * 8 + 4 + m * 2, g * 8 + 4 + m * 2 + 1]
        expected = in_layout(s, [ds[p] for p in positions])
        assert batch.keys() == expected.keys() == {"input_ids", "mlm_positions", "mlm_labels"}
        for key in expected:
            assert torch.equal(batch[key], expected[key])


@pytest.mark.parametrize("dp", [2, 4])
def test_ranks_together_read_the_one_rank_stream(small_dataset, dp):
    root, _ = small_dataset
    s = spec(root, objective="mlm")
    gbs, mb, steps = 8, 2, 5  # 40 samples: crosses the epoch boundary (34 windows)
    one = take_batches(build_train_loader(s, micro_batch=mb, global_batch=gbs, dp_rank=0,
                                          dp_size=1, consumed_samples=0, num_workers=0),
                       steps * gbs // mb)
    one_ids = torch.cat([b["input_ids"] for b in one]).reshape(steps, gbs, -1)
    per_rank = []
    for r in range(dp):
        batches = take_batches(build_train_loader(s, micro_batch=mb, global_batch=gbs,
                                                  dp_rank=r, dp_size=dp, consumed_samples=0,
                                                  num_workers=0), steps * gbs // (mb * dp))
        per_rank.append(torch.cat([b["input_ids"] for b in batches]).reshape(steps, gbs // dp, -1))
    assert torch.equal(torch.cat(per_rank, dim=1), one_ids)


def test_resume_gives_the_tail_of_the_stream_with_any_worker_count(small_dataset):
    root, _ = small_dataset
    s = spec(root, objective="mlm")
    kw = {"micro_batch": 2, "global_batch": 4, "dp_rank": 0, "dp_size": 2}
    full = take_batches(build_train_loader(s, consumed_samples=0, num_workers=0, **kw), 12)
    resumed = take_batches(build_train_loader(s, consumed_samples=4 * 5, num_workers=2, **kw), 7)
    assert len(resumed) == 7
    for a, b in zip(full[5:], resumed):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_train_loader_crosses_epochs_seamlessly(small_dataset):
    root, _ = small_dataset
    s = spec(root)  # CLM: ids identify windows
    ds = TokenWindows(s)
    n = len(ds)  # 34: not a multiple of the global batch 4, so a batch spans the boundary
    loader = build_train_loader(s, micro_batch=4, global_batch=4, dp_rank=0, dp_size=1,
                                consumed_samples=0, num_workers=0)
    rows = torch.cat([b["input_ids"] for b in take_batches(loader, (2 * n) // 4 + 1)])
    windows = {tuple(ds[p]["input_ids"].tolist()): ds.sample_index(p) for p in range(n)}
    order = [windows[tuple(r.tolist())] for r in rows]
    assert sorted(order[:n]) == list(range(n)) and sorted(order[n:2 * n]) == list(range(n))
    assert order[n:2 * n] != order[:n]


def test_eval_loader_is_fixed_and_equal_across_ranks(small_dataset):
    root, _ = small_dataset
    s = spec(root, split="val", objective="mlm", seq_len=8)
    n = TokenWindows(s, eval_order=True).num_samples
    loaders = [build_eval_loader(s, micro_batch=3, dp_rank=r, dp_size=2, max_samples=None,
                                 num_workers=0) for r in range(2)]
    passes = [list(loader) for loader in loaders]
    assert len(passes[0]) == len(passes[1]) == -(-n // 6)
    again = list(loaders[0])
    for a, b in zip(passes[0], again):
        assert all(torch.equal(a[k], b[k]) for k in a)
    labelled = [tuple(r.tolist()) for p in passes for b in p
                for r, labels in zip(originals(b), b["mlm_labels"]) if (labels != -100).any()]
    assert len(labelled) == len(set(labelled)) == n  # every sample exactly once; filler unlabelled
    few = list(build_eval_loader(s, micro_batch=2, dp_rank=0, dp_size=1, max_samples=3,
                                 num_workers=0))
    assert [len(b["input_ids"]) for b in few] == [2, 2]
    assert torch.equal(few[1]["input_ids"][1], few[0]["input_ids"][0])  # filler: the start again,
    assert (few[1]["mlm_labels"][1] == -100).all()  # without labels: counted once


def test_stats_and_default_workers(small_dataset):
    root, train = small_dataset
    stats = dataset_stats(spec(root))
    total = flat_tokens(train).size
    assert stats["tokens"] == total and stats["num_samples"] == total // 16
    assert stats["dropped_tail_tokens"] == total % 16 and stats["shards"] == 3
    assert stats["documents"] == 36
    assert 0 <= default_num_workers() <= 2 and default_num_workers(10_000) == 0


# -- errors -------------------------------------------------------------------------------------


def test_too_small_split_names_dir_split_tokens_and_seq_len(small_dataset):
    root, _ = small_dataset
    with pytest.raises(UserError) as e:
        TokenWindows(spec(root, split="val", seq_len=100_000))
    msg = str(e.value)
    assert str(root) in msg and "'val'" in msg and "100000" in msg
    tokens = load_manifest(root)["splits"]["val"]["tokens"]
    assert f"{tokens} tokens" in msg


def test_bad_inputs_raise_user_errors(small_dataset, tmp_path):
    root, _ = small_dataset
    with pytest.raises(UserError, match="no split 'test'"):
        TokenWindows(spec(root, split="test"))
    with pytest.raises(UserError, match="objective"):
        spec(root, objective="t5")
    with pytest.raises(UserError, match="packing"):
        spec(root, packing="sentences")
    with pytest.raises(UserError, match="seq_len"):
        spec(root, seq_len=1)
    with pytest.raises(UserError, match="no such dataset"):
        TokenWindows(spec(tmp_path / "missing"))
    no_mask = write_dataset(tmp_path / "gpt", {"train": [[[7, 8, 9, SEP]]]}, mask_token_id=None)
    with pytest.raises(UserError, match="mask_token_id"):
        TokenWindows(spec(no_mask, objective="mlm", seq_len=2))
    with pytest.raises(UserError, match="consumed_samples 6"):
        build_train_loader(spec(root), micro_batch=2, global_batch=4, dp_rank=0, dp_size=1,
                           consumed_samples=6, num_workers=0)
    with pytest.raises(UserError, match="rank 2 outside"):
        build_train_loader(spec(root), micro_batch=2, global_batch=4, dp_rank=2, dp_size=2,
                           consumed_samples=0, num_workers=0)
    with open(no_mask / "train_00000.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(UserError, match="train_00000.bin: 10 bytes, .*dataset.json says 8"):
        TokenWindows(spec(no_mask, seq_len=2))
    (no_mask / "train_00000.idx").unlink()
    with pytest.raises(UserError, match="train_00000.idx: missing"):
        TokenWindows(spec(no_mask, seq_len=2))


# -- real datasets (data_tools prepare over stdlib sources, real tokenizers) ---------------------


def real_specials(dataset_dir: Path) -> set[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(dataset_dir / "tokenizer" / "tokenizer.json"))
    return {i for i, t in tok.get_added_tokens_decoder().items() if t.special}


def test_mlm_loader_over_a_prepared_dataset_trains_a_real_bert(mlm_dataset):
    from transformers import BertConfig

    from app.models.heads import SparseHeadBertForMaskedLM

    manifest = load_manifest(mlm_dataset)
    s = DataSpec(mlm_dataset, "train", 64, "mlm", seed=1)
    specials = real_specials(mlm_dataset)
    assert manifest["mask_token_id"] in specials and manifest["eod_token_id"] in specials
    loader = build_train_loader(s, micro_batch=8, global_batch=16, dp_rank=0, dp_size=1,
                                consumed_samples=0, num_workers=0)
    batches = take_batches(loader, 25)
    ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([full_labels(b) for b in batches])
    sel = labels != IGNORE_INDEX
    original = originals({"input_ids": ids, "labels": labels})
    candidates = ~torch.isin(original, torch.tensor(sorted(specials)))
    assert not (sel & ~candidates).any()  # [SEP], [UNK], ... never selected
    assert sel.sum() / candidates.sum() == pytest.approx(0.15, abs=0.01)
    assert (ids[sel] == manifest["mask_token_id"]).float().mean() == pytest.approx(0.8, abs=0.04)
    assert int(ids.max()) < manifest["vocab_size"]
    config = BertConfig(vocab_size=manifest["vocab_size"], hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    loss = SparseHeadBertForMaskedLM(config)(**batches[0]).loss  # a BertForMaskedLM
    assert torch.isfinite(loss) and loss.item() == pytest.approx(np.log(config.vocab_size), rel=0.2)


def test_doc_packing_over_a_prepared_dataset(mlm_dataset):
    manifest = load_manifest(mlm_dataset)
    ds = TokenWindows(DataSpec(mlm_dataset, "val", 128, "mlm", packing="doc"))
    assert len(ds) == manifest["splits"]["val"]["documents"]
    for p in range(min(len(ds), 20)):
        item = ds[p]
        n = int(item["attention_mask"].sum())
        ids = originals(item)
        assert ids[0] == manifest["cls_token_id"] and ids[n - 1] == manifest["eod_token_id"]
        assert (ids[n:] == manifest["pad_token_id"]).all()


def test_clm_loader_over_a_prepared_dataset_trains_a_real_gpt(clm_dataset):
    from transformers import GPT2Config, GPT2LMHeadModel

    manifest = load_manifest(clm_dataset)
    s = DataSpec(clm_dataset, "train", 64, "clm", seed=1)
    assert dataset_stats(s)["num_samples"] == manifest["splits"]["train"]["tokens"] // 64
    loader = build_train_loader(s, micro_batch=4, global_batch=8, dp_rank=1, dp_size=2,
                                consumed_samples=8, num_workers=1)
    batches = take_batches(loader, 10)
    ds = TokenWindows(s)
    stream = np.concatenate([shard.tokens for shard in ds.shards])
    for i, row in enumerate(torch.cat([b["input_ids"] for b in batches])):
        g, k = divmod(i, 4)  # rank 1 of 2 reads positions 4..7 of each global batch of 8
        w = ds.sample_index(8 + g * 8 + 4 + k)
        assert row.tolist() == stream[w * 64:(w + 1) * 64].tolist()
    for b in batches:  # concat packing: every token attended, so no mask is handed over
        assert torch.equal(b["labels"], b["input_ids"]) and "attention_mask" not in b
    config = GPT2Config(vocab_size=manifest["vocab_size"], n_embd=32, n_layer=1, n_head=2,
                        n_positions=64)
    loss = GPT2LMHeadModel(config)(**batches[0]).loss
    assert torch.isfinite(loss)
    eval_batches = list(build_eval_loader(DataSpec(clm_dataset, "val", 64, "clm"), micro_batch=4,
                                          dp_rank=0, dp_size=2, max_samples=10, num_workers=0))
    assert len(eval_batches) == 2


RANK_SCRIPT = '''
import os, sys, itertools, torch
sys.path.insert(0, {repo!r})
from app.data.loader import DataSpec, build_train_loader
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
spec = DataSpec({data!r}, "train", 16, "mlm", seed=3)
loader = build_train_loader(spec, micro_batch=2, global_batch=8, dp_rank=rank, dp_size=world,
                            consumed_samples=16, num_workers=1)
batches = list(itertools.islice(iter(loader), 10))
torch.save(batches, os.path.join({out!r}, f"rank{{rank}}.pt"))
# the loader's worker told to stop now; left to interpreter exit, multiprocessing SIGTERMs it and
# the rank waits out its WORKER_TERM_GRACE_S (30 s, app/data/loader.py) before it can exit
del loader
'''


@pytest.mark.multirank
def test_two_ranks_read_their_slices_of_the_one_rank_stream(small_dataset, tmp_path):
    """Two real rank processes (each with a loader worker; forked with the environment DeepSpeed's
    launcher gives its ranks: the slices are the subject, not the launcher) together read the
    1-rank stream."""
    root, _ = small_dataset
    repo = str(Path(__file__).resolve().parent.parent)
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT.format(repo=repo, data=str(root), out=str(tmp_path)))
    script_ranks(script, repo)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    one = take_batches(build_train_loader(spec(root, objective="mlm"), micro_batch=2,
                                          global_batch=8, dp_rank=0, dp_size=1,
                                          consumed_samples=16, num_workers=0), 20)
    for g in range(5):  # global batch g: rank 0's 2 micro batches, then rank 1's
        expected = one[4 * g:4 * g + 4]
        got = ranks[0][2 * g:2 * g + 2] + ranks[1][2 * g:2 * g + 2]
        for a, b in zip(expected, got):
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_loaders_leave_the_global_torch_rng_alone(small_dataset):
    """Dropout draws from the global RNG: starting or iterating a loader must not move it."""
    root, _ = small_dataset
    before = torch.get_rng_state()
    for workers in (0, 1):
        loader = build_train_loader(spec(root, objective="mlm"), micro_batch=2, global_batch=2,
                                    dp_rank=0, dp_size=1, consumed_samples=0,
                                    num_workers=workers)
        take_batches(loader, 3)
        list(build_eval_loader(spec(root, split="val", seq_len=8, objective="mlm"),
                               micro_batch=2, dp_rank=0, dp_size=1, max_samples=4,
                               num_workers=workers))
    assert torch.equal(torch.get_rng_state(), before)


def test_sentence_split_shards_from_deepspeeds_builder(tmp_path):
    """Megatron/DeepSpeed datasets may store a document as several sequences (one per sentence):
    doc packing follows doc_idx, concat reads the same token stream."""
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import (
        MMapIndexedDatasetBuilder,
    )

    rng = np.random.default_rng(5)
    docs = [[rng.integers(5, VOCAB, size=int(rng.integers(1, 6))).tolist() for _ in range(k)]
            for k in (1, 3, 2, 4)]
    docs[-1][-1].append(SEP)
    root = write_dataset(tmp_path / "ds", {"train": [[[7, SEP]]]})  # manifest + tokenizer fields
    builder = MMapIndexedDatasetBuilder(str(root / "train_00000.bin"), dtype=np.uint16)
    for doc in docs:
        for sentence in doc:
            builder.add_item_numpy(np.array(sentence, dtype=np.uint16))
        builder.end_document()
    builder.finalize(str(root / "train_00000.idx"))
    manifest = load_manifest(root)
    shard = manifest["splits"]["train"]["shards"][0]
    shard["bin_bytes"] = (root / "train_00000.bin").stat().st_size
    write_manifest(root, manifest)

    whole = [[t for s in doc for t in s] for doc in docs]
    ds = TokenWindows(spec(root, packing="doc", seq_len=32))
    assert len(ds) == 4
    got = {ds.sample_index(p): ds[p]["input_ids"][:len(whole[ds.sample_index(p)])].tolist()
           for p in range(4)}
    assert got == dict(enumerate(whole))
    stream = [t for doc in whole for t in doc]
    concat = TokenWindows(spec(root, seq_len=4))
    assert sorted(tuple(concat[p]["input_ids"].tolist()) for p in range(len(concat))) == sorted(
        tuple(stream[i:i + 4]) for i in range(0, len(stream) - 3, 4))


def test_packed_hand_off_gives_int64_batches_on_both_paths(mlm_dataset):
    # CPU path: workers hand over an int32 numpy array; the pinning path: an int64 tensor.
    s = DataSpec(mlm_dataset, "train", 64, "mlm", seed=3)
    layout = BatchLayout.of(s)
    ds = TokenWindows(s)
    samples = [ds[i] for i in range(4)]
    a, b = layout.unpack(layout.pack(samples)), layout.unpack(layout.pack_pinned(samples))
    for key in layout.keys:
        assert a[key].dtype == b[key].dtype == torch.int64 and a[key].is_contiguous()
        assert torch.equal(a[key], b[key])
    assert torch.equal(a["input_ids"], torch.stack([x["input_ids"] for x in samples]))
    assert torch.equal(full_labels(a), torch.stack([x["labels"] for x in samples]))
    assert (a["mlm_labels"] == -100).any()  # padded to a fixed width
