"""`data_tools prepare`: the shards hold every document's ids in order with an end-of-document
token, the split rule, byte-identical output whatever the worker count, shard caps, huge documents,
every input kind, DeepSpeed reading the shards, every bad input, and the CLI end to end."""
from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from data_tools import prepare as prepare_module
from data_tools.__main__ import main as data_tools_main
from data_tools.indexed import IndexedShard
from data_tools.manifest import (
    MANIFEST,
    dataset_fingerprint,
    file_checksum,
    load_manifest,
    shard_prefixes,
    tokenizer_fingerprint,
)
from data_tools.prepare import _alive, is_val
from tests.helpers import NO_CAPS, clean_env, default_sigint, tmpfs

REPO = Path(__file__).resolve().parents[1]


def prepare(*argv) -> int:
    return data_tools_main(["prepare", *map(str, argv)])


def documents(dataset: Path, split: str) -> list[list[int]]:
    m = load_manifest(dataset)
    return [doc.tolist() for p in shard_prefixes(dataset, m, split) for doc in IndexedShard(p)]


def shard_bytes(dataset: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dataset.iterdir())
            if p.suffix in (".bin", ".idx")}


def walk_order(root: Path, pattern: str = "*.py") -> list[Path]:
    return sorted(root.rglob(pattern), key=lambda p: p.relative_to(root).parts)


@pytest.mark.parametrize("fixture", ["mlm_dataset", "clm_dataset"])
def test_every_document_in_order_with_eod_and_split(request, stdlib_dir, fixture):
    dataset = request.getfixturevalue(fixture)
    m = load_manifest(dataset)
    tok = Tokenizer.from_file(str(dataset / "tokenizer" / "tokenizer.json"))
    texts = [t for t in (p.read_text(encoding="utf-8") for p in walk_order(stdlib_dir)) if t]
    expected = [tok.encode(t, add_special_tokens=False).ids + [m["eod_token_id"]] for t in texts]
    want_val = [d for i, d in enumerate(expected) if is_val(i, 0.05)]
    want_train = [d for i, d in enumerate(expected) if not is_val(i, 0.05)]
    assert documents(dataset, "train") == want_train
    assert documents(dataset, "val") == want_val
    assert len(want_val) == math.ceil((len(texts) - 1) * 0.05) >= 1


def test_manifest_records_what_the_trainer_and_verifier_need(mlm_dataset, clm_dataset,
                                                             stdlib_dir):
    m = load_manifest(mlm_dataset)
    assert (m["format"], m["format_version"], m["dtype"], m["vocab_size"]) == \
        ("dspretrain-dataset", 1, "uint16", 2000)
    assert (m["eod_token_id"], m["pad_token_id"], m["cls_token_id"], m["mask_token_id"],
            m["bos_token_id"]) == (3, 0, 2, 4, None)
    assert m["tokenizer"]["kind"] == "wordpiece" and m["model_max_length"] == 512
    assert m["tokenizer"]["fingerprint"] == tokenizer_fingerprint(mlm_dataset / "tokenizer")
    for f in m["tokenizer"]["files"]:
        path = mlm_dataset / "tokenizer" / f["name"]
        assert (f["bytes"], f["checksum"]) == (path.stat().st_size, file_checksum(path))
    assert m["fingerprint"] == dataset_fingerprint(m)
    shards = [s for split in m["splits"].values() for s in split["shards"]]
    assert [s["name"] for s in shards] == ["train_00000", "val_00000"]
    for s in shards:
        assert s["bin_checksum"] == file_checksum(mlm_dataset / f"{s['name']}.bin")
        assert s["idx_checksum"] == file_checksum(mlm_dataset / f"{s['name']}.idx")
        assert s["bin_bytes"] == 2 * s["tokens"]
    py = list(stdlib_dir.rglob("*.py"))
    assert m["input_bytes"] == m["source"]["bytes"] == sum(p.stat().st_size for p in py)
    assert m["source"]["files"] == len(py)
    assert m["documents"] == m["source"]["documents"] == sum(1 for p in py if p.stat().st_size)
    assert m["tokens"] == sum(s["tokens"] for s in shards)
    assert m["output_bytes"] == sum(s["bin_bytes"] + s["idx_bytes"] for s in shards)
    assert m["size_reduction_pct"] == pytest.approx(100 * (1 - m["output_bytes"] /
                                                          m["input_bytes"]), abs=0.01)
    assert m["command"].startswith("python -m data_tools prepare --input ")
    c = load_manifest(clm_dataset)
    assert c["tokenizer"]["kind"] == "bpe"
    assert c["eod_token_id"] == c["bos_token_id"] == 0 and c["pad_token_id"] == 1
    assert c["mask_token_id"] is None and c["fingerprint"] != m["fingerprint"]


def test_deepspeed_reads_prepared_shards_token_for_token(mlm_dataset):
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

    m = load_manifest(mlm_dataset)
    for prefix in shard_prefixes(mlm_dataset, m, "train"):
        ours = IndexedShard(prefix)
        theirs = MMapIndexedDataset(str(prefix), skip_warmup=True)
        assert len(theirs) == len(ours)
        assert theirs.sizes.tolist() == ours.sizes.tolist()
        for i in range(len(ours)):
            np.testing.assert_array_equal(theirs[i], ours[i])
        assert theirs[0].dtype == np.uint16


def test_megatron_dtype_code_reads_back_the_same(stdlib_dir, wordpiece_tokenizer, mlm_dataset,
                                                  tmp_path):
    # --dtype-code megatron writes uint16 as 8 (Megatron-LM's number); our reader takes both
    out = tmp_path / "megatron"
    assert prepare("--input", stdlib_dir, "--include", "*.py", "--tokenizer", wordpiece_tokenizer,
                   "--out", out, "--val-fraction", "0.05", "--dtype-code", "megatron") == 0
    for split in ("train", "val"):
        assert documents(out, split) == documents(mlm_dataset, split)
    for prefix in shard_prefixes(out, load_manifest(out), "train"):
        assert prefix.with_suffix(".idx").read_bytes()[17] == 8  # after magic (9) + version (8)
        assert prefix.with_suffix(".bin").read_bytes() == (
            mlm_dataset / prefix.name).with_suffix(".bin").read_bytes()


def test_a_worker_sees_its_parent_gone():
    """Where there is no pidfd (macOS), a tokenizer worker polls its prepare process, whose pid is
    not the worker's parent's (the fork server's): alive while it runs, gone once reaped."""
    assert _alive(os.getpid())
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert not _alive(proc.pid)
    # without a pidfd, a worker whose prepare is gone exits at once, status 1 (in a fork: it ends
    # the process it runs in)
    child = os.fork()
    if child == 0:
        try:
            del os.pidfd_open  # as on a platform without it
            prepare_module._exit_with_parent(proc.pid)
        finally:
            os._exit(3)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 1


def test_the_workers_start_from_a_fork_server_or_are_spawned(monkeypatch):
    """Never forked from prepare's own process (its threads' locks): a fork server where the
    platform has one, else spawn."""
    assert prepare_module._pool_context().get_start_method() == "forkserver"
    monkeypatch.setattr(prepare_module.multiprocessing, "get_all_start_methods",
                        lambda: ["spawn"])
    assert prepare_module._pool_context().get_start_method() == "spawn"


def test_split_rule():
    assert not any(is_val(i, 0.0) for i in range(1000))
    for f in (0.001, 0.01, 0.05, 0.3, 0.99):
        assert not is_val(0, f) and is_val(1, f)  # 2 documents are enough for a val split
        for n in (2, 7, 100, 1234):
            assert sum(is_val(i, f) for i in range(n)) == math.ceil((n - 1) * f)
    gaps = np.diff([i for i in range(2000) if is_val(i, 0.01)])
    assert set(gaps.tolist()) == {100}  # evenly spread, not clumped at one end


def test_output_is_byte_identical_whatever_the_workers(stdlib_dir, wordpiece_tokenizer, tmp_path):
    common = ["--input", stdlib_dir / "email", stdlib_dir / "json", "--include", "*.py",
              "--tokenizer", wordpiece_tokenizer, "--val-fraction", "0.1",
              "--shard-tokens", "30000"]
    assert prepare(*common, "--out", tmp_path / "w1", "--workers", "1",
                   "--batch-chars", "3000") == 0
    assert prepare(*common, "--out", tmp_path / "w2", "--workers", "2") == 0
    a, b = shard_bytes(tmp_path / "w1"), shard_bytes(tmp_path / "w2")
    assert len(a) > 4 and a == b
    ma, mb = load_manifest(tmp_path / "w1"), load_manifest(tmp_path / "w2")
    assert ma["fingerprint"] == mb["fingerprint"] and ma["splits"] == mb["splits"]
    # Shards are capped at document boundaries: each closes once it reaches --shard-tokens.
    for split in ma["splits"].values():
        shards = split["shards"]
        for s in shards[:-1]:
            sizes = IndexedShard(tmp_path / "w1" / s["name"]).sizes
            assert s["tokens"] >= 30000 > s["tokens"] - int(sizes[-1])
        assert shards[-1]["tokens"] <= 30000 + max(IndexedShard(tmp_path / "w1" / shards[-1]
                                                               ["name"]).sizes)


@pytest.mark.parametrize("tokenizer", ["wordpiece_tokenizer", "bpe_tokenizer"])
def test_huge_document_is_tokenized_in_pieces_as_one_sequence(request, stdlib_dir, tmp_path,
                                                              tokenizer):
    tok_dir = request.getfixturevalue(tokenizer)
    text = "".join(p.read_text(encoding="utf-8") for p in walk_order(stdlib_dir / "json"))
    big = tmp_path / "big.txt"
    big.write_text(text, encoding="utf-8")
    assert prepare("--input", big, "--tokenizer", tok_dir, "--out", tmp_path / "d",
                   "--val-fraction", "0", "--workers", "1", "--piece-chars", "4096",
                   "--batch-chars", "10000") == 0
    m = load_manifest(tmp_path / "d")
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert len(text) > 10 * 4096  # many pieces
    assert documents(tmp_path / "d", "train") == \
        [tok.encode(text, add_special_tokens=False).ids + [m["eod_token_id"]]]
    assert "val" not in m["splits"]


def test_input_kinds_and_include(tmp_path, wordpiece_tokenizer):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha document\nsecond line")
    with open(src / "b.jsonl", "w") as f:
        f.write(json.dumps({"body": "bravo"}) + "\n\n" + json.dumps({"body": "charlie"}) + "\n")
    with gzip.open(src / "sub" / "c.jsonl.gz", "wt") as f:
        f.write(json.dumps({"body": "delta", "other": 1}) + "\n")
    (src / "d.py").write_text("x = 1")  # not matched by the default --include
    (src / "e.md").write_text("# not a corpus file")
    tok = Tokenizer.from_file(str(wordpiece_tokenizer / "tokenizer.json"))
    assert prepare("--input", src, src / "d.py", src / "a.txt", "--text-key", "body",
                   "--tokenizer", wordpiece_tokenizer, "--out", tmp_path / "d",
                   "--val-fraction", "0", "--workers", "1") == 0
    # Inputs in the order given; a directory in sorted walk order; blank JSONL lines skipped.
    texts = ["alpha document\nsecond line", "bravo", "charlie", "delta", "x = 1"]
    assert documents(tmp_path / "d", "train") == \
        [tok.encode(t, add_special_tokens=False).ids + [3] for t in texts]


def test_invalid_utf8_is_replaced_and_counted_or_refused_with_strict(tmp_path, wordpiece_tokenizer,
                                                                     one_line_error):
    src = tmp_path / "bad.txt"
    src.write_bytes(b"good text \xff\xfe more text")
    assert prepare("--input", src, "--tokenizer", wordpiece_tokenizer, "--out", tmp_path / "d",
                   "--workers", "1") == 0
    assert load_manifest(tmp_path / "d")["source"]["replaced_invalid_utf8"] == 2
    assert prepare("--input", src, "--tokenizer", wordpiece_tokenizer, "--out", tmp_path / "e",
                   "--strict") == 2
    one_line_error(str(src), "invalid UTF-8", "byte 10")
    jl = tmp_path / "bad.jsonl"
    jl.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    assert prepare("--input", jl, "--tokenizer", wordpiece_tokenizer, "--out", tmp_path / "f",
                   "--strict") == 2
    one_line_error(f"{jl}:2", "invalid UTF-8")
    assert not (tmp_path / "e").exists() and not (tmp_path / "f").exists()


@pytest.mark.parametrize("content,needles", [
    ('{"text": "a"}\n{"text": "b"}\n{"text": oops}\n', [":3:", "malformed JSON"]),
    ('{"text": "a"}\n{"body": "b"}\n', [":2:", "no key 'text'"]),
    ('{"text": "a"}\n["text"]\n', [":2:", "expected a JSON object"]),
    ('{"text": 5}\n', [":1:", "key 'text' is int"]),
])
def test_bad_jsonl_names_file_and_line(tmp_path, wordpiece_tokenizer, one_line_error, content,
                                       needles):
    src = tmp_path / "c.jsonl"
    src.write_text(content)
    assert prepare("--input", src, "--tokenizer", wordpiece_tokenizer, "--out",
                   tmp_path / "d") == 2
    one_line_error(str(src), *needles)
    assert not (tmp_path / "d").exists()


def test_failure_midway_leaves_no_dataset(tmp_path, wordpiece_tokenizer, one_line_error):
    good = tmp_path / "a.jsonl"
    good.write_text("".join(json.dumps({"text": f"document number {i} " * 20}) + "\n"
                            for i in range(400)))
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "fine"}\n{broken\n')
    out = tmp_path / "out"
    out.mkdir()  # existing and empty: kept, but left empty
    assert prepare("--input", good, bad, "--tokenizer", wordpiece_tokenizer, "--out", out,
                   "--batch-chars", "500", "--workers", "1") == 2
    one_line_error(f"{bad}:2", "malformed JSON")
    assert list(out.iterdir()) == []


def test_missing_or_unreadable_inputs_and_empty_corpus(tmp_path, wordpiece_tokenizer,
                                                       one_line_error):
    out = tmp_path / "out"
    assert prepare("--input", tmp_path / "nope.txt", "--tokenizer", wordpiece_tokenizer,
                   "--out", out) == 2
    one_line_error(str(tmp_path / "nope.txt"), "no such file")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    assert prepare("--input", empty_dir, "--tokenizer", wordpiece_tokenizer, "--out", out) == 2
    one_line_error(str(empty_dir), "no input files")
    (empty_dir / "blank.txt").write_text("")
    assert prepare("--input", empty_dir, "--tokenizer", wordpiece_tokenizer, "--out", out,
                   "--workers", "1") == 2
    one_line_error("empty corpus")
    assert not out.exists()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert prepare("--input", fifo, "--tokenizer", wordpiece_tokenizer, "--out", out) == 2
    one_line_error(str(fifo), "not a regular file or directory")


def test_whitespace_only_documents_are_empty(tmp_path, wordpiece_tokenizer, one_line_error):
    """Before: each was kept as a lone [SEP] document, and a model trained on them with
    --packing doc-packed reported a loss of 0.0. They are empty documents: counted, not
    written; a corpus of nothing else is an empty corpus."""
    corpus, out = tmp_path / "ws", tmp_path / "out"
    corpus.mkdir()
    for i in range(5):
        (corpus / f"{i}.txt").write_text("   \n\t\n")
    assert prepare("--input", corpus, "--tokenizer", wordpiece_tokenizer, "--out", out,
                   "--workers", "1") == 2
    one_line_error("empty corpus", "(5 empty)")
    assert not out.exists()
    (corpus / "real.txt").write_text("def main():\n    return 1\n")
    assert prepare("--input", corpus, "--tokenizer", wordpiece_tokenizer, "--out", out,
                   "--workers", "1", "--val-fraction", "0") == 0
    manifest = load_manifest(out)
    assert manifest["source"]["empty_documents"] == 5
    assert manifest["splits"]["train"]["documents"] == 1


def test_unreadable_input(tmp_path, wordpiece_tokenizer, one_line_error):
    """As root (CI) the command runs without root's capabilities, so the file's mode applies as
    it does to any user; in a process of its own, whose stderr the one-line check reads."""
    out = tmp_path / "out"
    locked = tmp_path / "locked.txt"
    locked.write_text("secret")
    locked.chmod(0)
    cmd = [sys.executable, "-m", "data_tools", "prepare", "--input", str(locked),
           "--tokenizer", str(wordpiece_tokenizer), "--out", str(out)]
    proc = subprocess.run((NO_CAPS if os.geteuid() == 0 else []) + cmd, cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    sys.stderr.write(proc.stderr)
    assert proc.returncode == 2
    one_line_error(str(locked), "cannot read")
    assert not out.exists()


def test_bad_tokenizer_directories(tmp_path, stdlib_dir, wordpiece_tokenizer, one_line_error):
    args = ["--input", stdlib_dir / "json", "--include", "*.py", "--out", tmp_path / "d"]
    assert prepare(*args, "--tokenizer", tmp_path / "none") == 2
    one_line_error(str(tmp_path / "none"), "no such tokenizer directory")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "tokenizer.json").write_text('{"model": {"type": "WordPiece", "vocab": ')
    assert prepare(*args, "--tokenizer", corrupt) == 2
    one_line_error(str(corrupt / "tokenizer.json"), "corrupt")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare(*args, "--tokenizer", empty) == 2
    one_line_error(str(empty), "not a loadable tokenizer")
    no_eod = tmp_path / "no_eod"
    no_eod.mkdir()
    (no_eod / "tokenizer.json").write_bytes((wordpiece_tokenizer / "tokenizer.json").read_bytes())
    (no_eod / "tokenizer_config.json").write_text(json.dumps({"unk_token": "[UNK]"}))
    assert prepare(*args, "--tokenizer", no_eod) == 2
    one_line_error(str(no_eod), "neither a sep nor an eos")
    assert not (tmp_path / "d").exists()


def test_existing_dataset_is_refused_unless_overwrite(tmp_path, stdlib_dir, wordpiece_tokenizer,
                                                      one_line_error):
    args = ["--input", stdlib_dir / "json", "--include", "*.py", "--tokenizer",
            wordpiece_tokenizer, "--out", tmp_path / "d", "--workers", "1"]
    assert prepare(*args, "--val-fraction", "0") == 0
    before = (tmp_path / "d" / MANIFEST).read_text()
    assert prepare(*args) == 2
    one_line_error(str(tmp_path / "d"), "already holds a dataset", "--overwrite")
    assert (tmp_path / "d" / MANIFEST).read_text() == before
    assert prepare(*args, "--val-fraction", "0.2", "--overwrite") == 0
    assert "val" in load_manifest(tmp_path / "d")["splits"]
    stranger = tmp_path / "other"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("keep me")
    assert prepare(*args[:-4], "--out", stranger) == 2
    one_line_error(str(stranger), "not empty and not a dataset")
    assert [p.name for p in stranger.iterdir()] == ["notes.txt"]


def test_overwrite_refuses_an_output_holding_an_input(tmp_path, stdlib_dir, bpe_tokenizer,
                                                     one_line_error):
    """--overwrite never clears a directory that holds one of the inputs (here the dataset's
    own tokenizer copy); weights next to a tokenizer (a model directory) are not copied."""
    model_dir = tmp_path / "model"
    shutil.copytree(bpe_tokenizer, model_dir)
    (model_dir / "model.safetensors").write_bytes(b"\0" * 1024)
    args = ["--input", stdlib_dir / "json", "--include", "*.py", "--workers", "1"]
    assert prepare(*args, "--tokenizer", model_dir, "--out", tmp_path / "d") == 0
    first = shard_bytes(tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "d" / "tokenizer").iterdir()) == \
        ["tokenizer.json", "tokenizer_config.json"]
    assert prepare(*args, "--tokenizer", tmp_path / "d" / "tokenizer", "--out", tmp_path / "d",
                   "--overwrite") == 2
    one_line_error(f"--out {tmp_path / 'd'}: contains the input --tokenizer")
    assert shard_bytes(tmp_path / "d") == first
    assert prepare(*args, "--input", stdlib_dir, "--tokenizer", model_dir,
                   "--out", stdlib_dir / "out") == 2
    one_line_error(f"--out {stdlib_dir / 'out'}: lies inside the input --input")
    assert not (stdlib_dir / "out").exists()


@pytest.mark.parametrize("flag,value", [("--val-fraction", "1.5"), ("--workers", "0"),
                                        ("--shard-tokens", "0")])
def test_bad_flags(tmp_path, stdlib_dir, wordpiece_tokenizer, one_line_error, flag, value):
    assert prepare("--input", stdlib_dir / "json", "--tokenizer", wordpiece_tokenizer,
                   "--out", tmp_path / "d", flag, value) == 2
    one_line_error(f"{flag} {value}")


def test_out_of_disk_space_is_one_line_and_leaves_nothing(tmp_path, stdlib_dir,
                                                          wordpiece_tokenizer, one_line_error):
    with tmpfs(tmp_path / "mnt", "200k") as mnt:
        out = mnt / "d"
        assert prepare("--input", stdlib_dir, "--include", "*.py", "--tokenizer",
                       wordpiece_tokenizer, "--out", out, "--workers", "1") == 2
        one_line_error("out of disk space writing", str(out))
        assert list(mnt.iterdir()) == []


def test_ctrl_c_leaves_no_dataset(tmp_path, stdlib_dir, wordpiece_tokenizer):
    out = tmp_path / "d"
    proc = subprocess.Popen(
        [sys.executable, "-m", "data_tools", "prepare", "--input", str(stdlib_dir),
         "--include", "*.py", "--tokenizer", str(wordpiece_tokenizer), "--out", str(out),
         "--workers", "1", "--batch-chars", "300"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=default_sigint)
    deadline = time.monotonic() + 60
    while not (out / "train_00000.bin").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.slow
def test_cli_end_to_end_tokenizer_prepare_inspect(tmp_path, stdlib_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    def cli(*argv) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "data_tools", *map(str, argv)], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=300)

    src = [stdlib_dir / "json", stdlib_dir / "http"]
    r = cli("tokenizer", "--input", *src, "--include", "*.py", "--out", tmp_path / "tok",
            "--kind", "bpe", "--vocab-size", "600")
    assert r.returncode == 0, r.stderr
    r = cli("prepare", "--input", *src, "--include", "*.py", "--tokenizer", tmp_path / "tok",
            "--out", tmp_path / "data", "--val-fraction", "0.1")
    assert r.returncode == 0, r.stderr
    assert "size reduction" in r.stdout or "smaller" in r.stdout
    assert "prepare:" in r.stderr  # the progress bar
    r = cli("inspect", tmp_path / "data", "--verify", "--decode", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1].startswith("OK")
    first = walk_order(stdlib_dir / "json")[0].read_text(encoding="utf-8")
    assert first + "<|endoftext|>" in r.stdout  # byte-level BPE decodes the source exactly
