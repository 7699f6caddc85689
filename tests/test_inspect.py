"""`data_tools inspect`: the summary, --json, --decode, and --verify catching each kind of damage
(flipped byte, truncated .bin, wrong .idx, token id past the vocabulary, another tokenizer) with a
line that names the shard."""
from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest

from data_tools.__main__ import main as data_tools_main
from data_tools.indexed import HEADER_BYTES, ShardWriter
from data_tools.manifest import MANIFEST, file_checksum, load_manifest, write_manifest


def inspect(*argv) -> int:
    return data_tools_main(["inspect", *map(str, argv)])


@pytest.fixture
def dataset_copy(mlm_dataset, tmp_path):
    """A copy of the session dataset that a test may damage."""
    return shutil.copytree(mlm_dataset, tmp_path / "copy")


def test_summary_table(mlm_dataset, capsys):
    assert inspect(mlm_dataset) == 0
    out = capsys.readouterr().out
    m = load_manifest(mlm_dataset)
    assert "uint16" in out and "vocab 2,000" in out and "wordpiece" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.strip().startswith(("train", "val"))}
    for split in ("train", "val"):
        assert rows[split][1:4] == ["1", f"{m['splits'][split]['documents']:,}",
                                    f"{m['splits'][split]['tokens']:,}"]


def test_json_summary_and_verify(mlm_dataset, capsys):
    assert inspect(mlm_dataset, "--json", "--verify") == 0
    s = json.loads(capsys.readouterr().out)
    m = load_manifest(mlm_dataset)
    assert s["verified"] is True and s["problems"] == []
    assert s["fingerprint"] == m["fingerprint"] and s["vocab_size"] == 2000
    assert s["splits"]["train"]["tokens"] == m["splits"]["train"]["tokens"]
    assert s["splits"]["val"]["bytes"] == sum(x["bin_bytes"] + x["idx_bytes"]
                                              for x in m["splits"]["val"]["shards"])


def test_decode_gives_back_the_source_text(clm_dataset, stdlib_dir, capsys):
    assert inspect(clm_dataset, "--decode", "2", "--json") == 0
    docs = json.loads(capsys.readouterr().out)["decoded"]
    assert [(d["split"], d["shard"], d["index"]) for d in docs] == \
        [("train", "train_00000", 0), ("train", "train_00000", 1)]
    first = sorted(stdlib_dir.rglob("*.py"), key=lambda p: p.relative_to(stdlib_dir).parts)[0]
    assert docs[0]["text"] == first.read_text(encoding="utf-8") + "<|endoftext|>"
    assert inspect(clm_dataset, "--decode", "1") == 0
    assert first.read_text(encoding="utf-8") in capsys.readouterr().out


def test_verify_ok(dataset_copy, capsys):
    assert inspect(dataset_copy, "--verify") == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("OK: 6 files verified")


def test_verify_names_the_shard_with_a_flipped_byte(dataset_copy, one_line_error):
    path = dataset_copy / "train_00000.bin"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    assert inspect(dataset_copy, "--verify") == 2
    one_line_error("shard train_00000", "checksum mismatch")


def test_verify_names_the_shard_with_a_truncated_bin(dataset_copy, one_line_error):
    path = dataset_copy / "val_00000.bin"
    path.write_bytes(path.read_bytes()[:-10])
    assert inspect(dataset_copy, "--verify") == 2
    one_line_error("shard val_00000", "truncated")


def test_verify_names_the_shard_with_a_wrong_idx(dataset_copy, one_line_error):
    """An .idx whose checksum was updated too: only the structural check can catch it."""
    m = load_manifest(dataset_copy)
    idx = dataset_copy / "train_00000.idx"
    raw = bytearray(idx.read_bytes())
    (first,) = struct.unpack_from("<i", raw, HEADER_BYTES)
    struct.pack_into("<i", raw, HEADER_BYTES, first + 1)  # a size that no longer fits the .bin
    idx.write_bytes(bytes(raw))
    m["splits"]["train"]["shards"][0]["idx_checksum"] = file_checksum(idx)
    write_manifest(dataset_copy, m)
    assert inspect(dataset_copy, "--verify") == 2
    one_line_error("shard train_00000", "pointers do not match")


def test_verify_catches_token_ids_past_the_vocabulary(dataset_copy, one_line_error):
    m = load_manifest(dataset_copy)
    w = ShardWriter(dataset_copy / "val_00000", np.uint16)
    w.add_document([5, 6, 2500, m["eod_token_id"]])  # 2500 >= vocab 2000
    w.finalize(fsync=False)
    shard = m["splits"]["val"]["shards"][0]
    for ext in ("bin", "idx"):
        p = dataset_copy / f"val_00000.{ext}"
        shard[f"{ext}_bytes"], shard[f"{ext}_checksum"] = p.stat().st_size, file_checksum(p)
    shard["documents"], shard["tokens"] = 1, 4
    write_manifest(dataset_copy, m)
    assert inspect(dataset_copy, "--verify") == 2
    one_line_error("shard val_00000", "token id 2500", "vocabulary size 2000")


def test_verify_catches_a_swapped_tokenizer(dataset_copy, bpe_tokenizer, one_line_error):
    m = load_manifest(dataset_copy)
    tok_json = dataset_copy / "tokenizer" / "tokenizer.json"
    shutil.copyfile(bpe_tokenizer / "tokenizer.json", tok_json)
    for f in m["tokenizer"]["files"]:  # the file list agrees, the fingerprint does not
        if f["name"] == "tokenizer.json":
            f["bytes"], f["checksum"] = tok_json.stat().st_size, file_checksum(tok_json)
    write_manifest(dataset_copy, m)
    assert inspect(dataset_copy, "--verify") == 2
    one_line_error(str(tok_json), "fingerprint")


def test_not_a_dataset(tmp_path, one_line_error):
    assert inspect(tmp_path / "nope") == 2
    one_line_error(str(tmp_path / "nope"), "no such dataset directory")
    assert inspect(tmp_path) == 2
    one_line_error(str(tmp_path), MANIFEST)
    (tmp_path / MANIFEST).write_text("{not json")
    assert inspect(tmp_path) == 2
    one_line_error(str(tmp_path / MANIFEST), "line 1")
