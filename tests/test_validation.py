"""Every value checked before anything is written (issue 24): the DeepSpeed config's types and
its conflicts with the flags, the range of every numeric flag, dataset.json against its tokenizer
and dtype, mixture files, files that are not regular files, a sample with nothing to predict, and
outputs compared as files (a bind mount of an input is that input).

Most checks are pure and run in-process; a few real `python -m app train` runs show the whole
path: exit 2, one line, no traceback, no run directory.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from app.config import SEED_MAX, TrainConfig, add_arguments
from app.data.sources import read_sources
from app.runtime.ds_config import check_types, fill_auto, load_ds_config, zero_config_path
from app.settle import check_learnable, check_vocabulary
from data_tools import output
from data_tools.errors import UserError
from data_tools.schema import check_regular, read_json
from tests.helpers import TINY, error_lines, python, run_app

BASE = json.loads(zero_config_path(0).read_text())


def parse(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return TrainConfig.from_args(parser.parse_args(["--data", "d", "--out", "o", *argv]))


def fill(ds: dict, path: Path, **kw) -> dict:
    settings = dict(micro_batch=4, grad_accum=1, world_size=1, precision="fp32", lr=1e-3,
                    betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01, pin_memory=False,
                    where=path) | kw
    return fill_auto(ds, **settings)


def changed(**sections) -> dict:
    ds = copy.deepcopy(BASE)
    ds.update(sections)
    return ds


# -- the DeepSpeed config -------------------------------------------------------------------

@pytest.mark.parametrize("sections, needles", [
    ({"bf16": {"enabled": "true"}}, ["'bf16.enabled' is 'true'", "JSON boolean"]),
    ({"fp16": {"enabled": "auto", "loss_scale": "0"}}, ["'fp16.loss_scale' is '0'"]),
    ({"zero_optimization": {"stage": 3, "overlap_comm": 1}},
     ["'zero_optimization.overlap_comm' is 1"]),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu",
                                                          "pin_memory": "yes"}}},
     ["'zero_optimization.offload_param.pin_memory' is 'yes'"]),
    ({"zero_optimization": {"stage": True}}, ["'zero_optimization.stage' is True"]),
    ({"zero_optimization": {"stage": 1.0}}, ["'zero_optimization.stage' is 1.0"]),
    ({"train_micro_batch_size_per_gpu": "4"}, ["'train_micro_batch_size_per_gpu' is '4'"]),
    ({"gradient_clipping": "1.0"}, ["'gradient_clipping' is '1.0'"]),
    ({"scheduler": {"type": "WarmupLR", "params": {}}}, ["'scheduler'", "--lr-decay"]),
    ({"optimizer": {"type": 3}}, ["'optimizer.type' is 3"]),
    ({"optimizer": {"type": "AdamW", "params": [1]}}, ["'optimizer.params' must be an object"]),
])
def test_a_mistyped_ds_config_is_refused_on_reading(tmp_path, sections, needles):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(changed(**sections)))
    with pytest.raises(UserError) as e:
        load_ds_config(path)
    for needle in [str(path), *needles]:
        assert needle in str(e.value)


def test_the_shipped_configs_and_whole_numbers_written_as_floats_pass(tmp_path):
    for path in sorted(zero_config_path(0).parent.glob("*.json")):
        load_ds_config(path)
    check_types(changed(zero_optimization={"stage": 2, "reduce_bucket_size": 5e8}),
                tmp_path / "ds.json")


def test_sgd_gets_only_the_settings_it_takes(tmp_path):
    ds = fill(changed(optimizer={"type": "SGD", "params": {"lr": "auto"}}), tmp_path / "a.json")
    assert ds["optimizer"] == {"type": "SGD", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    with pytest.raises(UserError, match=r"'optimizer.params.betas': torch.optim.SGD takes no"):
        fill(changed(optimizer={"type": "SGD", "params": {"betas": [0.9, 0.9]}}),
             tmp_path / "a.json")


@pytest.mark.parametrize("key, value, flag", [
    ("lr", 5e-4, "--lr"), ("betas", [0.9, 0.999], "--beta1/--beta2"), ("eps", 1e-6, "--eps"),
    ("weight_decay", 0.1, "--weight-decay")])
def test_an_optimizer_number_must_agree_with_its_flag(tmp_path, key, value, flag):
    ds = changed(optimizer={"type": "AdamW", "params": {key: value}})
    with pytest.raises(UserError) as e:
        fill(ds, tmp_path / "a.json")
    assert f"'optimizer.params.{key}'" in str(e.value) and flag in str(e.value)
    agreeing = {"lr": 5e-4, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.1}[key]
    kw = {"betas": agreeing} if key == "betas" else {key: agreeing}
    assert fill(ds, tmp_path / "a.json", **kw)["optimizer"]["params"][key] == value


# -- flags ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["--eps", "-1"], "--eps -1.0: must be in (0, 1)"),
    (["--eps", "0"], "--eps 0.0"),
    (["--seed", "1" * 24], f"--seed {'1' * 24}: must be in [0, {SEED_MAX}]"),
    (["--seed", "-1"], "--seed -1"),
    (["--warmup-steps", "-2"], "--warmup-steps -2: must be 0 or more"),
    (["--min-lr-ratio", "1.5"], "--min-lr-ratio 1.5"),
    (["--mask-prob", "1"], "--mask-prob 1.0"),
    (["--spike-rise", "-0.5"], "--spike-rise -0.5"),
    (["--peak-tflops", "0"], "--peak-tflops 0.0"),
    (["--max-steps", "1" + "0" * 24], "--max-steps 1" + "0" * 24 + ": out of range"),
    (["--micro-batch", "9" * 20], "--micro-batch"),
])
def test_every_numeric_flag_has_a_range(argv, needle):
    with pytest.raises(UserError) as e:
        parse(*argv)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_range_edges_pass():
    cfg = parse("--seed", str(SEED_MAX), "--warmup-steps", "0", "--min-lr-ratio", "0",
                "--eps", "1e-12")
    assert cfg.seed == SEED_MAX and cfg.warmup_steps == 0


# -- files the app reads --------------------------------------------------------------------

@pytest.fixture
def dataset(mlm_dataset, tmp_path) -> Path:
    d = tmp_path / "data"
    shutil.copytree(mlm_dataset, d)
    return d


def edit(dataset: Path, **values) -> dict:
    path = dataset / "dataset.json"
    manifest = json.loads(path.read_text()) | values
    path.write_text(json.dumps(manifest))
    return manifest


@pytest.mark.parametrize("values, needles", [
    ({"vocab_size": 70000}, ["'vocab_size' is 70000", "uint16 holds ids up to 65535"]),
    ({"vocab_size": 1500}, ["'vocab_size' is 1500", "has 2000 tokens"]),
    ({"vocab_size": 2500}, ["'vocab_size' is 2500", "has 2000 tokens"]),
])
def test_dataset_json_is_checked_against_its_tokenizer_and_dtype(dataset, values, needles):
    manifest = edit(dataset, **values)
    with pytest.raises(UserError) as e:
        check_vocabulary(dataset, manifest, dataset / "tokenizer" / "tokenizer.json")
    for needle in [str(dataset / "dataset.json"), *needles]:
        assert needle in str(e.value)


def test_special_ids_lie_in_the_vocabulary(dataset):
    manifest = json.loads((dataset / "dataset.json").read_text())
    check_vocabulary(dataset, manifest, dataset / "tokenizer" / "tokenizer.json")
    manifest = edit(dataset, pad_token_id=manifest["vocab_size"])
    with pytest.raises(UserError, match="'pad_token_id' is 2000, not below"):
        check_vocabulary(dataset, manifest, dataset / "tokenizer" / "tokenizer.json")


@pytest.mark.parametrize("text, needle", [
    ('{"sources": [{"path": "a", "weight": 1, "wieght": 2}]}', "'sources[0].wieght' is not a"),
    ('{"sources": [{"path": "a", "weight": 1}], "seed": 3}', "key 'seed' is not a key"),
])
def test_a_mixture_file_with_an_unknown_key_is_refused(tmp_path, text, needle):
    path = tmp_path / "mix.json"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        read_sources([str(path)])
    assert needle in str(e.value) and str(path) in str(e.value)


def test_mixture_weights_that_overflow_are_refused(mlm_dataset, clm_dataset):
    with pytest.raises(UserError, match="weights sum to more than the largest number"):
        read_sources([f"1e308:{mlm_dataset}", f"1e308:{clm_dataset}"])


@pytest.mark.parametrize("kind", ["fifo", "dir", "device"])
def test_only_regular_files_are_opened(tmp_path, kind):
    path = {"dir": tmp_path, "device": Path("/dev/zero")}.get(kind, tmp_path / "f.json")
    if kind == "fifo":
        os.mkfifo(path)  # no writer: an open would block for ever
    with pytest.raises(UserError, match="expected a regular file"):
        read_json(path)
    with pytest.raises(UserError, match="expected a regular file"):
        check_regular(path)


def test_a_fifo_hostfile_is_refused(tmp_path):
    from app.sweep.configs import hostfile_slots

    os.mkfifo(tmp_path / "hosts")
    with pytest.raises(UserError, match="is a FIFO"):
        hostfile_slots(tmp_path / "hosts")


NOT_REGULAR = {"fifo": "a FIFO", "dir": "a directory", "device": "a device"}


def not_regular(path: Path, kind: str) -> Path:
    """`path` made a FIFO with no writer, a directory, or a link to /dev/zero."""
    path.unlink(missing_ok=True)
    {"fifo": lambda: os.mkfifo(path), "dir": path.mkdir,
     "device": lambda: path.symlink_to("/dev/zero")}[kind]()
    return path


@pytest.mark.timeout(60)  # the hang this guards against would otherwise be the suite's
@pytest.mark.parametrize("name, kind", [
    ("tokenizer.json", "fifo"), ("tokenizer.json", "dir"), ("tokenizer.json", "device"),
    ("tokenizer_config.json", "fifo"), ("vocab.txt", "fifo"), ("config.json", "device")])
def test_a_tokenizer_file_that_is_not_a_regular_file_is_named(wordpiece_tokenizer, tmp_path,
                                                               name, kind):
    """Before: a FIFO or a directory as tokenizer.json was passed over for transformers'
    fallback, which failed saying something else; a FIFO vocab.txt gave a tokenizer without
    its vocabulary."""
    from data_tools.tokenizer_info import TokenizerInfo

    tok = Path(shutil.copytree(wordpiece_tokenizer, tmp_path / "tok"))
    bad = not_regular(tok / name, kind)
    with pytest.raises(UserError) as e:
        TokenizerInfo(tok)
    assert str(e.value) == f"{bad}: is {NOT_REGULAR[kind]}, expected a regular file"


@pytest.mark.timeout(240)
def test_prepare_and_inspect_refuse_a_fifo_tokenizer_file(wordpiece_tokenizer, mlm_dataset,
                                                          stdlib_dir, tmp_path):
    """The commands, in processes of their own: exit 2, one line, no traceback, no hang (inspect
    --decode read a FIFO tokenizer.json of a dataset for ever)."""
    tok = Path(shutil.copytree(wordpiece_tokenizer, tmp_path / "tok"))
    ds = Path(shutil.copytree(mlm_dataset, tmp_path / "ds"))
    commands = {
        not_regular(tok / "tokenizer.json", "fifo"): [
            "prepare", "--input", stdlib_dir / "json", "--include", "*.py", "--tokenizer", tok,
            "--out", tmp_path / "out"],
        not_regular(ds / "tokenizer" / "tokenizer.json", "fifo"): ["inspect", "--decode", "2",
                                                                     ds]}
    for fifo, argv in commands.items():
        proc = python("-m", "data_tools", *argv, timeout=60)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert error_lines(proc.stderr) == [f"python -m data_tools {argv[0]}: error: {fifo}: is "
                                             f"a FIFO, expected a regular file"]
    assert not (tmp_path / "out").exists()
    # the dataset's own copy: inspect --verify names what it is, app train refuses it
    fifo = ds / "tokenizer" / "tokenizer.json"
    proc = python("-m", "data_tools", "inspect", "--verify", ds, timeout=60)
    assert proc.returncode == 2 and f"{fifo}: is a FIFO, expected a regular file" in proc.stderr
    proc = python("-m", "app", "train", "--data", ds, "--out", tmp_path / "run", "--max-steps",
                  "1", timeout=90)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{fifo}: is a FIFO, expected a regular file" in proc.stderr


# -- a run that cannot learn ----------------------------------------------------------------

def test_a_sample_must_hold_a_token_to_predict(mlm_dataset):
    manifest = json.loads((mlm_dataset / "dataset.json").read_text())
    assert manifest.get("cls_token_id") is not None
    with pytest.raises(UserError, match="--seq-len 2: .* no token to predict"):
        check_learnable(parse("--packing", "doc", "--seq-len", "2"), "mlm", manifest,
                        mlm_dataset)
    check_learnable(parse("--packing", "doc", "--seq-len", "3"), "mlm", manifest, mlm_dataset)
    check_learnable(parse("--seq-len", "2"), "mlm", manifest, mlm_dataset)  # concat
    check_learnable(parse("--packing", "doc", "--seq-len", "2"), "clm", manifest, mlm_dataset)


# -- outputs compared as files --------------------------------------------------------------

def test_another_spelling_of_an_input_is_the_input(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(src)
    for out, word in ((tmp_path / "link", "is"), (tmp_path / "link" / "sub", "lies inside"),
                      (tmp_path, "contains")):
        with pytest.raises(UserError, match=f"{word} the input --src"):
            output.check_apart(out, [("--src", src)], "--dst")
    output.check_apart(tmp_path / "other", [("--src", src)], "--dst")


@pytest.fixture
def bind_mount(dataset, tmp_path):
    """`dataset` bind-mounted at another path (skipped where mount is not permitted)."""
    target = tmp_path / "bind"
    target.mkdir()
    r = subprocess.run(["mount", "--bind", str(dataset), str(target)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"mount --bind is not permitted here: {r.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_stage_onto_a_bind_mount_of_its_source_is_refused(dataset, bind_mount):
    from data_tools.__main__ import main as data_tools_main

    manifest = dataset / "dataset.json"
    before = (manifest.stat().st_ino, manifest.read_bytes(), sorted(os.listdir(dataset)))
    for dst in (bind_mount, bind_mount / "inside"):
        assert data_tools_main(["stage", "--src", str(dataset), "--dst", str(dst)]) == 2
    assert (manifest.stat().st_ino, manifest.read_bytes(), sorted(os.listdir(dataset))) == before
    with pytest.raises(UserError, match="--out .*contains the input --data"):
        output.check_apart(bind_mount.parent, [("--data", dataset / "tokenizer")])


# -- the whole path: real runs --------------------------------------------------------------

def one_line_no_run(proc: subprocess.CompletedProcess, out: Path, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in error_lines(proc.stderr) if ": error: " in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not out.exists(), "a refused run left its directory"


@pytest.mark.parametrize("name, argv, needles", [
    ("bf16", ["--ds-config", "bf16.json"], ["'bf16.enabled' is 'true'"]),
    ("fifo", ["--ds-config", "fifo.json"], ["is a FIFO"]),
    ("eps", ["--eps", "-1"], ["--eps -1.0"]),
    ("doc", ["--packing", "doc", "--seq-len", "2"], ["no token to predict"]),
])
def test_a_refused_train_is_one_line_and_writes_nothing(mlm_dataset, tmp_path, name, argv,
                                                        needles):
    (tmp_path / "bf16.json").write_text(json.dumps(changed(bf16={"enabled": "true"})))
    os.mkfifo(tmp_path / "fifo.json")
    argv = [str(tmp_path / a) if a.endswith(".json") else a for a in argv]
    out = tmp_path / "run"
    proc = run_app("train", "--data", mlm_dataset, "--out", out, *TINY, "--max-steps", "2",
                   *argv, timeout=60)
    one_line_no_run(proc, out, *needles)


def test_a_run_with_an_edited_vocab_size_is_refused(dataset, tmp_path):
    edit(dataset, vocab_size=70000)
    out = tmp_path / "run"
    proc = run_app("train", "--data", dataset, "--out", out, *TINY, "--max-steps", "2")
    one_line_no_run(proc, out, "dataset.json: key 'vocab_size' is 70000")


def test_an_optimizer_type_must_be_an_optimizer(tmp_path):
    from app.runtime.ds_config import validate_ds_config

    ds = fill(changed(optimizer={"type": "lr_scheduler", "params": {}}), tmp_path / "a.json")
    with pytest.raises(UserError, match="'optimizer.type' is 'lr_scheduler'"):
        validate_ds_config(ds, tmp_path / "a.json")


def test_tune_out_is_never_a_dataset(dataset, tmp_path):
    from app.plan.tune import check_out

    cfg = parse("--data", str(dataset))
    for out, needle in ((dataset, "is the input --data"), (dataset / "t", "lies inside"),
                        (tmp_path, "contains the input --data")):
        with pytest.raises(UserError, match=needle):
            check_out(out, cfg)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(dataset / "dataset.json", other)
    with pytest.raises(UserError, match="a dataset directory"):
        check_out(other, cfg)
    check_out(tmp_path / "tune", cfg)
