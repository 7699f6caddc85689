"""`data_tools adopt`: Megatron-made shards (Megatron's uint16 code, written by our writer) become
a dataset that verifies, stages (real bytes, even through symlinks) and trains, without
re-tokenizing; every bad shard set is one line and leaves nothing."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from data_tools.__main__ import main as data_tools_main
from data_tools.indexed import MAGIC, ShardWriter, bin_path, idx_path
from data_tools.manifest import MANIFEST, load_manifest
from data_tools.stage import stage
from tests.helpers import TINY, check, run_app, snapshot, tmpfs


def adopt(*argv) -> int:
    return data_tools_main(["adopt", *map(str, argv)])


@pytest.fixture(scope="module")
def megatron(stdlib_dir, wordpiece_tokenizer, tmp_path_factory) -> dict:
    """Shards as Megatron's preprocess_data.py leaves them: part{i}.bin/.idx, uint16 code 8, no
    dataset.json; and the dataset prepare made of the same input."""
    root = tmp_path_factory.mktemp("megatron")
    assert data_tools_main(["prepare", "--input", str(stdlib_dir / "json"), "--include", "*.py",
                            "--tokenizer", str(wordpiece_tokenizer), "--out", str(root / "made"),
                            "--val-fraction", "0", "--shard-tokens", "4000", "--dtype-code",
                            "megatron", "--workers", "1"]) == 0
    (root / "mega").mkdir()
    for i, b in enumerate(sorted((root / "made").glob("*.bin"))):
        shutil.copyfile(b, root / "mega" / f"part{i}.bin")
        shutil.copyfile(b.with_suffix(".idx"), root / "mega" / f"part{i}.idx")
    return {"root": root, "made": root / "made", "parts": sorted((root / "mega").glob("part*"))}


@pytest.mark.slow
def test_adopted_megatron_shards_verify_and_train(megatron, wordpiece_tokenizer, tmp_path):
    out = tmp_path / "adopted"
    parts = megatron["parts"]  # part0.bin part0.idx part1.bin ... (a shell glob)
    assert len(parts) >= 4
    assert adopt(*parts, "--tokenizer", wordpiece_tokenizer, "--out", out) == 0
    assert data_tools_main(["inspect", str(out), "--verify"]) == 0
    m, made = load_manifest(out), load_manifest(megatron["made"])
    assert (m["dtype"], m["dtype_code"], m["vocab_size"]) == ("uint16", "megatron", 2000)
    for key in ("eod_token_id", "pad_token_id", "mask_token_id", "cls_token_id",
                "special_token_ids", "documents", "tokens"):
        assert m[key] == made[key], key
    assert m["tokenizer"]["fingerprint"] == made["tokenizer"]["fingerprint"]
    assert [s["bin_checksum"] for s in m["splits"]["train"]["shards"]] == \
        [s["bin_checksum"] for s in made["splits"]["train"]["shards"]]
    first = m["splits"]["train"]["shards"][0]
    assert first["name"] == "train_00000" and first["placed"] == "hard link"
    assert (out / "train_00000.bin").stat().st_ino == parts[0].stat().st_ino
    assert (out / "train_00000.bin").samefile(megatron["root"] / "mega" / "part0.bin")
    run = tmp_path / "run"
    check(run_app("train", "--data", out, "--out", run, "--model", "bert-tiny", *TINY,
                  "--max-steps", "2", "--log-every", "1"))
    assert (run / "summary.json").is_file()


def write_shard(prefix: Path, docs: list[list[list[int]]], dtype=np.uint16, code: int = 8
                ) -> None:
    """A shard with documents made of several sequences (Megatron's --split-sentences)."""
    seqs = [s for d in docs for s in d]
    sizes = np.array([len(s) for s in seqs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)]) * np.dtype(
        dtype).itemsize
    doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    bin_path(prefix).write_bytes(np.array([t for s in seqs for t in s], dtype=dtype).tobytes())
    idx_path(prefix).write_bytes(MAGIC + struct.pack("<QBQQ", 1, code, len(seqs), len(doc_idx)) +
                                 sizes.tobytes() + pointers.astype(np.int64).tobytes() +
                                 doc_idx.tobytes())


def test_val_split_copies_sentence_split_documents_and_a_warning(megatron, wordpiece_tokenizer,
                                                                 tmp_path, capsys):
    val = tmp_path / "val"
    write_shard(val, [[[10, 11], [12, 3]], [[13, 14, 15, 3]], []])  # 3 documents, 3 sequences
    out = tmp_path / "adopted"
    parts = megatron["parts"]
    assert adopt(parts[0], "--val", val, "--tokenizer", wordpiece_tokenizer, "--out", out,
                 "--copy") == 0
    assert "copies" in capsys.readouterr().out
    assert data_tools_main(["inspect", str(out), "--verify"]) == 0
    v = load_manifest(out)["splits"]["val"]["shards"][0]
    assert (v["name"], v["documents"], v["sequences"], v["tokens"]) == ("val_00000", 3, 3, 8)
    assert (out / "val_00000.bin").stat().st_nlink == 1  # a copy, not a link
    unterminated = tmp_path / "noeod"
    write_shard(unterminated, [[[10, 11]], [[12, 3]]])
    assert adopt(unterminated, "--tokenizer", wordpiece_tokenizer, "--out", tmp_path / "w") == 0
    assert "1 of 2 documents do not end with the end-of-document token" in capsys.readouterr().err


def test_across_filesystems_symlinks_and_stage_copies_real_bytes(megatron, wordpiece_tokenizer,
                                                                 tmp_path, capsys):
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        for p in megatron["parts"][:4]:
            shutil.copyfile(p, mnt / p.name)
        out = tmp_path / "adopted"
        assert adopt(*sorted(mnt.iterdir()), "--tokenizer", wordpiece_tokenizer, "--out",
                     out) == 0
        assert "symbolic links" in capsys.readouterr().err
        assert (out / "train_00000.bin").is_symlink()
        assert load_manifest(out)["splits"]["train"]["shards"][0]["placed"] == "symlink"
        staged = tmp_path / "staged"
        stage(out, staged, progress=False)
        assert not (staged / "train_00000.bin").is_symlink()
        assert (staged / "train_00000.bin").read_bytes() == (mnt / "part0.bin").read_bytes()
        assert data_tools_main(["inspect", str(staged), "--verify"]) == 0


def big_vocab_tokenizer(d: Path) -> Path:
    """A tokenizer with 70,000 ids: uint16 shards cannot hold them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[SEP]": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"sep_token": "[SEP]",
                                                         "unk_token": "[UNK]"}))
    return d


def test_bad_shard_sets_are_one_line(megatron, wordpiece_tokenizer, tmp_path, one_line_error):
    parts = megatron["parts"]
    p0, p1 = parts[0].with_suffix(""), parts[2].with_suffix("")
    d = tmp_path / "bad"
    d.mkdir()
    w = ShardWriter(d / "int32", np.int32)
    w.add_document([5, 6, 3])
    w.finalize()
    w = ShardWriter(d / "big_ids", np.uint16, "megatron")
    w.add_document([5, 2500, 3])
    w.finalize()
    shutil.copyfile(bin_path(p0), d / "cut.bin")
    (d / "cut.bin").write_bytes((d / "cut.bin").read_bytes()[:-10])
    shutil.copyfile(idx_path(p0), d / "cut.idx")
    (d / "junk.bin").write_bytes(b"\0" * 8)
    (d / "junk.idx").write_bytes(b"not an index")
    tok = ["--tokenizer", wordpiece_tokenizer]
    cases = {
        "missing": ([d / "nope", *tok], ["PREFIX", "no such shard", "nope.bin"]),
        "twice": ([p0, p1, f"{p0}.bin", *tok], ["named twice", str(p0)]),
        "train and val": ([p0, "--val", f"{p0}.idx", *tok], ["--val", "also a train shard"]),
        "dtypes": ([p0, d / "int32", *tok], ["different dtypes", "uint16", "int32"]),
        "ids past the vocabulary": ([d / "big_ids", *tok], ["big_ids", "token id 2500",
                                                            "vocabulary size 2000"]),
        "cut .bin": ([d / "cut", *tok], ["shard", "cut.bin", "truncated"]),
        "not an index": ([d / "junk", *tok], ["junk.idx", "bad magic"]),
        "dtype too small": ([p0, "--tokenizer", big_vocab_tokenizer(tmp_path / "bigtok")],
                            ["uint16 cannot hold", "70002"]),
    }
    out = tmp_path / "out"
    for name, (argv, needles) in cases.items():
        assert adopt(*argv, "--out", out) == 2, name
        one_line_error(*needles)
        assert not out.exists(), name
    # Outputs: never a stranger's directory, never an input's; --overwrite only a dataset.
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("keep")
    assert adopt(p0, *tok, "--out", stranger, "--overwrite") == 2
    one_line_error("not empty and not a dataset")
    assert adopt(p0, *tok, "--out", parts[0].parent) == 2
    one_line_error("contains the input PREFIX")
    assert adopt(p0, *tok, "--out", out) == 0
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    assert adopt(p1, *tok, "--out", out) == 2
    one_line_error("already holds a dataset", "--overwrite")
    assert adopt(p1, *tok, "--out", out, "--overwrite") == 2
    one_line_error("notes.txt", "nothing was changed")
    assert snapshot(out) == before and (out / MANIFEST).is_file()
    text = tmp_path / "t.txt"
    text.write_text("some text")
    assert data_tools_main(["prepare", "--input", str(text), *map(str, tok), "--out", str(out),
                            "--resume"]) == 2  # not prepare's: nothing to resume, kept
    one_line_error("already holds a complete dataset", "no prepare_key")
    assert snapshot(out) == before
