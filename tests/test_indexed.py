"""The Megatron MMIDIDX writer and reader: round trips, both dtype-code conventions, DeepSpeed's own
reader, and the structural checks that catch truncated or mismatched files."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from data_tools.indexed import (
    HEADER_BYTES,
    MAGIC,
    FormatError,
    IndexedShard,
    ShardWriter,
    bin_path,
    idx_path,
    token_dtype,
)


def _docs(seed: int, n: int, high: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=int(rng.integers(0, 50))) for _ in range(n)]


def _write(prefix, docs, dtype, convention="deepspeed") -> ShardWriter:
    w = ShardWriter(prefix, dtype, code_convention=convention)
    for d in docs:
        w.add_document(d)
    w.finalize(fsync=False)
    return w


@pytest.mark.parametrize("dtype,high", [(np.uint16, 65_000), (np.int32, 2_000_000)])
@pytest.mark.parametrize("convention", ["deepspeed", "megatron"])
def test_round_trip(tmp_path, dtype, high, convention):
    docs = _docs(0, 40, high) + [np.zeros(0, dtype=np.int64)]  # an empty document too
    w = _write(tmp_path / "s", docs, dtype, convention)
    shard = IndexedShard(tmp_path / "s")
    shard.check_consistency()
    assert shard.dtype == np.dtype(dtype)
    assert len(shard) == len(docs) == w.num_documents
    assert shard.num_tokens == sum(d.size for d in docs) == w.num_tokens
    for got, want in zip((shard[i] for i in range(len(shard))), docs):
        np.testing.assert_array_equal(got, want)
    assert shard.doc_idx.tolist() == list(range(len(docs) + 1))
    assert bin_path(tmp_path / "s").stat().st_size == shard.num_tokens * np.dtype(dtype).itemsize


def test_header_bytes_follow_megatron(tmp_path):
    _write(tmp_path / "s", [np.array([1, 2, 3]), np.array([4])], np.uint16, "megatron")
    raw = idx_path(tmp_path / "s").read_bytes()
    assert raw[:9] == MAGIC
    version, code, n, d = struct.unpack_from("<QBQQ", raw, 9)
    assert (version, code, n, d) == (1, 8, 2, 3)
    assert np.frombuffer(raw, np.int32, 2, HEADER_BYTES).tolist() == [3, 1]
    assert np.frombuffer(raw, np.int64, 2, HEADER_BYTES + 8).tolist() == [0, 6]


def test_documents_in_pieces_equal_whole_documents(tmp_path):
    docs = _docs(1, 10, 1000)
    _write(tmp_path / "whole", docs, np.uint16)
    w = ShardWriter(tmp_path / "pieces", np.uint16)
    for d in docs:
        for piece in np.array_split(d, 3):
            w.add_tokens(piece)
        w.end_document()
    w.finalize(fsync=False)
    for ext in (bin_path, idx_path):
        assert ext(tmp_path / "whole").read_bytes() == ext(tmp_path / "pieces").read_bytes()


def test_finalize_inside_a_document_is_refused(tmp_path):
    w = ShardWriter(tmp_path / "s", np.uint16)
    w.add_tokens([1, 2])
    with pytest.raises(ValueError, match="end_document"):
        w.finalize(fsync=False)


def test_abort_removes_the_files(tmp_path):
    w = ShardWriter(tmp_path / "s", np.uint16)
    w.add_document([1, 2, 3])
    w.abort()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype,high", [(np.uint16, 65_000), (np.int32, 2_000_000)])
def test_deepspeed_reads_our_shards(tmp_path, dtype, high):
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

    docs = _docs(2, 30, high)
    _write(tmp_path / "s", docs, dtype)
    ds = MMapIndexedDataset(str(tmp_path / "s"), skip_warmup=True)
    assert len(ds) == len(docs)
    for i, want in enumerate(docs):
        got = ds[i]
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, want)


def test_token_dtype_follows_megatron():
    assert token_dtype(30_522) == np.uint16
    assert token_dtype(65_499) == np.uint16
    assert token_dtype(65_500) == np.int32
    assert token_dtype(250_000) == np.int32


def test_reader_rejects_a_foreign_file(tmp_path):
    _write(tmp_path / "s", _docs(3, 5, 100), np.uint16)
    raw = bytearray(idx_path(tmp_path / "s").read_bytes())
    raw[0:1] = b"X"
    idx_path(tmp_path / "s").write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="bad magic"):
        IndexedShard(tmp_path / "s")


def test_reader_rejects_an_index_of_the_wrong_length(tmp_path):
    _write(tmp_path / "s", _docs(4, 5, 100), np.uint16)
    with open(idx_path(tmp_path / "s"), "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(FormatError, match="header says"):
        IndexedShard(tmp_path / "s")


def test_consistency_catches_a_truncated_bin(tmp_path):
    _write(tmp_path / "s", _docs(5, 5, 100), np.uint16)
    p = bin_path(tmp_path / "s")
    p.write_bytes(p.read_bytes()[:-4])
    with pytest.raises(FormatError, match="truncated"):
        IndexedShard(tmp_path / "s").check_consistency()


def test_consistency_catches_wrong_pointers(tmp_path):
    docs = [np.array([1, 2, 3]), np.array([4, 5])]
    _write(tmp_path / "s", docs, np.uint16)
    raw = bytearray(idx_path(tmp_path / "s").read_bytes())
    struct.pack_into("<q", raw, HEADER_BYTES + 2 * 4 + 8, 2)  # second pointer: 6 -> 2
    idx_path(tmp_path / "s").write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="pointers"):
        IndexedShard(tmp_path / "s").check_consistency()
