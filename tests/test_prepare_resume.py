"""Resumable prepare: a run killed (SIGKILL, Ctrl-C, a full disk) after some shards completed
keeps them, and `--resume` finishes byte-identical to an uninterrupted run without tokenizing
them again; a resume that would not be (other inputs, tokenizer or flags) is refused with the
reason."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.plan.probe import group_pids
from data_tools.__main__ import main as data_tools_main
from data_tools.manifest import MANIFEST, load_manifest
from data_tools.resume import JOURNAL
from tests.helpers import default_sigint, snapshot, tmpfs
from tests.test_prepare import shard_bytes

REPO = Path(__file__).resolve().parents[1]


def prepare(*argv) -> int:
    return data_tools_main(["prepare", *map(str, argv)])


@pytest.fixture
def job(stdlib_dir, wordpiece_tokenizer, tmp_path):
    """A prepare command with small shards, and its uninterrupted result."""
    args = ["--input", stdlib_dir, "--include", "*.py", "--tokenizer", wordpiece_tokenizer,
            "--val-fraction", "0.05", "--shard-tokens", "20000"]
    assert prepare(*args, "--out", tmp_path / "whole", "--workers", "1") == 0
    return args


def start(args: list, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "data_tools", "prepare", *map(str, args),
                             "--out", str(out), *extra],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint, start_new_session=True)


def wait_for_shards(out: Path, n: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while len(list(out.glob("*.bin"))) < n and time.monotonic() < deadline:
        assert proc.poll() is None, "prepare finished before it could be interrupted"
        time.sleep(0.01)


def completed(out: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of each completed shard file (the journal's), to see they are not redone."""
    names = [json.loads(line)["closed"]["shard"]["name"]
             for line in (out / JOURNAL).read_text().splitlines()[1:] if line.strip()]
    return {f"{n}.{ext}": ((out / f"{n}.{ext}").stat().st_ino,
                           (out / f"{n}.{ext}").stat().st_mtime_ns)
            for n in names for ext in ("bin", "idx")}


@pytest.mark.slow  # two prepares of the whole corpus and a resume
def test_sigkill_then_resume_is_byte_identical(job, tmp_path, capsys):
    out = tmp_path / "cut"
    proc = start(job, out, "--workers", "2", "--batch-chars", "4000")
    wait_for_shards(out, 4, proc)
    # its group: the fork server and the two tokenizer workers it forked (app/plan/probe.py)
    workers = [pid for pid in group_pids(proc.pid) if pid != proc.pid]
    assert len(workers) >= 2
    proc.kill()
    proc.wait()
    assert not (out / MANIFEST).exists() and (out / JOURNAL).exists()
    deadline = time.monotonic() + 10  # the tokenizer workers follow their parent
    while any(Path(f"/proc/{w}").exists() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{w}").exists() for w in workers)
    done = completed(out)
    assert done
    assert prepare(*job, "--out", out, "--workers", "1", "--resume") == 0
    said = capsys.readouterr().out
    assert f"{len(done) // 2} completed shards kept" in said and "not tokenized again" in said
    assert completed_now(out, done) == done  # the same files, not rewritten
    assert shard_bytes(out) == shard_bytes(tmp_path / "whole")
    a, b = load_manifest(out), load_manifest(tmp_path / "whole")
    for key in ("splits", "fingerprint", "source", "documents", "tokens"):
        assert a[key] == b[key], key
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp_path / "whole")
                                                           .iterdir())  # no journal left


def completed_now(out: Path, before: dict) -> dict:
    return {name: ((out / name).stat().st_ino, (out / name).stat().st_mtime_ns)
            for name in before}


def test_ctrl_c_keeps_completed_shards_and_resume_continues(job, tmp_path):
    out = tmp_path / "cut"
    proc = start(job, out, "--workers", "1", "--batch-chars", "4000")
    wait_for_shards(out, 3, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "completed shards kept" in err and "--resume" in err
    assert not (out / MANIFEST).exists() and (out / JOURNAL).exists()
    assert prepare(*job, "--out", out, "--workers", "2") == 2  # no --resume: refused, kept
    assert prepare(*job, "--out", out, "--workers", "2", "--resume") == 0
    assert shard_bytes(out) == shard_bytes(tmp_path / "whole")


def test_full_disk_keeps_completed_shards_then_resume(job, tmp_path, one_line_error):
    with tmpfs(tmp_path / "mnt", "400k") as mnt:
        out = mnt / "d"
        assert prepare(*job, "--out", out, "--workers", "1") == 2
        line = one_line_error("out of disk space writing", "completed shards kept", "--resume")
        assert not (out / MANIFEST).exists()
        subprocess.run(["mount", "-o", "remount,size=20m", str(mnt)], check=True)
        assert prepare(*job, "--out", out, "--workers", "1", "--resume") == 0, line
        assert shard_bytes(out) == shard_bytes(tmp_path / "whole")


@pytest.fixture
def interrupted(tmp_path, stdlib_dir, wordpiece_tokenizer, one_line_error):
    """A run stopped by a bad line in its second input after several shards were complete."""
    good = tmp_path / "in" / "a.jsonl"
    good.parent.mkdir()
    texts = [p.read_text(encoding="utf-8") for p in sorted((stdlib_dir / "json").glob("*.py"))]
    good.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts * 3))
    bad = tmp_path / "in" / "b.jsonl"
    bad.write_text('{"text": "fine"}\n{broken\n')
    args = ["--input", good, bad, "--tokenizer", wordpiece_tokenizer, "--val-fraction", "0.1",
            "--shard-tokens", "5000", "--workers", "1", "--batch-chars", "1000"]
    out = tmp_path / "out"
    assert prepare(*args, "--out", out) == 2
    one_line_error(f"{bad}:2", "malformed JSON", "completed shards kept", "--resume")
    return {"args": args, "out": out, "good": good, "bad": bad}


def test_resume_refuses_other_inputs_tokenizer_or_flags(interrupted, bpe_tokenizer, tmp_path,
                                                        one_line_error):
    args, out = interrupted["args"], interrupted["out"]
    before = snapshot(out)
    assert prepare(*args, "--out", out) == 2
    one_line_error(str(out), "interrupted prepare", "--resume", "--overwrite")
    changes = {"--val-fraction": "0.2", "--shard-tokens": "6000", "--dtype-code": "megatron",
               "--text-key": "body", "--include": "*.jsonl", "--tokenizer": bpe_tokenizer}
    for flag, value in changes.items():
        i = args.index(flag) if flag in args else None
        changed = args[:i] + [flag, value] + args[i + 2:] if i is not None else \
            args + [flag, value]
        assert prepare(*changed, "--out", out, "--resume") == 2, flag
        one_line_error(str(out), "cannot resume",
                       "tokenizer changed" if flag == "--tokenizer" else flag)
    assert prepare(*args, "--out", out, "--resume", "--overwrite") == 2
    one_line_error("--resume and --overwrite")
    with open(interrupted["good"], "a") as f:  # read before the checkpoint: now different
        f.write(json.dumps({"text": "one more"}) + "\n")
    assert prepare(*args, "--out", out, "--resume") == 2
    one_line_error("cannot resume", str(interrupted["good"]), "changed")
    assert snapshot(out) == before  # nothing was changed by a refusal


def test_resume_after_fixing_a_later_input(interrupted, tmp_path):
    """Inputs past the checkpoint are read as they are now, as an uninterrupted run would."""
    args, out = interrupted["args"], interrupted["out"]
    interrupted["bad"].write_text('{"text": "fine"}\n{"text": "fixed"}\n')
    assert prepare(*args, "--out", tmp_path / "whole") == 0
    assert prepare(*args, "--out", out, "--resume") == 0
    assert shard_bytes(out) == shard_bytes(tmp_path / "whole")
    assert load_manifest(out)["source"] == load_manifest(tmp_path / "whole")["source"]


def test_resume_with_nothing_to_resume_or_already_complete(
        tmp_path, stdlib_dir, wordpiece_tokenizer, capsys, one_line_error):
    args = ["--input", stdlib_dir / "json", "--include", "*.py", "--tokenizer",
            wordpiece_tokenizer, "--workers", "1", "--out", tmp_path / "d"]
    assert prepare(*args, "--resume") == 0  # a job script may always pass --resume
    assert "nothing to resume" in capsys.readouterr().err
    before = snapshot(tmp_path / "d")
    assert prepare(*args, "--resume") == 0
    assert "already complete" in capsys.readouterr().out
    assert prepare(*args, "--resume", "--val-fraction", "0.3") == 2
    one_line_error("already holds a complete dataset", "--val-fraction", "--overwrite")
    assert snapshot(tmp_path / "d") == before
    assert os.listdir(tmp_path / "d").count(JOURNAL) == 0
