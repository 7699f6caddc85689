"""`python -m app train`: pretrain a model on a dataset directory.

config -> plan (settle and check everything checkable, before any process group) -> run
directory -> join the group -> stage data -> engine -> resume -> Trainer.fit -> reference logits
-> summary. Start it with the deepspeed launcher (or launch.sh) for many ranks; a bare
`python -m app train` is a world of one.
"""
from __future__ import annotations

import argparse
import math
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from app import reference, rundir
from app.faults import anomaly
from app.checkpoint import store as checkpoint
from app.faults import injection as faults
from app.telemetry import figures as telemetry
from app.checkpoint import universal
from app import config as config_mod
from app.config import TrainConfig
from app.runtime.device import (ComputeClock, Device, attention_implementation, detect, enable_tf32,
                        set_cpu_threads)
from app.runtime.dist import (World, adopt_launcher_env, barrier, init_distributed, lost_peer,
                              shutdown, world_from_env)
from app.runtime.ds_config import (fill_auto, load_ds_config, settle_precision,
                                   validate_ds_config, zero_config_path, zero_stage)
from app.runtime.engine import engine_facts, initialize, versions
from app.telemetry.flops import ModelShape, flops_per_token, head_fraction
from app.telemetry.sinks import MetricsLogger, WandbSettings, wandb_mode
from app.model import (build_config, build_model, count_parameters, max_positions,
                       optimizer_groups, parse_overrides, preset)
from app.schedule import schedule_fn
from app.checkpoint.train_state import TrainState
from app.checkpoint.universal import Layout, convertible_into, is_universal, layout_of, saved_layout
from app.data.order import skip_ahead
from app.faults.preemption import StopRequests
from app.data.sources import Source, Sources, read_sources
from app.trainer import EvalSet, Guards, Schedule, Trainer
from app.faults.watchdog import Watchdog
from data_tools import output
from data_tools.errors import Stopped, UserError
from data_tools.manifest import TOKENIZER_DIR, tokenizer_fingerprint
from data_tools.output import write_json_atomic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config_mod.add_arguments(parser)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything settled before the process group starts (so bad input fails fast everywhere)."""

    cfg: TrainConfig
    device: Device
    world: World
    sources: Sources
    """The dataset, or the datasets of a mixture, checked (app/data/sources.py)."""
    manifest: dict[str, Any]
    """The (first) dataset's manifest: vocabulary and special ids, shared by a mixture."""
    model_config: Any
    objective: str
    ds_config: dict[str, Any]
    """The DeepSpeed config with every "auto" filled."""
    ds_path: Path
    precision: str
    micro_batch: int
    grad_accum: int
    global_batch: int
    total_steps: int
    warmup_steps: int
    lr_lambda: Callable[[int], float]
    """The LR schedule, a multiplier of the peak LR per optimizer step."""
    train_samples: tuple[int, ...]
    """Each dataset's train samples (an epoch)."""
    eval_sources: tuple[int, ...]
    """The datasets with a val split to evaluate on."""
    resume: tuple[Path, str] | None
    """(checkpoint dir, tag) to resume from."""
    switch: Switch
    """The checkpoint's layout against this run's, and the run's layout history."""

    @property
    def has_eval(self) -> bool:
        return bool(self.eval_sources)


def plan_run(cfg: TrainConfig, device: Device, world: World) -> Plan:
    sources = read_sources(cfg.data)
    for source in sources.items:
        check_tokenizer_copy(source.path, source.manifest)
    manifest = sources.manifest
    ds_path, raw_ds, precision = settle_deepspeed(cfg, device, world.is_main)
    objective, model_config = settle_model(cfg, manifest, device, precision)
    stats, eval_sources = settle_data(cfg, sources, objective, world.is_main)
    micro, accum, gbs = batch_geometry(cfg, world.world_size)
    total_steps, warmup, lr_lambda = settle_schedule(cfg, gbs)
    ds = fill_auto(raw_ds, micro_batch=micro, grad_accum=accum, world_size=world.world_size,
                   precision=precision, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                   weight_decay=cfg.weight_decay, pin_memory=device.pin_memory, where=ds_path,
                   torch_adam=device.torch_adam, hidden_size=model_config.hidden_size)
    for warning in validate_ds_config(ds, ds_path):
        if world.is_main:
            print(f"warning: {warning}", file=sys.stderr)
    resume = settle_resume(cfg, sources, model_config, objective, ds, world)
    switch = settle_switch(resume, ds, world, gbs)
    if world.is_main:
        print_data(sources, stats, cfg.seq_len, gbs, total_steps)
    return Plan(cfg=cfg, device=device, world=world, sources=sources, manifest=manifest,
                model_config=model_config, objective=objective, ds_config=ds, ds_path=ds_path,
                precision=precision, micro_batch=micro, grad_accum=accum, global_batch=gbs,
                total_steps=total_steps, warmup_steps=warmup, lr_lambda=lr_lambda,
                train_samples=tuple(st["num_samples"] for st in stats),
                eval_sources=eval_sources, resume=resume, switch=switch)


def print_data(sources: Sources, stats: list[dict[str, Any]], seq_len: int, gbs: int,
               total_steps: int) -> None:
    """The start-up data lines: samples, tokens, epochs over the run (per source of a mix)."""
    samples = total_steps * gbs
    if sources.is_mixture:
        for source, share, st in zip(sources.items, sources.mixture.fractions, stats):
            print(f"data: {source.name} ({source.path}), weight {share:.3f}: "
                  f"{st['num_samples']:,} train samples ({st['tokens']:,} tokens); "
                  f"{samples * share / st['num_samples']:.2f} epochs over the run",
                  file=sys.stderr)
        print(f"data: a mixture of {len(stats)} datasets; {gbs} samples = {gbs * seq_len:,} "
              f"tokens per step", file=sys.stderr)
        return
    st = stats[0]
    print(f"data: {st['num_samples']:,} train samples of {seq_len} tokens "
          f"({st['tokens']:,} tokens); {gbs} samples = {gbs * seq_len:,} tokens per "
          f"step; {total_steps} steps = {samples / st['num_samples']:.2f} epochs",
          file=sys.stderr)


def settle_deepspeed(cfg: TrainConfig, device: Device,
                     is_main: bool) -> tuple[Path, dict[str, Any], str]:
    """(ds_config path, its contents, precision). Without --zero or --ds-config: ZeRO-0, or
    ZeRO-1 for bf16, where DeepSpeed accumulates and all-reduces gradients in fp32 (at ZeRO-0 it
    refuses fp32 accumulation with bf16 weights: gradients would be summed in bf16)."""
    ds_path = cfg.ds_config or zero_config_path(cfg.zero or 0)
    raw_ds = load_ds_config(ds_path)
    precision = settle_precision(raw_ds, cfg.precision, device, ds_path)
    if precision == "bf16" and zero_stage(raw_ds) == 0:
        if cfg.zero is None and cfg.ds_config is None:
            ds_path = zero_config_path(1)
            raw_ds = load_ds_config(ds_path)
        elif is_main:
            print("warning: bf16 at ZeRO-0 accumulates and all-reduces gradients in bf16; "
                  "DeepSpeed allows fp32 accumulation from ZeRO-1 on (--zero 1: the same "
                  "communication volume, optimizer states sharded)", file=sys.stderr)
    return ds_path, raw_ds, precision


def settle_model(cfg: TrainConfig, manifest: dict[str, Any], device: Device,
                 precision: str) -> tuple[str, Any]:
    """(objective, model config): the preset with the dataset's vocabulary and special ids."""
    p = preset(cfg.model_name)
    objective = cfg.objective or p.objective
    if objective != p.objective:
        raise UserError(f"--objective {objective}: preset {cfg.model_name} is "
                        f"{'an encoder (mlm)' if p.objective == 'mlm' else 'a decoder (clm)'}")
    eod = manifest["eod_token_id"]
    special = {"pad_token_id": manifest.get("pad_token_id")}
    if objective == "clm":
        special.update(bos_token_id=manifest.get("bos_token_id", eod), eos_token_id=eod)
    attn = attention_implementation(cfg.attn, device, precision, cfg.packing)
    model_config = build_config(cfg.model_name, vocab_size=int(manifest["vocab_size"]),
                                special_ids=special, overrides=parse_overrides(cfg.model_arg),
                                dropout=cfg.dropout, attn_implementation=attn,
                                pad_vocab_to=cfg.pad_vocab_to)
    if cfg.seq_len > max_positions(model_config):
        raise UserError(f"--seq-len {cfg.seq_len}: above the {max_positions(model_config)} "
                        f"positions of {cfg.model_name} (raise it with --model-arg)")
    return objective, model_config


def settle_data(cfg: TrainConfig, sources: Sources, objective: str,
                is_main: bool) -> tuple[list[dict[str, Any]], tuple[int, ...]]:
    """(each dataset's train split figures, the datasets with a val split to evaluate on), from
    dataset.json."""
    from app.data.loader import DataSpec, dataset_stats  # the data side (loaders) of the app

    def stats(source: Source, split: str) -> dict[str, Any]:
        return dataset_stats(DataSpec(source.path, split, cfg.seq_len, objective, cfg.packing,
                                      cfg.seed, cfg.mask_prob), source.manifest)

    train, with_eval = [], []
    for i, source in enumerate(sources.items):
        train.append(stats(source, "train"))
        splits = source.manifest["splits"]
        if "val" not in splits or not splits["val"]["shards"]:
            continue
        try:
            stats(source, "val")
            with_eval.append(i)
        except UserError as e:
            if is_main:
                print(f"no evaluation{f' of {source.name}' if sources.is_mixture else ''}: {e}",
                      file=sys.stderr)
    return train, tuple(with_eval)


def settle_schedule(cfg: TrainConfig, global_batch: int) -> tuple[int, int, Callable]:
    """(total steps, warmup steps, LR schedule): --max-steps, capped by --max-tokens."""
    total_steps = cfg.max_steps
    if cfg.max_tokens is not None:
        total_steps = min(total_steps, math.ceil(cfg.max_tokens / (global_batch * cfg.seq_len)))
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, total_steps // 20)
    return total_steps, warmup, schedule_fn(warmup_steps=warmup, total_steps=total_steps,
                                            decay=cfg.lr_decay, min_lr_ratio=cfg.min_lr_ratio)


def settle_resume(cfg: TrainConfig, sources: Sources, model_config, objective: str,
                  ds: dict[str, Any], world: World) -> tuple[Path, str] | None:
    """The checkpoint to resume from, checked against this run (or None)."""
    resume = check_run_dir(cfg, sources)
    if resume is None:
        return None
    where = resume[0] / resume[1]
    state = checkpoint.read_state(*resume)
    sources.check_resume(state.get("mixture"), where)
    checkpoint.check_resumable(state, fingerprint=sources.fingerprint,
                               model_config=model_config.to_dict(),
                               sample_layout=sample_layout(cfg, objective), where=where)
    checkpoint.check_files(where)
    return resume


@dataclass(frozen=True)
class Switch:
    """How this run's layout relates to the checkpoint it resumes (app/checkpoint/universal.py)."""

    saved: Layout | None
    now: Layout
    history: tuple[dict[str, Any], ...]
    """Every layout the run has had: {"step", "zero_stage", "world_size", "precision",
    "offload"}, one entry per change (checkpoints and config.json record it)."""
    convert: bool
    """The checkpoint is not loadable as it is: load its universal form."""


def settle_switch(resume: tuple[Path, str] | None, ds: dict[str, Any], world: World,
                  global_batch: int) -> Switch:
    """Compare the checkpoint's layout with this run's; say what changes."""
    now = layout_of(ds, world.world_size)
    entry = {"step": 0, **asdict(now)}
    if resume is None:
        return Switch(None, now, (entry,), False)
    state = checkpoint.read_state(*resume)
    saved = saved_layout(state)
    history = tuple(state.get("history") or ({"step": 0, **asdict(saved)},))
    tag_dir = resume[0] / resume[1]
    convert = not is_universal(tag_dir) and not saved.loads_natively(now)
    why_not = convertible_into(now) if convert or is_universal(tag_dir) else None
    if why_not:
        raise UserError(f"{tag_dir}: written with {saved}; {why_not}")
    if saved != now:
        history += ({**entry, "step": int(state["step"])},)
    if world.is_main and saved != now:
        how = ("converting it" if convert else "DeepSpeed loads it as it is") \
            if not is_universal(tag_dir) else "a converted checkpoint"
        print(f"resume: {tag_dir} was written with {saved}; this run is {now} ({how})",
              file=sys.stderr)
    if world.is_main and state["global_batch"] != global_batch:
        print(f"resume: the global batch was {state['global_batch']} samples and is "
              f"{global_batch} now: continuing from sample {state['consumed_samples']:,} "
              f"(step {state['step']}); the step count and LR schedule continue from there",
              file=sys.stderr)
    return Switch(saved, now, history, convert)


def sample_layout(cfg: TrainConfig, objective: str) -> dict[str, Any]:
    """The settings that decide which sample a stream position is (checkpoint.SAMPLE_LAYOUT)."""
    values = {**cfg.to_dict(), "objective": objective}
    return {k: values[k] for k in checkpoint.SAMPLE_LAYOUT}


def check_tokenizer_copy(data: Path, manifest: dict[str, Any]) -> None:
    """The dataset's tokenizer copy must be the one it was made with (one hash of one file)."""
    tok_dir = data / manifest["tokenizer"].get("dir", TOKENIZER_DIR)
    found = tokenizer_fingerprint(tok_dir)
    if found != manifest["tokenizer"]["fingerprint"]:
        raise UserError(f"{tok_dir / 'tokenizer.json'}: fingerprint {found} does not match "
                        f"{data / 'dataset.json'}'s {manifest['tokenizer']['fingerprint']} "
                        f"(replaced or corrupt; run `python -m data_tools inspect --verify`)")


def batch_geometry(cfg: TrainConfig, world_size: int) -> tuple[int, int, int]:
    """(micro batch, gradient accumulation, global batch) from the flags and the world size."""
    micro = cfg.micro_batch
    per_step = micro * world_size
    if cfg.global_batch is not None:
        if cfg.global_batch % per_step:
            raise UserError(f"--global-batch {cfg.global_batch}: not a multiple of --micro-batch "
                            f"{micro} x {world_size} ranks")
        accum = cfg.global_batch // per_step
        if cfg.grad_accum is not None and cfg.grad_accum != accum:
            raise UserError(f"--grad-accum {cfg.grad_accum} disagrees with --global-batch "
                            f"{cfg.global_batch} (= {accum} x {micro} x {world_size} ranks)")
    else:
        accum = cfg.grad_accum or 1
    return micro, accum, micro * accum * world_size


def check_run_dir(cfg: TrainConfig, sources: Sources) -> tuple[Path, str] | None:
    """The checkpoint to resume from (or None), refusing to clobber a previous run silently."""
    rundir.check_out(cfg.out, sources.paths)
    ckpt_dir = cfg.out / rundir.CHECKPOINTS
    resume = checkpoint.find_resume(cfg.resume, cfg.out)
    if resume is None and not cfg.overwrite:
        previous = [n for n in (rundir.CHECKPOINTS, rundir.METRICS, rundir.SUMMARY)
                    if (cfg.out / n).exists()]
        has_ckpt = checkpoint.latest_tag(ckpt_dir) is not None
        if previous and (cfg.resume == "never" or has_ckpt):
            raise UserError(f"--out {cfg.out}: holds a previous run ({', '.join(previous)}); "
                            f"continue it with --resume auto, or replace it with --overwrite")
    # with --resume auto, tags newer than `latest` are interrupted saves (prepare_run_dir)
    if resume is not None and cfg.resume != "auto":
        newer = checkpoint.tags_after(ckpt_dir, resume[1])
        if newer:  # saving here would interleave two histories and prune the wrong one
            raise UserError(f"--resume {resume[0] / resume[1]}: {ckpt_dir} holds later "
                            f"checkpoints ({', '.join(newer)}); resume into another --out, or "
                            f"move those away")
    return resume


def prepare_run_dir(cfg: TrainConfig, resume: tuple[Path, str] | None) -> None:
    """Main rank, before the process group: clear (--overwrite), create and mark RUN_DIR, and
    remove what an interrupted save left (tags newer than `latest`)."""
    if cfg.overwrite and resume is None and rundir.is_run_dir(cfg.out):
        rundir.clear(cfg.out)
    rundir.create(cfg.out)
    if cfg.resume != "auto":
        return
    for tag in checkpoint.remove_partial_saves(cfg.out / rundir.CHECKPOINTS):
        print(f"removed {cfg.out / rundir.CHECKPOINTS / tag}: an interrupted save (`latest` "
              f"names an earlier checkpoint)", file=sys.stderr)


def stage_data(cfg: TrainConfig, sources: Sources, world: World) -> list[Path]:
    """Copy the datasets to node-local --stage-to (a mixture's each to its own subdirectory),
    before the process group exists (a copy may take longer than any collective's timeout).
    Every rank calls it: one rank a node copies, the others wait on the destination's lock and
    then find the copy complete (data_tools.stage)."""
    from data_tools.stage import stage  # lazily: only runs that stage need it

    dirs = sources.staged(cfg.stage_to)
    for source, dst in zip(sources.items, dirs):
        try:
            stage(source.path, dst, progress=world.local_rank == 0)
        except UserError as e:
            raise UserError(f"--stage-to {cfg.stage_to}: {e}") from None
    return dirs


EXIT_LOST_PEER = 1  # another rank failed first: its output has the reason


def dropout_seed(seed: int, rank: int) -> int:
    """Each rank's torch RNG seed for dropout: a stream per rank, apart from the weights' seed
    (`seed` itself; 1_000_003 is a prime above any rank count, so no two (seed, rank) meet)."""
    return seed * 1_000_003 + rank + 1


def run(args: argparse.Namespace) -> int:
    started = time.time()
    cfg = TrainConfig.from_args(args)
    device = detect()
    threads = set_cpu_threads()
    adopt_launcher_env()  # ranks from MPI/Slurm launchers, once, before anything reads them
    plan = plan_run(cfg, device, world_from_env())
    if plan.world.is_main:  # before the group starts, so a failure here is one line everywhere
        prepare_run_dir(cfg, plan.resume)
        if plan.switch.convert:  # once, next to the checkpoint (checkpoint.load reuses it)
            universal.ensure(*plan.resume, checkpoint.read_state(*plan.resume), plan.switch.now)
    data_dirs = (stage_data(cfg, plan.sources, plan.world) if cfg.stage_to
                 else plan.sources.paths)
    enable_tf32(device, plan.precision, cfg.tf32)
    world = init_distributed(device, timeout_minutes=cfg.dist_timeout)
    barrier()
    state = TrainState()
    engine, n_params = build_engine(plan, state.cooldown)
    torch.manual_seed(dropout_seed(cfg.seed, world.rank))
    state.facts = {"world_size": world.world_size, "global_batch": engine.train_batch_size(),
                   "dataset_fingerprint": plan.sources.fingerprint,
                   **({"mixture": plan.sources.record()} if plan.sources.is_mixture else {}),
                   "model_config": plan.model_config.to_dict(), "run_config": cfg.to_dict(),
                   "ds_config": plan.ds_config,
                   "flat_master_groups": checkpoint.flat_master_groups(engine),
                   **asdict(plan.switch.now), "history": list(plan.switch.history)}
    if plan.resume is not None:
        state.load_state_dict(checkpoint.load(engine, *plan.resume))
        checkpoint.restore_rng(*plan.resume, rank=world.rank)
        if world.is_main:
            print(f"resumed from {plan.resume[0] / plan.resume[1]} at step {state.step}",
                  file=sys.stderr)
    run_config = describe_run(plan, engine, world, data_dirs, n_params, threads)
    shape = run_shape(plan, engine)
    if world.is_main:
        record_run(plan, engine, run_config, data_dirs[0], n_params, shape)
    trainer = build_trainer(plan, engine, world, data_dirs, state, run_config, shape)
    try:
        summary = trainer.fit()
    except RuntimeError as e:
        if not lost_peer(e):
            raise
        raise Stopped(f"rank {world.rank} lost a peer in a collective (another rank stopped: "
                      f"its own output says why)", EXIT_LOST_PEER) from None
    finally:
        trainer.close()
    reference.record(engine, cfg.out, seq_len=cfg.seq_len, step=state.step,
                     vocab_size=int(plan.manifest["vocab_size"]), device=trainer.device,
                     precision=plan.precision, is_main=world.is_main)
    if world.is_main:
        finish(plan, summary, started)
    barrier()
    shutdown()
    return 0


def build_engine(plan: Plan, cooldown: anomaly.Cooldown):
    """The model (same seed, same weights on every rank) inside the DeepSpeed engine; its LR
    schedule is the plan's times the cool-down after a rollback (part of the train state)."""
    cfg = plan.cfg
    # ZeRO-3: built partitioned (no rank holds the whole model), same weights as ZeRO 0-2
    zero3 = plan.ds_config if zero_stage(plan.ds_config) == 3 else None
    model = build_model(plan.model_config, gradient_checkpointing=cfg.gradient_checkpointing,
                        seed=cfg.seed, for_training=True, zero3_config=zero3)
    n_params = count_parameters(model)
    engine = initialize(model, plan.ds_config, anomaly.scaled(plan.lr_lambda, cooldown),
                        optimizer_groups(model, cfg.weight_decay))
    if cfg.compile:
        engine.compile()
    return engine, n_params


def record_run(plan: Plan, engine, run_config: dict[str, Any], data_dir: Path,
               n_params: int, shape: telemetry.RunShape) -> None:
    """Main rank: the start-up banner, RUN_DIR/config.json and the run's copy of the tokenizer."""
    cfg, world = plan.cfg, plan.world
    print(f"model: {cfg.model_name} ({plan.objective}), {n_params / 1e6:.2f}M parameters, "
          f"{plan.precision}, ZeRO-{zero_stage(plan.ds_config)}, {world.world_size} rank(s) "
          f"x micro batch {engine.train_micro_batch_size_per_gpu()} x grad accum "
          f"{engine.gradient_accumulation_steps()} = {engine.train_batch_size()} samples/step",
          file=sys.stderr)
    print(telemetry.banner(shape, nodes=run_config["environment"]["nodes"],
                           total_steps=plan.total_steps, device=plan.device.model),
          file=sys.stderr)
    write_json_atomic(cfg.out / rundir.RUN_CONFIG, run_config)
    tok_src = data_dir / plan.manifest["tokenizer"].get("dir", TOKENIZER_DIR)
    if tok_src.is_dir():
        with output.writing(cfg.out / rundir.TOKENIZER_DIR):
            shutil.copytree(tok_src, cfg.out / rundir.TOKENIZER_DIR, dirs_exist_ok=True)


def finish(plan: Plan, summary: dict[str, Any], started: float) -> None:
    """Main rank: RUN_DIR/summary.json and the last line."""
    cfg = plan.cfg
    summary = {**summary, "wall_seconds": round(time.time() - started, 3),
               "stopped_early": summary["steps"] < plan.total_steps,
               "resumed_from": str(plan.resume[0] / plan.resume[1]) if plan.resume else None}
    write_json_atomic(cfg.out / rundir.SUMMARY, summary)
    print(f"done: {summary['steps']} steps, {summary['tokens_seen']:,} tokens, "
          f"{summary['tokens_per_sec']:,.0f} tokens/s; run in {cfg.out}", file=sys.stderr)


def describe_run(plan: Plan, engine, world: World, data_dirs: list[Path], n_params: int,
                 threads: int | None) -> dict[str, Any]:
    """RUN_DIR/config.json: the resolved run, the DeepSpeed config and the environment."""
    cfg = plan.cfg
    return {
        "run": cfg.to_dict(),
        "model": {"preset": cfg.model_name, "objective": plan.objective,
                  "parameters": n_params, "config": plan.model_config.to_dict()},
        "batch": {"micro_batch": engine.train_micro_batch_size_per_gpu(),
                  "grad_accum": engine.gradient_accumulation_steps(),
                  "global_batch": engine.train_batch_size(),
                  "global_batch_tokens": engine.train_batch_size() * cfg.seq_len},
        "schedule": {"total_steps": plan.total_steps, "warmup_steps": plan.warmup_steps,
                     "decay": cfg.lr_decay, "lr": cfg.lr, "min_lr_ratio": cfg.min_lr_ratio},
        "precision": plan.precision,
        "zero_stage": zero_stage(plan.ds_config),
        "history": list(plan.switch.history),
        "ds_config_file": str(plan.ds_path),
        "ds_config": plan.ds_config,
        "engine": engine_facts(engine),
        "data": describe_data(plan, data_dirs),
        "environment": {"world_size": world.world_size,
                        "local_world_size": world.local_world_size,
                        "nodes": max(1, world.world_size // max(1, world.local_world_size)),
                        "device": plan.device.as_dict(), "cpu_threads_per_rank": threads,
                        "hostname": platform.node(), "python": platform.python_version(),
                        **versions()},
    }


def describe_data(plan: Plan, data_dirs: list[Path]) -> dict[str, Any]:
    """config.json's "data": where the dataset was read from; for a mixture every source (name,
    path, weight, its quantised share, fingerprint, where it was read from)."""
    sources, staged = plan.sources, plan.cfg.stage_to is not None
    common = {"staged": staged, "fingerprint": sources.fingerprint,
              "vocab_size": plan.manifest["vocab_size"]}
    if not sources.is_mixture:
        return {"source": str(sources.paths[0]), "read_from": str(data_dirs[0]), **common}
    return {"mixture": [{**entry, "read_from": str(d)}
                        for entry, d in zip(sources.record(), data_dirs)], **common}


def run_shape(plan: Plan, engine) -> telemetry.RunShape:
    """What telemetry needs to turn times into throughput and MFU (docs: app/telemetry/flops.py)."""
    cfg = plan.cfg
    per_token = flops_per_token(ModelShape.from_config(plan.model_config), cfg.seq_len,
                                head_fraction(plan.objective, cfg.mask_prob))
    peak = telemetry.peak_tflops(plan.device.model, plan.precision, tf32=cfg.tf32,
                                 override=cfg.peak_tflops)
    return telemetry.RunShape(global_batch=engine.train_batch_size(), seq_len=cfg.seq_len,
                              world_size=plan.world.world_size, flops_per_token=per_token,
                              peak_tflops=peak)


def build_trainer(plan: Plan, engine, world: World, data_dirs: Path | list[Path],
                  state: TrainState, run_config: dict[str, Any],
                  shape: telemetry.RunShape) -> Trainer:
    """The loop with its loaders (`data_dirs`: where each dataset is read from; one directory
    for one dataset), logger, schedule and guards."""
    from app.data.loader import (DataSpec, MixtureSpec, build_eval_loader, build_train_loader,
                          default_num_workers)

    data_dirs = [data_dirs] if isinstance(data_dirs, Path) else data_dirs
    cfg = plan.cfg
    workers = (cfg.num_workers if cfg.num_workers is not None
               else default_num_workers(world.local_world_size))
    pin = plan.device.pin_memory
    micro = engine.train_micro_batch_size_per_gpu()  # read back: the engine owns batch sizes

    sources = plan.sources

    def spec(split: str, i: int) -> DataSpec:  # a mixture's sources each with its own seed
        return DataSpec(data_dirs[i], split, cfg.seq_len, plan.objective, cfg.packing,
                        sources.seed(cfg.seed, i), cfg.mask_prob)

    train_spec = (MixtureSpec(tuple(spec("train", i) for i in range(len(data_dirs))),
                              tuple(sources.names), tuple(s.weight for s in sources.items))
                  if sources.is_mixture else spec("train", 0))

    def train_batches(consumed: int, skip: frozenset[int]):
        return faults.slow_loader(build_train_loader(
            train_spec, micro_batch=micro, global_batch=engine.train_batch_size(),
            dp_rank=world.rank, dp_size=world.world_size, consumed_samples=consumed,
            num_workers=workers, pin_memory=pin, skip=skip), world.rank)

    def eval_set(i: int) -> EvalSet:
        return EvalSet(name=sources.names[i] if sources.is_mixture else None,
                       weight=sources.items[i].weight,
                       batches=lambda: build_eval_loader(
                           spec("val", i), micro_batch=micro, dp_rank=world.rank,
                           dp_size=world.world_size, max_samples=cfg.eval_samples,
                           num_workers=0, pin_memory=pin))

    wandb = WandbSettings(mode=wandb_mode(cfg.wandb), project=cfg.wandb_project,
                          name=cfg.run_name or cfg.out.resolve().name, group=cfg.wandb_group,
                          tags=tuple(cfg.wandb_tags))
    logger = MetricsLogger(cfg.out, enabled=world.is_main, wandb=wandb, run_config=run_config,
                           resumed_step=state.step if plan.resume else None)
    schedule = Schedule(total_steps=plan.total_steps,
                        stop_step=min(cfg.stop_at_step or plan.total_steps, plan.total_steps),
                        log_every=cfg.log_every, eval_every=cfg.eval_every,
                        save_every=cfg.save_every, keep_last=cfg.keep_last,
                        skip_failed_saves=cfg.save_errors == "skip")
    return Trainer(engine=engine, world=world, device=plan.device.torch_device(world.local_rank),
                   schedule=schedule, state=state, seq_len=cfg.seq_len, objective=plan.objective,
                   train_batches=train_batches,
                   eval_sets=[eval_set(i) for i in plan.eval_sources], logger=logger,
                   run_dir=cfg.out, shape=shape, compute_clock=ComputeClock(plan.device),
                   guards=build_guards(plan, world, state, train_spec, engine),
                   data_figures=lambda position: sources.epochs(position, plan.train_samples))


def build_guards(plan: Plan, world: World, state: TrainState, train_spec, engine) -> Guards:
    """The anomaly rules and monitor, the agreed stop signals, the watchdog, the skipped
    batches (every rank reads them: a resume skips them too)."""
    from app.data.loader import batch_samples

    cfg = plan.cfg
    rules = anomaly.Rules(policy=cfg.on_anomaly, window=cfg.spike_window, z=cfg.spike_z,
                          rise=cfg.spike_rise, max_rollbacks=cfg.max_rollbacks,
                          cooldown_steps=cfg.cooldown_steps, cooldown_factor=cfg.cooldown_factor)
    skip = rundir.read_skipped(cfg.out)
    state.consumed_samples = skip_ahead(state.consumed_samples, engine.train_batch_size(), skip)
    return Guards(rules=rules,
                  monitor=anomaly.LossMonitor(rules, plan.device.torch_device(world.local_rank)),
                  stops=StopRequests(world.world_size > 1),
                  watchdog=Watchdog(cfg.hang_timeout, world.rank), skip=skip,
                  describe_batch=lambda g: batch_samples(train_spec, g,
                                                         engine.train_batch_size()))
