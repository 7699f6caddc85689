"""Run config checks, and every ds_configs/*.json resolving into a config DeepSpeed accepts."""
import argparse
import json
from pathlib import Path

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from app.config import TrainConfig, add_arguments
from app.runtime.device import Device, resolve_precision
from app.runtime.engine import CONFIG_DIR, fill_auto, load_ds_config, settle_precision, zero_stage
from app.settle import batch_geometry
from data_tools.errors import UserError

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
    from app.runtime.engine import adopt_launcher_env, world_from_env

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
    assert "torch_adam" not in fill(raw, path, settle_precision(raw, "auto", GPU, path),
                                    torch_adam=GPU.torch_adam)["optimizer"]["params"]
    raw = dict(raw, optimizer={"type": "AdamW", "params": {"torch_adam": False}})
    assert fill(raw, path, "fp32", torch_adam=True)["optimizer"]["params"]["torch_adam"] is False
