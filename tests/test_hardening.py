"""Nothing a user made is ever lost, and every bad input is one line: one test per class of
failure, over the commands it touches, with real files, real permissions (root's capabilities
dropped, as root would bypass them), and a real small tmpfs for a full disk.

Classes (docs/design.md, "Outputs" and "Reading back"):
1. --overwrite removes only the command's own earlier output, never an input or a stranger;
2. a write that fails (read-only, a file in the way, a full disk) is one line naming the path,
   leaves nothing half-written, and a failed checkpoint save keeps `latest` where it was;
3. files the project wrote are read back through a schema: a bad one names file and key;
4. values handed to libraries are checked first (model fields, DeepSpeed keys, non-finite
   numbers);
5. a resume that would reinterpret the sample position is refused.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from app.__main__ import main as app_main
from data_tools.__main__ import main as data_tools_main
from tests.helpers import (
    TINY,
    check,
    error_lines,
    python,
    remanifest,
    run_app,
    snapshot,
    tmpfs,
)

pytestmark = pytest.mark.slow


def main(argv: list) -> int:
    """The command in this process; a flag argparse refuses exits 2 (SystemExit) as it would."""
    argv = [str(a) for a in argv]
    try:
        return (data_tools_main if argv[0] in ("tokenizer", "prepare", "inspect", "stage")
                else app_main)(argv)
    except SystemExit as e:
        return int(e.code)


def one_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.replace("\r", "\n").splitlines()
             if ln.strip() and ": error: " in ln]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# `python -m MODULE ARGV` (as tests/zygote.py runs it), after the process has dropped root's
# capabilities where asked: what `setpriv --inh-caps=-all --bounding-set=-all` (tests/helpers.py
# NO_CAPS) leaves a fresh root process, so file permissions apply as to any user
AS_MODULE = """import ctypes, runpy, sys
caps, module = sys.argv[1:3]
if caps == "drop":
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    none = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: empty, in both words
    if ctypes.CDLL(None, use_errno=True).capset(header, none) != 0:
        raise OSError(ctypes.get_errno(), "capset")
sys.argv = [module, *sys.argv[3:]]
sys.modules.pop(module + ".__main__", None)
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def cli(*argv, caps: bool = True) -> subprocess.CompletedProcess:
    """`python -m data_tools|app ARGV` in its own process (a fork of the warm process: the
    commands' imports are not what is tested), optionally without root's powers."""
    module = "data_tools" if argv[0] in ("tokenizer", "prepare", "inspect", "stage") else "app"
    return python("-c", AS_MODULE, "keep" if caps else "drop", module, *argv)


def proc_one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in error_lines(proc.stderr) if ": error: " in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def world(mlm_dataset, wordpiece_tokenizer, stdlib_dir, tmp_path_factory):
    """Inputs of every command, each in a directory of its own (so 'contains' can be tried),
    and a finished run with two checkpoints."""
    root = tmp_path_factory.mktemp("hardening")
    corpus = root / "corpus_holder" / "corpus"
    shutil.copytree(stdlib_dir / "json", corpus)
    tok = root / "tok_holder" / "tok"
    shutil.copytree(wordpiece_tokenizer, tok)
    data = root / "data_holder" / "data"
    shutil.copytree(mlm_dataset, data)
    run = root / "run_holder" / "run"
    check(run_app("train", "--data", data, "--out", run, *TINY, "--max-steps", "4",
                  "--save-every", "2", "--log-every", "1"))
    return {"corpus": corpus, "tok": tok, "data": data, "run": run, "root": root}


def command(name: str, w: dict, out: Path) -> list:
    """Each command that writes a directory, with --overwrite, writing to `out`."""
    return {
        "tokenizer": ["tokenizer", "--input", w["corpus"], "--include", "*.py", "--out", out,
                      "--vocab-size", "300", "--overwrite"],
        "prepare": ["prepare", "--input", w["corpus"], "--include", "*.py", "--tokenizer",
                    w["tok"], "--out", out, "--workers", "1", "--overwrite"],
        "stage": ["stage", "--src", w["data"], "--dst", out, "--overwrite", "--quiet"],
        "export": ["export", w["run"], "--out", out, "--overwrite"],
        "train": ["train", "--data", w["data"], "--out", out, "--overwrite", *TINY,
                  "--max-steps", "2"],
    }[name]


INPUT_OF = {"tokenizer": "corpus", "prepare": "corpus", "stage": "data", "export": "run",
            "train": "data"}


# -- 1. --overwrite never removes what the command did not make ------------------------------

@pytest.mark.parametrize("relation", ["is", "lies inside", "contains"])
@pytest.mark.parametrize("name", list(INPUT_OF))
def test_output_on_or_around_an_input_is_refused(world, name, relation, capsys):
    source = world[INPUT_OF[name]]
    holder = source.parent
    out = {"is": source, "lies inside": source / "sub", "contains": holder}[relation]
    before = snapshot(holder)
    assert main(command(name, world, out)) == 2
    one_line(capsys, str(out), "the input")
    assert snapshot(holder) == before


@pytest.mark.parametrize("name", list(INPUT_OF))
def test_overwrite_refuses_a_directory_it_did_not_make(world, name, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(command(name, world, out)) == 2
    one_line(capsys, str(out), "not empty and not a")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_export_replaces_its_own_export(world, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", world["run"], "--out", out]) == 0
    assert main(["export", world["run"], "--out", out]) == 2
    one_line(capsys, "already holds a model export", "--overwrite")
    assert main(["export", world["run"], "--out", out, "--overwrite"]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


# -- 2. writes that fail ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tokenizer", "prepare", "stage", "export", "train", "report"])
def test_read_only_destination_is_one_line(world, name, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    argv = (["report", world["run"], "--out", ro / "x.png"] if name == "report"
            else command(name, world, ro / "x"))
    proc_one_line(cli(*argv, caps=False), str(ro))
    assert list(ro.iterdir()) == []


@pytest.mark.parametrize("name", ["tokenizer", "prepare", "stage", "export", "train", "report"])
def test_a_file_where_a_directory_belongs_is_one_line(world, name, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    argv = (["report", world["run"], "--out", blocker / "x.png"] if name == "report"
            else command(name, world, blocker / "x"))
    assert main(argv) == 2
    one_line(capsys, str(blocker))
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("name,size", [("tokenizer", "8k"), ("export", "256k"),
                                       ("report", "16k"), ("prepare", "64k")])
def test_full_disk_is_one_line_and_leaves_nothing(world, name, size, tmp_path, capsys):
    with tmpfs(tmp_path / "mnt", size) as mnt:
        argv = (["report", world["run"], "--out", mnt / "x.png"] if name == "report"
                else command(name, world, mnt / "x"))
        assert main(argv) == 2
        one_line(capsys, "out of disk space", str(mnt))
        assert [p.name for p in mnt.iterdir()] == []


@pytest.mark.parametrize("umask,mode", [(0o022, 0o755), (0o027, 0o750)])
def test_output_directories_follow_the_umask(world, tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        assert main(command("tokenizer", world, tmp_path / "tok")) == 0
        assert main(command("export", world, tmp_path / "hf")) == 0
    finally:
        os.umask(old)
    for d in ("tok", "hf"):
        assert (tmp_path / d).stat().st_mode & 0o777 == mode
        for f in (tmp_path / d).iterdir():
            assert f.stat().st_mode & 0o777 == mode & 0o666, f


def test_checkpoint_save_on_a_full_disk(world, tmp_path):
    """The save that cannot fit is found before a byte is written: one line with the figures,
    no partial tag; or, with --save-errors skip, a warning and the run goes on."""
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        run = mnt / "run"
        proc = run_app("train", "--data", world["data"], "--out", run, *TINY, "--max-steps", "2",
                       "--save-every", "1")
        line = proc_one_line(proc, "checkpoint global_step1 not saved", "out of disk space",
                             "it needs about", "MB free")
        assert "no earlier checkpoint" in line
        assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
        shutil.rmtree(run)
        proc = check(run_app("train", "--data", world["data"], "--out", run, *TINY,
                             "--max-steps", "2", "--save-every", "1", "--save-errors", "skip"))
        assert proc.stderr.count("warning: checkpoint global_step") == 2
        assert json.loads((run / "summary.json").read_text())["steps"] == 2


# `python -m app ARGV` whose writes past LIMIT bytes fail with EFBIG (a fork of the warm
# process that limits itself first)
FILE_SIZE_LIMITED_APP = """import resource, runpy, signal, sys
import app.__main__
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
sys.argv = [app.__main__.__file__, *sys.argv[2:]]  # as `python -m app` sets it
runpy.run_path(app.__main__.__file__, run_name="__main__")
"""


def test_failed_save_removes_its_tag_and_keeps_latest(world, tmp_path):
    """A save that fails halfway (here: the OS refuses files over 1 MB, so the small files of
    the tag are written and the model states are not) removes the partial tag, leaves `latest`
    on the previous checkpoint, and the same command goes on once the cause is gone."""
    run = tmp_path / "run"
    args = ["train", "--data", world["data"], "--out", run, *TINY, "--save-every", "2",
            "--log-every", "1", "--max-steps", "4"]
    check(run_app(*args, "--stop-at-step", "2"))
    ckpt = run / "checkpoints"
    proc = python("-c", FILE_SIZE_LIMITED_APP, 1 << 20, *args)
    proc_one_line(proc, "checkpoint global_step4 not saved", str(ckpt / "global_step4"),
                  "`latest` still names global_step2")
    assert not (ckpt / "global_step4").exists()
    assert (ckpt / "latest").read_text() == "global_step2"
    check(run_app(*args))
    assert (ckpt / "latest").read_text() == "global_step4"


def test_resume_removes_what_an_interrupted_save_left(world, tmp_path):
    run = copy_of(world["run"], tmp_path)
    partial = run / "checkpoints" / "global_step6"
    partial.mkdir()
    (partial / ".saving").write_text("global_step6")  # what a save writes first
    (partial / "rng_rank0.pt").write_bytes(b"cut short")
    proc = check(run_app("train", "--data", world["data"], "--out", run, *TINY,
                         "--max-steps", "6", "--save-every", "2"))
    assert f"removed {partial}: an interrupted save" in proc.stderr
    assert (run / "checkpoints" / "latest").read_text() == "global_step6"


# -- 3. files the project wrote, read back through their schema -------------------------------

def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / run.name))


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("change,needle", [
    (lambda m: m["splits"]["train"].update(tokens=-100), "key 'splits.train.tokens'"),
    (lambda m: m.update(vocab_size="2000"), "key 'vocab_size'"),
    (lambda m: m["splits"]["train"]["shards"][0].pop("bin_bytes"),
     "key 'splits.train.shards[0].bin_bytes' is missing"),
    (lambda m: m.update(dtype="float64"), "key 'dtype'"),
])
def test_a_bad_manifest_names_file_and_key(world, tmp_path, change, needle, capsys):
    data = tmp_path / "data"
    shutil.copytree(world["data"], data)
    _edit_json(data / "dataset.json", change)
    for argv in (["inspect", data, "--verify"], ["stage", "--src", data, "--dst", tmp_path / "s"],
                 ["train", "--data", data, "--out", tmp_path / "r", *TINY]):
        assert main(argv) == 2
        one_line(capsys, str(data / "dataset.json"), needle)


def test_bad_run_files_name_file_and_key(world, tmp_path, capsys):
    run = copy_of(world["run"], tmp_path)
    append(run / "metrics.jsonl", b'\xff\xfe\n{"step": 9, "tokens_seen": 1}\n')
    assert main(["report", run]) == 2
    one_line(capsys, "metrics.jsonl: line", "not valid JSON")
    shutil.copy(world["run"] / "metrics.jsonl", run / "metrics.jsonl")
    _edit_json(run / "summary.json", lambda s: s.update(steps="four"))
    assert main(["report", run]) == 2
    one_line(capsys, "summary.json", "key 'steps'")
    _edit_json(run / "config.json", lambda c: c.update(zero_stage=7))
    assert main(["export", run, "--out", tmp_path / "hf"]) == 2
    one_line(capsys, "config.json", "key 'zero_stage'")


def test_a_binary_last_line_is_a_torn_write(world, tmp_path, capsys):
    run = copy_of(world["run"], tmp_path)
    append(run / "metrics.jsonl", b"\xff\xfe")
    assert main(["report", run]) == 0


@pytest.mark.parametrize("victim", ["mp_rank_00_model_states.pt", "rng_rank0.pt"])
def test_a_truncated_checkpoint_file_is_named(world, tmp_path, victim, capsys):
    run = copy_of(world["run"], tmp_path)
    tag = run / "checkpoints" / "global_step4"
    path = tag / victim
    os.truncate(path, path.stat().st_size // 2)
    (tag / "manifest.json").unlink()  # a tag made before manifests: the structure check names it
    # (with its manifest the file is named by test_checkpoint_safety; auto resumes global_step2)
    assert main(["train", "--data", world["data"], "--out", run, *TINY, "--max-steps", "6",
                 "--resume", tag]) == 2
    one_line(capsys, str(path), "corrupt or truncated")
    if victim.startswith("mp_rank"):
        assert main(["export", run, "--out", tmp_path / "hf"]) == 2
        one_line(capsys, str(path), "corrupt or truncated")
        assert not (tmp_path / "hf").exists()


def test_a_bad_train_state_is_named(world, tmp_path, capsys):
    run = copy_of(world["run"], tmp_path)
    tag = run / "checkpoints" / "global_step4"
    _edit_json(tag / "train_state.json", lambda s: s.update(consumed_samples=-8))
    remanifest(tag)  # the schema check behind the manifest (auto would resume global_step2)
    assert main(["train", "--data", world["data"], "--out", run, *TINY, "--max-steps", "6",
                 "--resume", tag]) == 2
    one_line(capsys, "train_state.json", "key 'consumed_samples'")


def test_train_checks_the_datasets_tokenizer_copy(world, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(world["data"], data)
    append(data / "tokenizer" / "tokenizer.json", b" ")
    assert main(["train", "--data", data, "--out", tmp_path / "r", *TINY]) == 2
    one_line(capsys, "tokenizer.json", "fingerprint", "does not match")
    assert not (tmp_path / "r").exists()


# -- 4. values handed to libraries ------------------------------------------------------------

@pytest.mark.parametrize("extra,needles", [
    (["--model-arg", "num_hidden_layers=-1"], ["num_hidden_layers=-1", "at least 1"]),
    (["--model-arg", "num_hidden_layers=two"], ["num_hidden_layers", "expected int"]),
    (["--model-arg", "hidden_size=129"], ["hidden_size=129", "num_attention_heads"]),
    (["--model-arg", "hidden_dropout_prob=1.5"], ["hidden_dropout_prob", "[0, 1)"]),
    (["--model-arg", "layer_norm_eps=NaN"], ["not a finite number"]),
    (["--lr", "nan"], ["--lr", "not a finite number"]),
    (["--lr", "inf"], ["--lr", "not a finite number"]),
    (["--beta2=-inf"], ["--beta2", "not a finite number"]),
])
def test_values_are_checked_before_they_reach_a_library(world, tmp_path, extra, needles,
                                                        capsys):
    assert main(["train", "--data", world["data"], "--out", tmp_path / "r", *TINY,
                 *extra]) == 2
    one_line(capsys, *needles)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("config,needles", [
    ({"zero_optimization": {"stage": 0, "bogus_key": 1}},
     ["key 'zero_optimization.bogus_key'", "Extra inputs are not permitted"]),
    ({"bf16": {"enabled": "maybe"}}, ["key 'bf16.enabled'"]),
    ({"optimizer": {"type": "NoSuchOptimizer", "params": {}}}, ["key 'optimizer.type'"]),
    ({"gradient_clipping": -1}, ["key 'gradient_clipping'"]),
])
def test_deepspeed_refusals_are_one_line(world, tmp_path, config, needles, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", **config}))
    assert main(["train", "--data", world["data"], "--out", tmp_path / "r", *TINY,
                 "--ds-config", path]) == 2
    one_line(capsys, str(path), *needles)


def test_unknown_deepspeed_keys_are_named_in_a_warning(tmp_path):
    from app.runtime.ds_config import validate_ds_config

    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimizaton": {"stage": 1}}
    warnings = validate_ds_config(ds, tmp_path / "ds.json")
    assert len(warnings) == 1
    assert "'zero_optimizaton'" in warnings[0] and "did you mean 'zero_optimization'" in \
        warnings[0]


def test_nan_in_a_json_file_is_refused(world, tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": NaN}')
    assert main(["train", "--data", world["data"], "--out", tmp_path / "r", *TINY,
                 "--ds-config", path]) == 2
    one_line(capsys, str(path), "NaN is not valid JSON")
    assert main(["prepare", "--input", world["corpus"], "--tokenizer", world["tok"],
                 "--out", tmp_path / "d", "--val-fraction", "nan"]) == 2
    one_line(capsys, "--val-fraction", "not a finite number")


# -- 5. a resume that would change what a sample is -------------------------------------------

# (--seq-len may change: a sequence-length phase, tests/test_encoders.py)
@pytest.mark.parametrize("flag,value", [("--seed", "7"), ("--packing", "doc")])
def test_resume_with_another_sample_layout_is_refused(world, flag, value, tmp_path, capsys):
    run = copy_of(world["run"], tmp_path)
    before = snapshot(run)
    assert main(["train", "--data", world["data"], "--out", run, *TINY, "--max-steps", "6",
                 flag, value]) == 2
    one_line(capsys, flag, "sample position")
    assert snapshot(run) == before
