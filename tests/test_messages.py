"""Each message says what happened (issue 24, "Words that say what happened")."""
import os
import re
from types import SimpleNamespace

import pytest

from data_tools import errors, output, stage
from data_tools.errors import Stopped, UserError


def _statvfs(favail):
    real = os.statvfs

    def fake(path):
        st = real(path)
        return SimpleNamespace(**{k: getattr(st, k) for k in dir(st) if k.startswith("f_")}
                               | {"f_favail": favail})
    return fake


def test_disk_full_without_inodes_says_inodes(tmp_path, monkeypatch):
    monkeypatch.setattr(errors.os, "statvfs", _statvfs(0))
    msg = errors.disk_full_message(tmp_path / "x.bin")
    assert msg.startswith("out of inodes (no free file entries) on /")
    assert "disk space" not in msg


def test_disk_full_with_inodes_says_disk_space(tmp_path, monkeypatch):
    monkeypatch.setattr(errors.os, "statvfs", _statvfs(100))
    msg = errors.disk_full_message(tmp_path / "x.bin", needed=10 << 20)
    assert msg.startswith(f"out of disk space writing {tmp_path / 'x.bin'}")


def test_a_dangling_symlink_out_is_named_as_one(tmp_path):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone")
    want = f"is a symlink to {tmp_path / 'gone'}, which does not exist"
    with pytest.raises(UserError, match=re.escape(f"--out {link}: {want}")):
        output.claim(link, "dataset", "prepare", overwrite=False)
    with pytest.raises(UserError, match=re.escape(want)):
        output.make_dirs(link)
    with pytest.raises(UserError, match=re.escape(f"--dst {link}: {want}")):
        stage._prepare_dst(link)


def test_a_second_sweep_is_refused_in_one_line(tmp_path, capsys):
    from app.sweep import command
    p = errors.Parser(prog="app bench")
    command.add_arguments(p)
    base = ["--data", str(tmp_path), "--out", str(tmp_path / "o")]
    assert p.parse_args(base + ["--sweep", "world=1,2", "zero=0"]).sweep == ["world=1,2", "zero=0"]
    with pytest.raises(SystemExit) as e:
        p.parse_args(base + ["--sweep", "world=1,2", "--sweep", "zero=0,3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "app bench: error: --sweep given twice: put every key in one --sweep\n"


def test_export_says_which_step_and_that_the_run_went_further(tmp_path):
    from app import export
    run = tmp_path / "run"
    (run / "checkpoints" / "global_step5").mkdir(parents=True)
    assert export.step_note(run, "global_step5") == "exporting global_step5 (step 5)"
    (run / "metrics.jsonl").write_text(
        "".join(f'{{"step": {s}, "tokens_seen": {s * 64}}}\n' for s in (4, 8, 12)))
    assert export.step_note(run, "global_step5") == (
        "exporting global_step5 (step 5); the run reached step 12: the steps after 5 are not in "
        "this export (no checkpoint holds them)")
    (run / "checkpoints" / "global_step10").mkdir()
    (run / "summary.json").write_text('{"steps": 10, "tokens_seen": 640}')
    assert export.step_note(run, "global_step10").endswith(
        "the run reached step 12: the steps after 10 are not in this export "
        "(no checkpoint holds them)")
    assert "(no checkpoint" not in export.step_note(run, "global_step5")
    (run / "metrics.jsonl").unlink()
    assert export.step_note(run, "global_step10") == "exporting global_step10 (step 10)"


def test_resume_past_max_steps_is_refused(tmp_path, monkeypatch):
    from app import settle
    monkeypatch.setattr(settle.tags, "read_state", lambda d, tag: {"step": 12})
    resume = (tmp_path / "checkpoints", "global_step12")
    where = tmp_path / "checkpoints" / "global_step12"
    cfg = SimpleNamespace(max_steps=5, max_tokens=None)
    with pytest.raises(UserError, match=re.escape(
            f"{where}: the checkpoint is at step 12, past --max-steps 5")):
        settle.check_steps_left(resume, 5, cfg)
    with pytest.raises(UserError, match=re.escape(
            f"{where}: the checkpoint is at step 12, past --max-tokens 640 (10 steps)")):
        settle.check_steps_left(resume, 10, SimpleNamespace(max_steps=20, max_tokens=640))
    at_end = SimpleNamespace(max_steps=12, max_tokens=None, out=tmp_path)
    settle.check_steps_left(resume, 12, at_end)  # no summary: it died before it, resume it
    (tmp_path / "summary.json").write_text('{"steps": 12, "tokens_seen": 1}')
    with pytest.raises(Stopped, match=re.escape(  # finished: its rerun changes nothing
            f"{tmp_path}: the run finished at step 12 (--max-steps 12): nothing left to train, "
            f"nothing was changed")) as stopped:
        settle.check_steps_left(resume, 12, at_end)
    assert stopped.value.code == 0
    settle.check_steps_left(None, 5, cfg)


def test_convert_names_its_own_arguments(tmp_path, capsys):
    from app.__main__ import main
    from app.checkpoint import universal
    rc = main(["convert", str(tmp_path / "nothing"), "--to-zero", "3", "--to-world", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and f"CKPT {tmp_path / 'nothing'}: no such file" in err and "--resume" not in err
    (tmp_path / "empty").mkdir()
    assert main(["convert", str(tmp_path / "empty"), "--to-zero", "3", "--to-world", "2"]) == 2
    err = capsys.readouterr().err
    assert f"CKPT {tmp_path / 'empty'}: no checkpoint there" in err and "--resume" not in err
    bf16 = universal.Layout(0, 1, "bf16", False)
    assert "; use --to-zero 1" in universal.convertible_into(bf16, "--to-zero")
    assert "; use --zero 1" in universal.convertible_into(bf16)


def test_a_probe_that_timed_out_is_not_out_of_memory(tmp_path):
    from app.plan.probe import _failure
    log = tmp_path / "run.log"
    log.write_text("[node0 rank1] RuntimeError: [Rank 1] Watchdog caught collective operation "
                   "timeout: WorkNCCL(OpType=ALLREDUCE) ran for 600000 ms before timing out\n")
    assert _failure(137, log).startswith("timeout: RuntimeError: [Rank 1] Watchdog caught")
    log.write_text("timeout: sending signal KILL to command 'launch.sh'\n")
    assert _failure(137, log) == "timeout: timeout: sending signal KILL to command 'launch.sh'"
    log.write_text("[node0 rank1] rank 1: no progress for 4 s (--hang-timeout 3) while x\n")
    assert _failure(137, log).startswith("failed: rank 1: no progress for 4 s")
    # the kernel's OOM killer, and a rank's own OOM, are still out of memory
    log.write_text("[node0 rank0] step 1\n")
    assert _failure(137, log) == "out of memory"
    log.write_text("[node0 rank0] torch.OutOfMemoryError: CUDA out of memory\n"
                   "[node0 rank1] RuntimeError: Timed out waiting for rank 0\n")
    assert _failure(1, log) == "out of memory"
    # a real error on one rank is the cause, not the others' timeouts after it
    log.write_text("[node0 rank0] ValueError: the real cause\n"
                   "[node0 rank1] RuntimeError: Timed out waiting for rank 0\n")
    assert _failure(1, log) == "failed: ValueError: the real cause"
