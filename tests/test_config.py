"""Run config checks, runs from a settings file (--config), and every ds_configs/*.json
resolving into a config DeepSpeed accepts."""
import argparse
import dataclasses
import json
import os
from dataclasses import fields
from pathlib import Path

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from app.__main__ import main as app_main
from app.config import TrainConfig, add_arguments
from app.data.loader import OBJECTIVES
from app.data.packing import PACKINGS
from app.faults.anomaly import POLICIES
from app.runtime.device import PRECISIONS, Device, resolve_precision
from app.runtime.ds_config import (
    CONFIG_DIR,
    fill_auto,
    load_ds_config,
    settle_precision,
    zero_stage,
)
from app.schedule import DECAYS
from app.settle import batch_geometry
from data_tools.cli import field_docs
from data_tools.errors import Parser, UserError
from tests.helpers import TINY, check, run_app, train_losses

CPU = Device(name="cpu", backend="gloo", pin_memory=False, bf16_supported=True,
             fp16_supported=True)
GPU = Device(name="cuda", backend="nccl", pin_memory=True, bf16_supported=True,
             fp16_supported=True)
DS_FILES = sorted(CONFIG_DIR.glob("*.json"))


def parse(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return TrainConfig.from_args(parser.parse_args(["--data", "d", "--out", "o", *argv]))


def fill(ds: dict, path: Path, precision: str = "fp32", **kw) -> dict:
    settings = dict(micro_batch=4, grad_accum=2, world_size=1, precision=precision, lr=3e-4,
                    betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                    pin_memory=False, where=path) | kw
    return fill_auto(ds, **settings)


def test_the_shipped_configs_are_all_there():
    names = {p.name for p in DS_FILES}
    assert {"zero0.json", "zero1.json", "zero2.json", "zero3.json", "zero3_offload.json"} <= names
    assert any("fp16" in n for n in names)


def test_zero3_persistence_threshold_follows_the_model_width():
    path = CONFIG_DIR / "zero3.json"
    raw = load_ds_config(path)
    zero = fill(raw, path, hidden_size=128)["zero_optimization"]
    assert zero["stage3_param_persistence_threshold"] == 1280  # a 128 x 128 matrix is partitioned
    assert fill(raw, path)["zero_optimization"]["stage3_param_persistence_threshold"] == 100_000
    raw["zero_optimization"]["stage3_param_persistence_threshold"] = 7  # a number is kept
    assert fill(raw, path, hidden_size=128)["zero_optimization"][
        "stage3_param_persistence_threshold"] == 7


@pytest.mark.parametrize("path", DS_FILES, ids=lambda p: p.name)
def test_every_ds_config_resolves_and_deepspeed_parses_it(path):
    raw = load_ds_config(path)
    precision = settle_precision(raw, "auto", GPU, path)
    ds = fill(raw, path, precision)
    assert "auto" not in json.dumps(ds)
    parsed = DeepSpeedConfig(ds)
    assert parsed.train_batch_size == 8 and parsed.gradient_accumulation_steps == 2
    assert parsed.zero_optimization_stage == zero_stage(raw)
    assert parsed.gradient_clipping == 1.0
    assert ds["optimizer"] == {"type": "AdamW", "params": {
        "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}
    # bf16 by default on an accelerator with bf16, fp16 (dynamic loss scale) in the fp16 variant
    if "fp16" in path.name:
        assert ds["fp16"]["enabled"] is True and ds["fp16"]["loss_scale"] == 0
    else:
        assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False


@pytest.mark.parametrize("path", DS_FILES, ids=lambda p: p.name)
def test_bf16_accumulates_in_fp32_where_deepspeed_allows_and_buckets_are_large(path):
    raw = load_ds_config(path)
    ds = fill(raw, path, settle_precision(raw, "auto", GPU, path))
    if ds.get("bf16", {}).get("enabled") and zero_stage(raw) >= 1:
        assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    else:  # ZeRO-0 refuses the mix (DeepSpeed: "unsupported mix"); fp16 keeps its own
        assert "data_types" not in ds
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
        assert ds["zero_optimization"].get(key, 5e7) >= 5e7, key


def test_switching_zero_stage_is_switching_the_file():
    base = {k: v for k, v in load_ds_config(CONFIG_DIR / "zero0.json").items()
            if k != "zero_optimization"}
    for stage in (1, 2, 3):
        other = load_ds_config(CONFIG_DIR / f"zero{stage}.json")
        assert {k: v for k, v in other.items() if k != "zero_optimization"} == base


def test_precision_auto_is_fp32_on_cpu_and_bf16_on_gpu():
    assert resolve_precision("auto", CPU) == "fp32"
    assert resolve_precision("auto", GPU) == "bf16"
    no_bf16 = Device("cuda", "nccl", True, bf16_supported=False, fp16_supported=True)
    assert resolve_precision("auto", no_bf16) == "fp32"
    with pytest.raises(UserError, match="bf16"):
        resolve_precision("bf16", no_bf16)


def test_a_file_that_fixes_precision_owns_it():
    path = CONFIG_DIR / "zero2_fp16.json"
    raw = load_ds_config(path)
    assert settle_precision(raw, "auto", CPU, path) == "fp16"
    with pytest.raises(UserError, match="fp16.enabled"):
        settle_precision(raw, "bf16", CPU, path)


def test_flags_that_contradict_the_file_are_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8}))
    with pytest.raises(UserError, match="train_micro_batch_size_per_gpu"):
        fill(load_ds_config(path), path)
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "sub_group_size": "auto"}}))
    with pytest.raises(UserError, match="zero_optimization.sub_group_size"):
        fill(load_ds_config(path), path)


@pytest.mark.parametrize("text,match", [("{not json", "line 1"), ("[1, 2]", "JSON object"),
                                        ('{"zero_optimization": {"stage": 4}}', "ZeRO stages")])
def test_bad_ds_config_files(tmp_path, text, match):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(UserError, match=match):
        load_ds_config(path)
    with pytest.raises(UserError, match="no such file"):
        load_ds_config(tmp_path / "missing.json")


@pytest.mark.parametrize("argv,match", [
    (["--zero", "4"], "ZeRO stages"), (["--zero", "-1"], "ZeRO stages"),
    (["--micro-batch", "0"], "micro-batch"), (["--seq-len", "-5"], "seq-len"),
    (["--max-steps", "0"], "max-steps"), (["--lr", "0"], "lr"),
    (["--grad-accum", "0"], "grad-accum"), (["--dropout", "1.5"], "dropout"),
    (["--save-every", "-1"], "save-every"), (["--zero", "1", "--ds-config", "x.json"], "exclusive"),
])
def test_bad_flags_are_user_errors(argv, match):
    with pytest.raises(UserError, match=match):
        parse(*argv)


def test_defaults_and_model_choice():
    cfg = parse()
    assert cfg.model_name == "bert-tiny" and cfg.resume == "auto" and cfg.zero is None
    assert parse("--objective", "clm").model_name == "gpt-tiny"
    assert parse("--model-arg", "a=1", "--model-arg", "b=2").model_arg == ["a=1", "b=2"]


def test_batch_geometry():
    cfg = parse("--micro-batch", "4", "--global-batch", "32")
    assert batch_geometry(cfg, 2) == (4, 4, 32)
    assert batch_geometry(parse("--micro-batch", "4", "--grad-accum", "3"), 2) == (4, 3, 24)
    with pytest.raises(UserError, match="not a multiple"):
        batch_geometry(parse("--micro-batch", "4", "--global-batch", "20"), 2)
    with pytest.raises(UserError, match="disagrees"):
        batch_geometry(parse("--micro-batch", "4", "--global-batch", "32", "--grad-accum", "2"),
                       2)


def test_help_lists_the_flags(capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "--zero N" in out and "--stage-to DIR" in out and "(default 128)" in out
    assert "MISSING" not in out


def test_a_file_that_turns_a_precision_off_owns_it(tmp_path):
    path = tmp_path / "ds.json"
    off = {"bf16": {"enabled": False}}
    assert settle_precision(off, "auto", GPU, path) == "fp32"
    with pytest.raises(UserError, match="'bf16.enabled': false"):
        settle_precision(off, "bf16", GPU, path)
    # no precision section at all: the resolved precision is written in, as reported
    ds = fill({"zero_optimization": {"stage": 0}}, path, precision="bf16")
    assert ds["bf16"] == {"enabled": True} and "fp16" not in ds
    assert "bf16" not in fill({"zero_optimization": {"stage": 0}}, path, precision="fp32")


def test_a_file_without_an_optimizer_gets_adamw_from_the_flags(tmp_path):
    ds = fill({"zero_optimization": {"stage": 1}}, tmp_path / "ds.json")
    assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
                                                           "eps": 1e-8, "weight_decay": 0.1}}
    DeepSpeedConfig(ds)


@pytest.mark.parametrize("env, want", [
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, (5, 8, 1, 4)),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
      "SLURM_NTASKS_PER_NODE": "2(x2)"}, (3, 4, 1, 2)),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_PROCID": "9"}, (1, 2, 1, 1)),
    ({}, (0, 1, 0, 1)),
])
def test_ranks_come_from_torch_mpi_or_slurm_launchers(env, want):
    from app.runtime.dist import adopt_launcher_env, world_from_env

    adopt_launcher_env(env)
    w = world_from_env(env)
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size) == want


@pytest.mark.parametrize("path", DS_FILES, ids=lambda p: p.name)
def test_cpu_runs_take_torchs_adam_unless_the_optimizer_is_offloaded(path):
    """DeepSpeed's compiled CPU Adam keeps beta**step as a running product, so a resumed run
    differs from a straight one in the last bit; torch's AdamW does not (Device.torch_adam)."""
    raw = load_ds_config(path)
    ds = fill(raw, path, settle_precision(raw, "auto", CPU, path), torch_adam=CPU.torch_adam)
    offloaded = "offload" in path.name
    assert ds["optimizer"]["params"].get("torch_adam", False) is not offloaded
    # CPU and CUDA: torch's fused AdamW (no JIT build; a device-side skip of a non-finite step),
    # also where DeepSpeed's op is prebuilt
    for device in (CPU, GPU, dataclasses.replace(GPU, fused_adam_prebuilt=True)):
        params = fill(raw, path, settle_precision(raw, "auto", device, path),
                      torch_adam=device.torch_adam,
                      torch_adam_fused=device.torch_adam_fused)["optimizer"]["params"]
        assert (params.get("torch_adam", False), params.get("fused", False)) == \
            (not offloaded,) * 2
    raw = dict(raw, optimizer={"type": "AdamW", "params": {"torch_adam": False}})
    assert fill(raw, path, "fp32", torch_adam=True)["optimizer"]["params"]["torch_adam"] is False


# -- settings from a file (--config) -------------------------------------------------------------

def from_file(tmp_path: Path, text: str, *argv: str, name: str = "run.yaml") -> TrainConfig:
    """TrainConfig from `app train --config FILE ARGV`, FILE holding `text`, parsed as app does."""
    path = tmp_path / name
    path.write_text(text)
    parser = Parser(prog="python -m app train")
    add_arguments(parser)
    return TrainConfig.from_args(parser.parse_args(["--config", str(path), *argv]))


def test_a_yaml_file_gives_the_settings(tmp_path):
    cfg = from_file(tmp_path, "# a run in git\ndata: ds\nout: runs/a\nmax_steps: 6\nlr: 1e-3\n"
                    "compile: true\nprecision: fp32\nwandb_tags: [x, y]\nmodel_arg: [a=1]\n")
    assert (cfg.data, cfg.out, cfg.max_steps, cfg.lr) == (Path("ds"), Path("runs/a"), 6, 1e-3)
    assert cfg.compile is True and cfg.precision == "fp32" and cfg.wandb_tags == ["x", "y"]
    assert cfg.seq_len == 128 and cfg.model_arg == ["a=1"]  # the rest: the flags' defaults
    mix = from_file(tmp_path, "data: [0.7:a, 0.3:b]\nout: o\n")
    assert mix.data == ["0.7:a", "0.3:b"]


def test_flags_override_the_file_wherever_they_stand(tmp_path):
    text = "data: ds\nout: runs/a\nmax_steps: 6\nwandb_tags: [x]\nmodel_arg: [a=1]\n"
    cfg = from_file(tmp_path, text, "--max-steps", "4", "--out", "runs/b", "--wandb-tags", "z")
    assert (cfg.max_steps, cfg.out, cfg.wandb_tags) == (4, Path("runs/b"), ["z"])
    path = tmp_path / "run.yaml"
    parser = Parser(prog="python -m app train")
    add_arguments(parser)
    before = parser.parse_args(["--max-steps", "4", "--config", str(path)])
    assert before.max_steps == 4 and before.out == Path("runs/a")
    # --model-arg adds to the file's KEY=VALUE list: a later KEY wins
    # (app.models.presets.parse_overrides)
    assert from_file(tmp_path, text, "--model-arg", "a=2").model_arg == ["a=1", "a=2"]
    with pytest.raises(SystemExit):  # the parser is as before: --data is required again
        parser.parse_args(["--out", "o"])
    assert from_file(tmp_path, "data: d\nout: o\nwandb_tags: []\n").wandb_tags == []


def test_a_json_file_and_a_runs_config_json_repeat_the_settings(tmp_path):
    argv = ["--data", "0.5:a", "0.5:b", "--out", "runs/x", "--model", "gpt-tiny",
            "--objective", "clm", "--model-arg", "num_hidden_layers=2", "--zero", "1",
            "--precision", "bf16", "--max-steps", "7", "--lr", "3e-4", "--dropout", "0",
            "--tf32", "--packing", "doc", "--on-anomaly", "skip", "--stage-to", "/tmp/s",
            "--wandb", "offline", "--wandb-tags", "a", "b", "--peak-tflops", "12.5"]
    parser = Parser(prog="python -m app train")
    add_arguments(parser)
    cfg = TrainConfig.from_args(parser.parse_args(argv))
    record = {"run": cfg.to_dict(), "model": {"preset": "gpt-tiny"}, "ds_config": {"a": 1},
              "environment": {"world_size": 1}}  # what app/train.py describe_run writes
    again = from_file(tmp_path, json.dumps(record, indent=1), name="config.json")
    assert again.to_dict() == cfg.to_dict()
    plain = from_file(tmp_path, json.dumps(cfg.to_dict()), "--out", "runs/y", name="run.json")
    assert plain.to_dict() == {**cfg.to_dict(), "out": "runs/y"}


def test_a_runs_record_continues_the_run_never_replaces_it(tmp_path):
    """Before: config.json recorded `resume: never` and `overwrite: true`, so `--config
    RUN/config.json` replaced the run from step 0 where the README says it resumes. What a run
    did to its --out is recorded, not repeated; a settings file of the user's still says it."""
    record = {"run": {"data": "d", "out": "o", "resume": "never", "overwrite": True,
                      "max_steps": 4}, "model": {"preset": "bert-tiny"}}
    again = from_file(tmp_path, json.dumps(record), name="config.json")
    assert (again.resume, again.overwrite, again.max_steps) == ("auto", False, 4)
    asked = from_file(tmp_path, json.dumps(record), "--resume", "never", "--overwrite",
                      name="config.json")
    assert (asked.resume, asked.overwrite) == ("never", True)
    mine = from_file(tmp_path, "data: d\nout: o\nresume: never\noverwrite: true\n")
    assert (mine.resume, mine.overwrite) == ("never", True)


def test_init_from_the_run_being_overwritten_is_refused(mlm_dataset, tmp_path):
    """Before: `--out R --init-from R --resume never --overwrite` deleted R, then failed with
    "no checkpoint". The --init-from source is an input: the output gate refuses it."""
    run = tmp_path / "r"
    run.mkdir()
    (run / ".dspretrain.json").write_text('{"kind": "run directory", "command": "app train"}')
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest").write_text("global_step2")
    before = sorted((p.name, p.read_bytes() if p.is_file() else b"") for p in run.rglob("*"))
    for out in (run, run / "inner"):
        proc = run_app("train", "--data", mlm_dataset, "--out", out, "--init-from", run,
                       "--resume", "never", "--overwrite", *TINY)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert f"the input --init-from {run}" in proc.stderr
    assert sorted((p.name, p.read_bytes() if p.is_file() else b"") for p in run.rglob("*")) \
        == before


@pytest.mark.parametrize("name,text,needles", [
    ("run.yaml", "data: d\nout: o\nmax_stepz: 6\n", ["unknown setting 'max_stepz'",
                                                      "did you mean max_steps?"]),
    ("run.yaml", "data: d\nout: o\nseq-len: 6\n", ["'seq-len'", "did you mean seq_len?"]),
    ("run.yaml", "data: d\nout: o\nmax_steps: six\n", ["max_steps: invalid int value: 'six'"]),
    ("run.yaml", "data: d\nout: o\nmax_steps: 6.5\n", ["max_steps: invalid int value: 6.5"]),
    ("run.yaml", "data: d\nout: o\nlr: .nan\n", ["lr: 'nan' is not a finite number"]),
    ("run.yaml", "data: d\nout: o\nlr: fast\n", ["lr: invalid number: 'fast'"]),
    ("run.yaml", "data: d\nout: o\nprecision: bf17\n", ["precision: invalid choice: 'bf17'",
                                                         "auto, bf16, fp16, fp32"]),
    ("run.yaml", "data: d\nout: o\nresume: no\n", ["resume: expected a value, not false"]),
    ("run.yaml", "data: d\nout: o\ncompile: 1\n", ["compile: expected true or false"]),
    ("run.yaml", "data: d\nout: o\nseed: [1, 2]\n", ["seed: expected one value, not a list"]),
    ("run.yaml", "data: d\nout: o\nmax_steps: null\n", ["max_steps: expected a value"]),
    ("run.yaml", "data: []\nout: o\n", ["data: expected at least one value"]),
    ("run.yaml", "data: [d\nout: o\n", ["not valid YAML (line 2"]),
    ("run.yaml", "- data\n- out\n", ["expected settings"]),
    ("run.yaml", "", ["expected settings"]),
    ("run.json", '{"data": "d",\n "out": "o",}', ["not valid JSON (line 2"]),
    ("config.json", '{"run": {"data": "d", "out": "o", "zero": "one"}}', ["zero: invalid int"]),
])
def test_a_bad_file_is_one_line_naming_the_file_and_the_key(tmp_path, one_line_error, name,
                                                            text, needles):
    with pytest.raises(SystemExit) as exit_info:
        from_file(tmp_path, text, name=name)
    assert exit_info.value.code == 2
    one_line_error(f"--config {tmp_path / name}: ", *needles)


def test_a_file_that_cannot_be_read_is_one_line(tmp_path, one_line_error):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # reading it would block forever
    for path, needle in ((tmp_path / "missing.yaml", "No such file"), (tmp_path, "a directory"),
                         (fifo, "not a regular file")):
        parser = Parser(prog="python -m app train")
        add_arguments(parser)
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["--config", str(path)])
        assert exit_info.value.code == 2
        one_line_error(f"--config {path}: ", needle)


def test_a_bad_file_writes_nothing(tmp_path, one_line_error):
    bad = tmp_path / "run.yaml"
    bad.write_text("data: d\nmax_steps: 0.5\n")
    with pytest.raises(SystemExit) as exit_info:
        app_main(["train", "--config", str(bad), "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    one_line_error("python -m app train: error: ", "max_steps")
    assert sorted(os.listdir(tmp_path)) == ["run.yaml"]


def test_config_is_never_silently_ignored(tmp_path, capsys):
    """An abbreviated --config, or a parser that does not read files (plain argparse)."""
    path = tmp_path / "run.yaml"
    path.write_text("data: d\nout: o\n")
    for parser, argv in ((argparse.ArgumentParser(), ["--data", "d", "--out", "o", "--config"]),
                         (Parser(prog="app train"), ["--conf"])):
        add_arguments(parser)
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, str(path)])
        assert "not read (spell the flag out: --config FILE)" in capsys.readouterr().err


def test_choices_come_from_their_owners_and_every_field_has_help():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    choices = {a.dest: a.choices for a in parser._actions}
    assert choices["objective"] is OBJECTIVES and choices["precision"] is PRECISIONS
    assert choices["lr_decay"] is DECAYS and choices["packing"] is PACKINGS
    assert choices["on_anomaly"] is POLICIES
    names = {f.name for f in fields(TrainConfig)}
    assert names <= set(choices), names - set(choices)  # every setting is a flag and a file key
    assert set(field_docs(TrainConfig)) == names, names - set(field_docs(TrainConfig))


@pytest.mark.slow
def test_a_runs_config_json_trains_the_same_losses(mlm_dataset, tmp_path):
    """`--config RUN/config.json --out NEW` repeats RUN: the same train/loss at every step."""
    check(run_app("train", "--data", mlm_dataset, "--out", tmp_path / "orig", *TINY,
                  "--model", "bert-tiny", "--max-steps", "6", "--log-every", "1", "--seed", "3",
                  "--dropout", "0.1"))
    check(run_app("train", "--config", tmp_path / "orig" / "config.json",
                  "--out", tmp_path / "again"))
    orig, again = train_losses(tmp_path / "orig"), train_losses(tmp_path / "again")
    assert sorted(orig) == list(range(1, 7)) and len(set(orig.values())) == 6
    assert again == orig
    record = json.loads((tmp_path / "again" / "config.json").read_text())["run"]
    assert record == {**json.loads((tmp_path / "orig" / "config.json").read_text())["run"],
                      "out": str(tmp_path / "again")}
