"""`data_tools stage`: copy + verify, idempotence, resume, one copier among concurrent stagers,
and every refusal the issue lists (corrupt/truncated source, no space, another dataset, ...)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from filelock import FileLock
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from data_tools.__main__ import main as data_tools_main
from data_tools.errors import UserError
from data_tools.indexed import IndexedShard, ShardWriter
from data_tools.manifest import (
    MANIFEST,
    dataset_fingerprint,
    file_checksum,
    load_manifest,
    tokenizer_fingerprint,
    write_manifest,
)
from data_tools.stage import (
    BLOCK_BYTES,
    LOCK_NAME,
    STATE_NAME,
    check_free_space,
    partial_path,
    stage,
)
from tests.helpers import tmpfs

REPO = Path(__file__).resolve().parents[1]
TEXT = ["the quick brown fox jumps over the lazy dog", "staging copies shards to local disk",
        "a corrupted shard costs a day of compute", "every rank starts the stage at once"]


def _train_tokenizer(out: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=120, show_progress=False,
                                                      special_tokens=["[UNK]", "[EOS]"]))
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[EOS]"}))
    return tok


def make_dataset(root: Path, seed: int = 0, shards: int = 4, docs_per_shard: int = 40,
                 doc_tokens: int = 3000, file_list: bool = True) -> Path:
    """A real dataset dir: Megatron shards of a real tokenizer's ids, manifest written last."""
    tok = _train_tokenizer(root / "tokenizer")
    vocab, eos = tok.get_vocab_size(), tok.token_to_id("[EOS]")
    rng = np.random.default_rng(seed)
    splits: dict = {"train": {"documents": 0, "tokens": 0, "shards": []},
                    "val": {"documents": 0, "tokens": 0, "shards": []}}
    for i in range(shards):
        split = "val" if i == shards - 1 else "train"
        name = f"{split}_{i:05d}"
        w = ShardWriter(root / name, np.uint16)
        for _ in range(docs_per_shard):
            doc = rng.integers(2, vocab, size=doc_tokens, dtype=np.uint16)
            w.add_document(np.append(doc, np.uint16(eos)))
        w.finalize(fsync=False)
        entry = {"name": name, "documents": docs_per_shard, "tokens": w.num_tokens,
                 "bin_bytes": (root / f"{name}.bin").stat().st_size,
                 "idx_bytes": (root / f"{name}.idx").stat().st_size,
                 "bin_checksum": file_checksum(root / f"{name}.bin"),
                 "idx_checksum": file_checksum(root / f"{name}.idx")}
        splits[split]["shards"].append(entry)
        splits[split]["documents"] += docs_per_shard
        splits[split]["tokens"] += w.num_tokens
    tok_files = [{"name": p.name, "bytes": p.stat().st_size, "checksum": file_checksum(p)}
                 for p in sorted((root / "tokenizer").iterdir())]
    manifest = {"format": "dspretrain-dataset", "format_version": 1, "dtype": "uint16",
                "vocab_size": vocab, "eod_token_id": eos, "pad_token_id": None,
                "mask_token_id": None, "checksum_algorithm": "xxh3_128",
                "tokenizer": {"dir": "tokenizer", "kind": "bpe",
                              "fingerprint": tokenizer_fingerprint(root / "tokenizer")},
                "splits": splits}
    if file_list:
        manifest["tokenizer"]["files"] = tok_files
    manifest["fingerprint"] = dataset_fingerprint(manifest)
    write_manifest(root, manifest)
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """~1.2 MB in 4 shards plus the tokenizer; tests that change the source make their own."""
    return make_dataset(tmp_path_factory.mktemp("ds") / "data")


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def assert_same_dataset(src: Path, dst: Path) -> None:
    """Every file the source has, byte for byte; only the stage's own hidden files besides."""
    want, got = files_of(src), files_of(dst)
    extra = set(got) - set(want)
    assert extra <= {STATE_NAME, LOCK_NAME}, extra
    for name, data in want.items():
        assert got[name] == data, name
    for prefix in (p.with_suffix("") for p in dst.glob("*.bin")):
        IndexedShard(prefix).check_consistency()


def cli(*argv: str, capsys) -> tuple[int, str, str]:
    rc = data_tools_main(["stage", "--quiet", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


# ----------------------------------------------------------------------------- copy, re-run

def test_copy_and_verify(dataset, tmp_path):
    dst = tmp_path / "local" / "data"  # parents are created
    stats = stage(dataset, dst, progress=False, workers=3)
    assert_same_dataset(dataset, dst)
    assert stats.copied_bytes == stats.total_bytes == sum(
        len(b) for n, b in files_of(dataset).items() if n != MANIFEST)
    assert stats.copied_files == stats.files == 8 + 2
    assert load_manifest(dst)["fingerprint"] == load_manifest(dataset)["fingerprint"]
    assert not list(dst.rglob("*.partial"))


def test_second_run_copies_nothing(dataset, tmp_path, capsys):
    dst = tmp_path / "dst"
    assert stage(dataset, dst, progress=False).copied_files == 10 and (dst / MANIFEST).is_file()
    mtimes = {p: p.stat().st_mtime_ns for p in dst.rglob("*") if p.is_file()}
    rc, out, _ = cli("--src", str(dataset), "--dst", str(dst), "--json", capsys=capsys)
    assert rc == 0
    result = json.loads(out)
    assert result["copied_bytes"] == 0 and result["rehashed_files"] == 0
    assert result["reused_files"] == result["files"]
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes  # nothing rewritten


def test_files_without_a_state_record_are_rehashed_not_copied(dataset, tmp_path):
    dst = tmp_path / "dst"
    stage(dataset, dst, progress=False)
    (dst / STATE_NAME).unlink()  # e.g. a copy made with rsync, or a lost state file
    stats = stage(dataset, dst, progress=False)
    assert stats.copied_bytes == 0 and stats.rehashed_files == stats.files
    assert_same_dataset(dataset, dst)


def test_verify_existing_finds_and_replaces_a_corrupted_copy(dataset, tmp_path):
    dst = tmp_path / "dst"
    stage(dataset, dst, progress=False)
    shard = dst / "train_00001.bin"
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0xFF  # bit rot on the local disk: same size, same mtime
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert stage(dataset, dst, progress=False).copied_bytes == 0  # trusted by default
    stats = stage(dataset, dst, progress=False, verify_existing=True)
    assert stats.copied_files == 1 and stats.copied_bytes == st.st_size
    assert stats.rehashed_files == stats.files - 1
    assert_same_dataset(dataset, dst)


# ----------------------------------------------------------------------------- resume

def test_resume_continues_a_partial_file_from_its_length(dataset, tmp_path):
    """The on-disk state an interrupted stage leaves: some files done, one half-copied
    `.partial`, no dataset.json. The next run copies only what is missing."""
    dst = tmp_path / "dst"
    stage(dataset, dst, progress=False)
    (dst / MANIFEST).unlink()
    big = dst / "train_00000.bin"
    size = big.stat().st_size
    os.rename(big, partial_path(big))
    os.truncate(partial_path(big), size // 3)
    (dst / "val_00003.bin").unlink()  # not started at all
    stats = stage(dataset, dst, progress=False)
    val_size = (dataset / "val_00003.bin").stat().st_size
    kept = size // 3 // BLOCK_BYTES * BLOCK_BYTES  # resumes from a whole block
    assert stats.copied_bytes == size - kept + val_size
    assert stats.copied_files == 2 and stats.reused_files == stats.files - 2
    assert_same_dataset(dataset, dst)
    assert not partial_path(big).exists()


def test_resume_with_a_bad_partial_starts_that_file_over(dataset, tmp_path):
    dst = tmp_path / "dst"
    stage(dataset, dst, progress=False)
    (dst / MANIFEST).unlink()
    big = dst / "train_00000.bin"
    size = big.stat().st_size
    big.unlink()
    partial_path(big).write_bytes(b"\x00" * (size // 2))  # e.g. zeros after a power loss
    stats = stage(dataset, dst, progress=False)
    kept = size // 2 // BLOCK_BYTES * BLOCK_BYTES
    assert stats.copied_bytes == size - kept + size  # resumed, failed, copied again
    assert_same_dataset(dataset, dst)


@pytest.mark.slow
def test_killed_stage_resumes(tmp_path):
    """A real SIGKILL in the middle of a copy; the next run finishes it from the partial."""
    src = make_dataset(tmp_path / "src", shards=2, docs_per_shard=100, doc_tokens=200_000)
    dst = tmp_path / "dst"
    proc = subprocess.Popen([sys.executable, "-m", "data_tools", "stage", "--quiet", "--workers",
                             "1", "--src", str(src), "--dst", str(dst)], cwd=REPO)
    part = partial_path(dst / "train_00000.bin")
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if part.exists() and part.stat().st_size > 0:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.001)
    proc.wait()
    if proc.returncode != -signal.SIGKILL:
        pytest.skip("the copy finished before it could be interrupted")
    assert not (dst / MANIFEST).exists()
    left = part.stat().st_size
    stats = stage(src, dst, progress=False)
    assert stats.copied_bytes <= stats.total_bytes - left + BLOCK_BYTES
    assert_same_dataset(src, dst)


# ----------------------------------------------------------------------------- concurrency

def test_four_concurrent_stagers_copy_once(tmp_path):
    """Four processes (every local rank of a node) start at the same instant: one copies, the
    others wait for its lock and find the copy done. The test holds the destination's lock until
    all four have started (the race to it is not this test's: an idle box once let the first
    finish its copy before the others reached the lock), so they all meet it held."""
    src = make_dataset(tmp_path / "src", shards=4, docs_per_shard=40, doc_tokens=50_000)
    dst = tmp_path / "dst"
    ready = tmp_path / "ready"
    ready.mkdir()
    # each starts once all four have imported (a fixed start time was missed by a process still
    # importing on a loaded box, which then found the copy done: no overlap to see)
    code = ("import os, sys, time; from data_tools.__main__ import main; import data_tools.stage; "
            f"open(os.path.join({str(ready)!r}, str(os.getpid())), 'w').close()\n"
            f"while len(os.listdir({str(ready)!r})) < 4: time.sleep(0.01)\n"
            f"sys.exit(main(['stage', '--quiet', '--json', '--src', {str(src)!r}, "
            f"'--dst', {str(dst)!r}]))")
    dst.mkdir()
    held = FileLock(str(dst / LOCK_NAME))
    held.acquire(timeout=0)
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    try:
        deadline = time.monotonic() + 120
        while len(os.listdir(ready)) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.0)  # imported: milliseconds from the lock; a second's margin
        assert not (dst / MANIFEST).exists()  # nothing copied while the lock was held
    finally:
        held.release()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    total = results[0]["total_bytes"]
    copied = sorted(r["copied_bytes"] for r in results)
    assert copied == [0, 0, 0, total]
    assert sum(r["waited_for_lock"] for r in results) == 4  # each met the lock held
    assert_same_dataset(src, dst)


# ----------------------------------------------------------------------------- refusals

def test_corrupted_source_is_refused_naming_the_file(tmp_path, capsys):
    src = make_dataset(tmp_path / "src")
    bad = src / "train_00001.bin"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01  # silent corruption: same size
    bad.write_bytes(bytes(data))
    dst = tmp_path / "dst"
    rc, _, err = cli("--src", str(src), "--dst", str(dst), capsys=capsys)
    assert rc == 2
    one_line_error(err, str(bad), "checksum", "corrupt")
    assert not (dst / MANIFEST).exists()
    assert not (dst / "train_00001.bin").exists()
    assert not partial_path(dst / "train_00001.bin").exists()


def test_truncated_source_is_refused_before_copying(tmp_path, capsys):
    src = make_dataset(tmp_path / "src")
    bad = src / "val_00003.bin"
    os.truncate(bad, bad.stat().st_size - 100)
    dst = tmp_path / "dst"
    rc, _, err = cli("--src", str(src), "--dst", str(dst), capsys=capsys)
    assert rc == 2
    one_line_error(err, str(bad), "truncated")
    assert not [p for p in dst.rglob("*") if p.is_file() and p.name != LOCK_NAME]


def test_missing_or_incomplete_source_is_refused(dataset, tmp_path, capsys):
    rc, _, err = cli("--src", str(tmp_path / "nope"), "--dst", str(tmp_path / "d"), capsys=capsys)
    assert rc == 2
    one_line_error(err, str(tmp_path / "nope"), "no such dataset directory")
    half = tmp_path / "half"  # shards but no dataset.json: prepare did not finish
    half.mkdir()
    (half / "train_00000.bin").write_bytes(b"\x00" * 10)
    rc, _, err = cli("--src", str(half), "--dst", str(tmp_path / "d"), capsys=capsys)
    assert rc == 2
    one_line_error(err, str(half), "no dataset.json")
    rc, _, err = cli("--src", str(dataset), "--dst", str(dataset), capsys=capsys)
    assert rc == 2
    one_line_error(err, f"--dst {dataset}: is the input --src")


def test_no_space_is_refused_on_a_real_small_filesystem(dataset, tmp_path, capsys):
    with tmpfs(tmp_path / "tiny", "1m") as mnt:
        rc, _, err = cli("--src", str(dataset), "--dst", str(mnt / "data"), capsys=capsys)
        assert rc == 2
        one_line_error(err, str(mnt / "data"), "not enough free space", "MB free")
        assert not [p for p in (mnt / "data").rglob("*") if p.name != LOCK_NAME]


def test_a_dataset_that_fits_a_small_filesystem_is_staged(dataset, tmp_path):
    with tmpfs(tmp_path / "small", "8m") as mnt:
        stage(dataset, mnt / "data", progress=False)
        assert_same_dataset(dataset, mnt / "data")


def test_free_space_check():
    check_free_space(Path("/x"), needed_bytes=10 << 20, free_bytes=20 << 20)
    with pytest.raises(UserError, match=r"/x: not enough free space: the copy needs 10\.5 MB"):
        check_free_space(Path("/x"), needed_bytes=10_500_000, free_bytes=11_000_000)


def test_destination_not_writable(dataset, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rc, _, err = cli("--src", str(dataset), "--dst", str(blocker), capsys=capsys)
    assert rc == 2
    one_line_error(err, str(blocker), "not a directory")
    rc, _, err = cli("--src", str(dataset), "--dst", str(blocker / "sub"), capsys=capsys)
    assert rc == 2
    one_line_error(err, str(blocker / "sub"), "not writable")
    with tmpfs(tmp_path / "ro", "1m", ro=True) as mnt:
        rc, _, err = cli("--src", str(dataset), "--dst", str(mnt), capsys=capsys)
        assert rc == 2
        one_line_error(err, str(mnt), "not writable", "Read-only")


def test_a_complete_copy_on_a_read_only_disk_is_accepted(dataset, tmp_path):
    """Ranks of a later job on a node whose local copy was made read-only: nothing to write."""
    with tmpfs(tmp_path / "ro2", "8m") as mnt:
        stage(dataset, mnt / "data", progress=False)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        stats = stage(dataset, mnt / "data", progress=False)
        assert stats.copied_bytes == 0 and stats.reused_files == stats.files


def test_bad_worker_count_is_refused(dataset, tmp_path, capsys):
    rc, _, err = cli("--src", str(dataset), "--dst", str(tmp_path / "d"), "--workers", "0",
                     capsys=capsys)
    assert rc == 2
    one_line_error(err, "--workers must be at least 1")


def test_another_dataset_is_refused_unless_overwrite(dataset, tmp_path, capsys):
    other = make_dataset(tmp_path / "other", seed=1, shards=3)
    dst = tmp_path / "dst"
    stage(other, dst, progress=False)
    (dst / "notes.txt").write_text("the user's own file")
    rc, _, err = cli("--src", str(dataset), "--dst", str(dst), capsys=capsys)
    assert rc == 2
    one_line_error(err, str(dst), "another dataset", "--overwrite")
    assert files_of(dst)["train_00000.bin"] == (other / "train_00000.bin").read_bytes()
    rc, _, _ = cli("--src", str(dataset), "--dst", str(dst), "--overwrite", capsys=capsys)
    assert rc == 0
    assert (dst / "notes.txt").read_text() == "the user's own file"
    assert not (dst / "val_00002.bin").exists()  # only the old dataset had it
    got = files_of(dst)
    for name, data in files_of(dataset).items():
        assert got[name] == data


def test_a_partial_stage_of_another_dataset_is_refused(dataset, tmp_path, capsys):
    other = make_dataset(tmp_path / "other", seed=1, shards=3)
    dst = tmp_path / "dst"
    stage(other, dst, progress=False)
    (dst / MANIFEST).unlink()  # interrupted just before the end
    rc, _, err = cli("--src", str(dataset), "--dst", str(dst), capsys=capsys)
    assert rc == 2
    one_line_error(err, "another dataset")


def test_foreign_manifest_without_tokenizer_file_list(tmp_path, capsys):
    src = make_dataset(tmp_path / "src", file_list=False)
    dst = tmp_path / "dst"
    stats = stage(src, dst, progress=False)
    assert stats.files == 8 + 2
    assert_same_dataset(src, dst)
    (src / "tokenizer" / "tokenizer.json").write_text("{}")  # no longer the fingerprinted one
    rc, _, err = cli("--src", str(src), "--dst", str(tmp_path / "dst2"), capsys=capsys)
    assert rc == 2
    one_line_error(err, "tokenizer.json", "fingerprint")


def test_cli_end_to_end_shows_progress_and_summary(dataset, tmp_path):
    r = subprocess.run([sys.executable, "-m", "data_tools", "stage", "--src", str(dataset),
                        "--dst", str(tmp_path / "dst"), "--workers", "2"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "MB/s" in r.stderr or "kB/s" in r.stderr  # the tqdm bar
    assert r.stdout.startswith(f"staged {tmp_path / 'dst'}: 10 files")
    assert_same_dataset(dataset, tmp_path / "dst")


def test_a_prepared_dataset_stages_and_verifies(mlm_dataset, tmp_path, capsys):
    """The real `prepare` output (shared fixture), staged, passes `inspect --verify` at dst."""
    dst = tmp_path / "local"
    stats = stage(mlm_dataset, dst, progress=False)
    assert stats.copied_files == stats.files
    assert (dst / MANIFEST).read_bytes() == (mlm_dataset / MANIFEST).read_bytes()
    capsys.readouterr()
    assert data_tools_main(["inspect", str(dst), "--verify"]) == 0


def test_malformed_manifest_entries_are_refused(tmp_path, capsys):
    src = make_dataset(tmp_path / "src", shards=2)
    manifest = json.loads((src / MANIFEST).read_text())
    manifest["splits"]["train"]["shards"].append(manifest["splits"]["train"]["shards"][0])
    write_manifest(src, manifest)
    rc, _, err = cli("--src", str(src), "--dst", str(tmp_path / "d"), capsys=capsys)
    assert rc == 2
    one_line_error(err, str(src / MANIFEST), "train_00000.bin twice")
    manifest["splits"]["train"]["shards"][-1] = {**manifest["splits"]["train"]["shards"][0],
                                                 "name": "../../etc/x", "bin_bytes": "many"}
    write_manifest(src, manifest)
    rc, _, err = cli("--src", str(src), "--dst", str(tmp_path / "d"), capsys=capsys)
    assert rc == 2
    one_line_error(err, str(src / MANIFEST))
