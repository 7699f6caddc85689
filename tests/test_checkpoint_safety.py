"""Checkpoints never lose a run: a damaged `latest` or a resume into another run's directory
never trains over what is there, and every tag carries a manifest (app/checkpoint/manifest.py)
that a resume, a rollback, `app convert` and `app export` verify, naming the file that is wrong.
Real `app train` runs of bert-tiny on CPU (a world of one)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from app.checkpoint import manifest
from data_tools.errors import UserError
from tests.helpers import TINY, check, error_lines, flip, metrics, run_app, snapshot

BASE = [*TINY, "--save-every", "5", "--dropout", "0"]
TAG5, TAG10 = "global_step5", "global_step10"


SLOW = pytest.mark.slow  # the tests that read run0 (its fixture trains)


@pytest.fixture(scope="module")
def run0(mlm_dataset, tmp_path_factory) -> Path:
    """A run of 10 steps with checkpoints at 5 and 10."""
    run = tmp_path_factory.mktemp("safety") / "run0"
    check(run_app("train", "--data", mlm_dataset, "--out", run, *BASE, "--max-steps", "10"))
    return run


def copy_of(run: Path, to: Path) -> Path:
    return Path(shutil.copytree(run, to / run.name))


def resume(data: Path, run: Path, *extra: str):
    return run_app("train", "--data", data, "--out", run, *BASE, "--max-steps", "12", *extra)


def one_line(proc) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in error_lines(proc.stderr) if "error" in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def logged_steps(run: Path) -> list[int]:
    return [m["step"] for m in metrics(run) if "train/loss" in m]




# -- 1. a damaged `latest` ----------------------------------------------------------------------

@SLOW
@pytest.mark.parametrize("damage", ["deleted", "empty", "garbage"])
def test_a_damaged_latest_resumes_the_newest_complete_tag(run0, mlm_dataset, tmp_path, damage):
    """Before: `latest` gone meant a run from step 0 over global_step5/10 and the metrics."""
    run = copy_of(run0, tmp_path)
    latest = run / "checkpoints" / "latest"
    {"deleted": latest.unlink, "empty": lambda: latest.write_text(""),
     "garbage": lambda: latest.write_text("global_step")}[damage]()
    before = snapshot(run / "checkpoints" / TAG5)
    steps = logged_steps(run)
    proc = check(resume(mlm_dataset, run))
    assert snapshot(run / "checkpoints" / TAG5) == before
    assert logged_steps(run)[:len(steps)] == steps and max(logged_steps(run)) == 12
    assert min(logged_steps(run)[len(steps):]) > 10
    assert "resuming from global_step10, the newest complete checkpoint" in proc.stderr
    assert "at step 10" in proc.stderr


@SLOW
def test_no_complete_tag_is_refused_naming_what_is_there(run0, mlm_dataset, tmp_path):
    run = copy_of(run0, tmp_path)
    (run / "checkpoints" / "latest").unlink()
    for tag in (TAG5, TAG10):
        (run / "checkpoints" / tag / "mp_rank_00_model_states.pt").unlink()
    before = snapshot(run)
    line = one_line(resume(mlm_dataset, run))
    assert "no complete checkpoint" in line and TAG5 in line and TAG10 in line
    assert snapshot(run) == before


@SLOW
def test_a_complete_tag_newer_than_latest_is_resumed_not_deleted(run0, mlm_dataset, tmp_path):
    run = copy_of(run0, tmp_path)
    (run / "checkpoints" / "latest").write_text(TAG5)
    proc = check(resume(mlm_dataset, run))
    assert "at step 10" in proc.stderr and "removed" not in proc.stderr


@SLOW
def test_an_interrupted_save_is_known_by_its_own_mark(run0, mlm_dataset, tmp_path):
    """A save writes `.saving` first and removes it after the manifest: a tag with the mark
    and no manifest is a save this app began and did not finish, the only tag it deletes."""
    run = copy_of(run0, tmp_path)
    (run / "checkpoints" / TAG10 / manifest.NAME).unlink()
    (run / "checkpoints" / TAG10 / manifest.SAVING).write_text(TAG10)
    proc = check(resume(mlm_dataset, run))
    assert f"removed {run / 'checkpoints' / TAG10}: an interrupted save" in proc.stderr
    assert "at step 5" in proc.stderr


@SLOW
def test_a_complete_tag_whose_manifest_was_deleted_keeps_its_files(run0, mlm_dataset, tmp_path):
    """Before: removed as "an interrupted save", every intact data file with it. Without its
    save's `.saving` mark it is no interrupted save: its files pass the structure check, so it
    is resumed as a tag made before manifests is, said to be unverified; cut short, it is set
    aside as TAG.unverified, its files kept, and the previous tag resumed."""
    run = copy_of(run0, tmp_path)
    model = run / "checkpoints" / TAG10 / "mp_rank_00_model_states.pt"
    data = model.read_bytes()
    (run / "checkpoints" / TAG10 / manifest.NAME).unlink()
    proc = check(resume(mlm_dataset, run))
    assert "removed" not in proc.stderr and "at step 10" in proc.stderr
    assert f"{run / 'checkpoints' / TAG10}: its manifest.json is missing" in proc.stderr
    assert model.read_bytes() == data
    run = copy_of(run0, tmp_path / "cut")
    model = run / "checkpoints" / TAG10 / "mp_rank_00_model_states.pt"
    (run / "checkpoints" / TAG10 / manifest.NAME).unlink()
    os.truncate(model, model.stat().st_size // 2)
    cut = model.read_bytes()
    proc = check(resume(mlm_dataset, run))
    assert "removed" not in proc.stderr and "at step 5" in proc.stderr
    assert f"moved {run / 'checkpoints' / TAG10} aside to {TAG10}.unverified" in proc.stderr
    assert (run / "checkpoints" / f"{TAG10}.unverified" / model.name).read_bytes() == cut


@SLOW
def test_an_empty_manifest_over_damaged_weights_is_not_resumed(run0, mlm_dataset, tmp_path):
    """Before: `"files": {}` verified, and the damaged weights of global_step10 were resumed."""
    run = copy_of(run0, tmp_path)
    flip(run / "checkpoints" / TAG10 / "mp_rank_00_model_states.pt")
    manifest.write(run / "checkpoints" / TAG10, {})
    proc = check(resume(mlm_dataset, run))
    assert "lists no files" in proc.stderr and "at step 5" in proc.stderr
    assert (run / "checkpoints" / f"{TAG10}.damaged").is_dir()


# -- 2. --resume PATH into another run ----------------------------------------------------------

@SLOW
def test_resume_into_another_runs_directory_is_refused(run0, mlm_dataset, tmp_path):
    """Before: run0 continued inside rb, rb's checkpoints pruned, both runs in one metrics."""
    rb = tmp_path / "rb"
    check(run_app("train", "--data", mlm_dataset, "--out", rb, *TINY, "--save-every", "2",
                  "--max-steps", "4"))
    before = snapshot(rb)
    line = one_line(resume(mlm_dataset, rb, "--resume", run0 / "checkpoints" / TAG5))
    assert "holds another run" in line and "--resume auto" in line
    assert snapshot(rb) == before


@SLOW
def test_a_fresh_out_may_resume_another_runs_tag(run0, mlm_dataset, tmp_path):
    proc = check(resume(mlm_dataset, tmp_path / "fresh", "--resume", run0 / "checkpoints" / TAG5))
    assert "at step 5" in proc.stderr


# -- 3. manifests: damage found and named -------------------------------------------------------

@SLOW
def test_corrupt_model_states_resume_auto_takes_the_previous_tag(run0, mlm_dataset, tmp_path):
    run = copy_of(run0, tmp_path)
    flip(run / "checkpoints" / TAG10 / "mp_rank_00_model_states.pt")
    proc = check(resume(mlm_dataset, run))
    assert "mp_rank_00_model_states.pt: checksum" in proc.stderr
    assert "resuming from global_step5" in proc.stderr and "at step 5" in proc.stderr
    assert (run / "checkpoints" / f"{TAG10}.damaged").is_dir()  # set aside, not deleted


@SLOW
@pytest.mark.parametrize("damage", ["flip", "rng_deleted"])
def test_a_damaged_explicit_tag_is_refused_naming_the_file(run0, mlm_dataset, tmp_path, damage):
    src = copy_of(run0, tmp_path)
    tag = src / "checkpoints" / TAG10
    name = "mp_rank_00_model_states.pt" if damage == "flip" else "rng_rank0.pt"
    flip(tag / name) if damage == "flip" else (tag / name).unlink()
    line = one_line(resume(mlm_dataset, tmp_path / "new", "--resume", tag))
    assert f"{tag / name}:" in line
    assert not (tmp_path / "new").exists()


@SLOW
def test_export_and_convert_name_a_corrupt_file(run0, tmp_path):
    run = copy_of(run0, tmp_path)
    bad = run / "checkpoints" / TAG10 / "mp_rank_00_model_states.pt"
    flip(bad)
    line = one_line(run_app("export", run, "--out", tmp_path / "hf"))
    assert f"{bad}: checksum" in line
    line = one_line(run_app("convert", run, "--to-zero", "1", "--to-world", "1"))
    assert f"{bad}: checksum" in line


@SLOW
def test_a_tag_made_before_manifests_resumes_unverified(run0, mlm_dataset, tmp_path):
    run = copy_of(run0, tmp_path)
    for tag in (TAG5, TAG10):
        (run / "checkpoints" / tag / manifest.NAME).unlink()
        state_file = run / "checkpoints" / tag / "train_state.json"
        state = json.loads(state_file.read_text())
        del state["manifest"]
        state_file.write_text(json.dumps(state))
    proc = check(resume(mlm_dataset, run))
    assert "made before checkpoint manifests" in proc.stderr and "at step 10" in proc.stderr


@SLOW
def test_every_new_tag_has_a_manifest_of_all_its_files(run0):
    for tag in (TAG5, TAG10):
        tag_dir = run0 / "checkpoints" / tag
        listed = json.loads((tag_dir / manifest.NAME).read_text())["files"]
        on_disk = {p.name for p in tag_dir.iterdir() if p.name != manifest.NAME}
        assert set(listed) == on_disk and {"rng_rank0.pt", "train_state.json"} <= on_disk
        assert manifest.verify(tag_dir)


# -- manifest units -----------------------------------------------------------------------------

def test_writer_of_names_the_rank_that_writes_each_file():
    assert manifest.writer_of("rng_rank3.pt") == 3
    assert manifest.writer_of("bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt") == 12
    assert manifest.writer_of("zero_pp_rank_1_mp_rank_00_model_states.pt") == 1
    assert manifest.writer_of("mp_rank_00_model_states.pt") == 0
    assert manifest.writer_of("train_state.json") == 0


def test_verify_names_a_missing_resized_or_changed_file(tmp_path):
    def rewrite(data: bytes, when: int) -> None:  # a later change (verify remembers good files)
        (tmp_path / "a.pt").write_bytes(data)
        os.utime(tmp_path / "a.pt", ns=(when, when))

    (tmp_path / "a.pt").write_bytes(b"x" * 1000)
    (tmp_path / "rng_rank1.pt").write_bytes(b"y" * 10)
    assert manifest.verify(tmp_path) is False  # no manifest: made before them
    entries = manifest.own_entries(tmp_path, 0)
    assert set(entries) == {"a.pt"}  # rank 1's file is rank 1's to hash
    manifest.write(tmp_path, {**entries, **manifest.own_entries(tmp_path, 1)})
    assert manifest.verify(tmp_path) is True
    rewrite(b"x" * 999 + b"z", 10**18)
    with pytest.raises(UserError, match=r"a\.pt: checksum xxh3_64 differs"):
        manifest.verify(tmp_path)
    rewrite(b"x" * 10, 2 * 10**18)
    with pytest.raises(UserError, match=r"a\.pt: 10 bytes, 1000 when saved"):
        manifest.verify(tmp_path)
    rewrite(b"x" * 1000, 3 * 10**18)
    assert manifest.verify(tmp_path) is True
    (tmp_path / "rng_rank1.pt").unlink()
    with pytest.raises(UserError, match=r"rng_rank1\.pt: missing"):
        manifest.verify(tmp_path)
    os.mkfifo(tmp_path / "rng_rank1.pt")  # never opened: a FIFO would block the read
    with pytest.raises(UserError, match=r"rng_rank1\.pt: not a regular file \(listed in"):
        manifest.verify(tmp_path)


def test_a_manifest_verifies_only_when_it_covers_every_file(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"a" * 10)
    (tmp_path / "rng_rank0.pt").write_bytes(b"b" * 10)
    manifest.write(tmp_path, {})
    with pytest.raises(UserError, match="lists no files: an empty manifest verifies nothing"):
        manifest.verify(tmp_path)
    manifest.write(tmp_path, {k: v for k, v in manifest.own_entries(tmp_path, 0).items()
                              if k == "a.pt"})
    with pytest.raises(UserError, match=r"rng_rank0\.pt: not listed in manifest\.json"):
        manifest.verify(tmp_path)
    manifest.write(tmp_path, manifest.own_entries(tmp_path, 0))
    (tmp_path / manifest.SAVING).write_text("x")  # the save's own mark is not of the tag
    assert manifest.verify(tmp_path) is True


def test_a_model_directory_is_checked_whole_before_its_weights_are_read(tmp_path):
    """Before: a truncated model.safetensors given to --init-from was a traceback."""
    from safetensors.torch import save_file

    from app.checkpoint.weights import check_export

    save_file({"w": torch.arange(1000, dtype=torch.float32)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    check_export(tmp_path, "--init-from")  # a downloaded model: no manifest, structure only
    manifest.write(tmp_path, manifest.own_entries(tmp_path, 0))  # as `app export` writes it
    check_export(tmp_path, "--init-from")
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    with pytest.raises(UserError, match=r"model\.safetensors: \d+ bytes, \d+ when saved"):
        check_export(tmp_path, "--init-from")
    (tmp_path / manifest.NAME).unlink()
    with pytest.raises(UserError, match=r"model\.safetensors: \d+ bytes, its header promises"):
        check_export(tmp_path, "--init-from")
    weights.write_bytes(data[:5])
    with pytest.raises(UserError, match=r"model\.safetensors: not a whole safetensors file"):
        check_export(tmp_path, "--init-from")


def test_checksums_of_several_files_at_once_are_those_of_one_at_a_time(tmp_path, monkeypatch):
    """The threads only share the work: each digest is its own file's, in order."""
    files = []
    for i, size in enumerate((0, 1, 3 << 20, 100, 1 << 20)):
        files.append(tmp_path / f"f{i}")
        files[-1].write_bytes(os.urandom(size))
    serial = [manifest.checksum(f) for f in files]
    assert len(set(serial)) == len(files)
    monkeypatch.setattr(manifest, "HASH_THREADS", 3)
    assert manifest.checksums(files) == serial
    monkeypatch.setattr(manifest, "HASH_THREADS", 1)
    assert manifest.checksums(files) == serial


def test_latest_problem_says_what_latest_is(tmp_path):
    from app.checkpoint import tags

    latest = tmp_path / "latest"
    assert tags.latest_problem(tmp_path) == f"{latest} is missing"
    latest.symlink_to(tmp_path / "nowhere")
    assert tags.latest_problem(tmp_path) == f"{latest} is a dangling link"
    latest.unlink()
    os.mkfifo(latest)  # never opened: a FIFO would block the read
    assert tags.latest_problem(tmp_path) == f"{latest} is not a regular file"
    assert tags.latest_tag(tmp_path) is None
    latest.unlink()
    latest.write_text("global_step5")
    assert tags.latest_problem(tmp_path) == f"{latest} names no checkpoint ('global_step5')"
    (tmp_path / TAG5).mkdir()
    assert tags.latest_problem(tmp_path) is None and tags.latest_tag(tmp_path) == TAG5
