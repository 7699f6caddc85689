"""One way to build a run: `build(cfg)` takes a TrainConfig and returns the run ready to
train (`Built`), for `app train` (app/train.py), the benchmarks (bench/) and the tests.

plan (app/settle.py: checked before any process group) -> run directory (main rank) -> stage
data -> join the group -> engine -> resume -> Trainer. One TrainState is made here: the engine's
LR schedule and the Trainer's recovery share its cool-down by construction. The parts (`_engine`,
`_trainer`, `_loaders`, `_guards`) are this module's own: nothing else assembles a Trainer.
"""
from __future__ import annotations

import platform
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from app import rundir
from app.checkpoint import store as checkpoint
from app.checkpoint import tags, universal
from app.checkpoint.train_state import TrainState
from app.config import TrainConfig
from app.data.order import skip_ahead
from app.data.sources import Sources
from app.faults import anomaly, preemption
from app.faults import injection as faults
from app.faults.preemption import StopRequests
from app.faults.recovery import Recovery
from app.faults.watchdog import Watchdog
from app.init_from import load_init_weights
from app.models.build import build_model, count_parameters, skeleton_group_names
from app.runtime import islands, registry
from app.runtime.device import (
    ComputeClock,
    Device,
    cpu_share,
    cpu_share_warning,
    detect,
    enable_tf32,
    set_cpu_threads,
)
from app.runtime.dist import World, adopt_launcher_env, barrier, init_distributed, world_from_env
from app.runtime.ds_config import zero_stage
from app.runtime.engine import (
    apply_lr_schedule,
    engine_facts,
    global_batch,
    initialize,
    versions,
)
from app.runtime.outer import OuterSync
from app.runtime.param_groups import group_names, optimizer_groups
from app.settle import Plan, plan_run
from app.telemetry import figures as telemetry
from app.telemetry.flops import ModelShape, flops_per_token, head_fraction
from app.telemetry.sinks import MetricsLogger, wandb_settings
from app.trainer import EvalSet, Guards, Schedule, Trainer
from data_tools import output
from data_tools.errors import UserError
from data_tools.manifest import TOKENIZER_DIR
from data_tools.output import write_json_atomic


@dataclass(frozen=True)
class Built:
    """A run ready to train: `built.trainer.fit()`, then `built.trainer.close()`."""

    plan: Plan
    world: World
    engine: Any
    """The DeepSpeed engine; its LR schedule is the plan's times `state.cooldown`."""
    state: TrainState
    """The one train state: the Trainer advances it, a rollback cools its LR down."""
    trainer: Trainer
    n_params: int
    data_dirs: list[Path]
    """Where each dataset is read from (the staged copies with --stage-to)."""


def build(cfg: TrainConfig, device: Device | None = None) -> Built:
    """Config in, ready trainer out. `device`: the detected one unless a caller (a probe)
    passes a variant of it."""
    preemption.catch()  # first: a stop signal from here on ends the run at a safe point
    device = device or detect()
    threads = set_cpu_threads()
    adopt_launcher_env()  # ranks from MPI/Slurm launchers, once, before anything reads them
    plan = plan_run(cfg, device, world_from_env())
    patches = deepspeed_patches(cfg, plan.world)  # a patch that cannot apply: before any write
    warning = cpu_share_warning(device, cpu_share(), threads, loader_workers(cfg, plan.world))
    if warning and plan.world.local_rank == 0:  # each node's: nodes may be bound differently
        print(warning, file=sys.stderr)
    faults.slow_start()  # test switches (app/faults/injection.py)
    faults.refuse_training()
    preemption.stop_before_loop("before the run started")  # nothing written yet
    if plan.world.is_main:  # before the group starts, so a failure here is one line everywhere
        prepare_run_dir(cfg, plan.resume)
        if plan.switch.convert:  # once, next to the checkpoint (checkpoint.load reuses it)
            universal.ensure(*plan.resume, tags.read_state(*plan.resume), plan.switch.now,
                             names_for=skeleton_group_names)
    data_dirs = (stage_data(cfg, plan.sources, plan.world) if cfg.stage_to
                 else list(plan.sources.paths))
    preemption.stop_before_loop("while preparing the run")  # each step above ended whole
    enable_tf32(device, plan.precision, cfg.tf32)
    world = init_distributed(device, timeout_minutes=cfg.dist_timeout)
    barrier()
    stops = StopRequests(world.world_size > 1)  # from here the ranks stop together
    state = TrainState()  # the one state: the engine's LR schedule reads its cool-down
    engine, n_params = _engine(plan, state.cooldown, patches)
    torch.manual_seed(dropout_seed(cfg.seed, world.rank))
    state.facts = state_facts(plan, engine, world)
    if plan.resume is not None:
        state.load_state_dict(checkpoint.load(engine, *plan.resume))
        apply_lr_schedule(engine)  # this run's schedule (and cool-down) from its first step
        checkpoint.restore_rng(*plan.resume, rank=world.rank)
        if world.is_main:
            print(f"resumed from {plan.resume[0] / plan.resume[1]} at step {state.step}",
                  file=sys.stderr)
    outer = getattr(engine, "app_outer", None)
    if outer is not None and not outer.loaded:  # a fresh round from the weights it has
        outer.reset_anchor()
    if outer is not None and plan.resume is None and plan.init_from is None and world.is_main:
        print(DILOCO_FROM_SCRATCH, file=sys.stderr)
    preemption.stop_before_loop("while building the engine", stops.agree_now())
    stops.start()  # a signal from now on: the loop saves a checkpoint
    run_config = describe_run(plan, engine, world, data_dirs, n_params, threads)
    shape = run_shape(plan, engine)
    if world.is_main:
        record_run(plan, engine, run_config, data_dirs[0], n_params, shape)
    trainer = _trainer(plan, engine, world, data_dirs, state, run_config, shape, stops)
    faults.install(trainer)  # the tests' DSPRETRAIN_TEST_* switches (none in a real run)
    return Built(plan=plan, world=world, engine=engine, state=state, trainer=trainer,
                 n_params=n_params, data_dirs=data_dirs)


def state_facts(plan: Plan, engine, world: World) -> dict[str, Any]:
    """What every checkpoint of this run records about it (app.checkpoint.train_state)."""
    return {"world_size": world.world_size, "global_batch": global_batch(engine),
            "dataset_fingerprint": plan.sources.fingerprint,
            **({"mixture": plan.sources.record()} if plan.sources.is_mixture else {}),
            "model_config": plan.model_config.to_dict(), "run_config": plan.cfg.to_dict(),
            "ds_config": plan.ds_config,
            "flat_master_groups": checkpoint.flat_master_groups(engine),
            # a low-communication run: how many islands (the layout's world is one island's)
            **({"islands": world.world_size // plan.island_ranks} if plan.island_ranks else {}),
            # the optimizer's groups by name, as `_engine` builds them (universal.read)
            "param_group_names": group_names(engine.module, plan.switch.now.optimizer_blocks),
            **asdict(plan.switch.now), "history": list(plan.switch.history)}


def prepare_run_dir(cfg: TrainConfig, resume: tuple[Path, str] | None) -> None:
    """Main rank, before the process group: clear (--overwrite), create and mark RUN_DIR, and
    remove what an interrupted save left (tags newer than `latest`)."""
    if cfg.overwrite and resume is None and rundir.is_run_dir(cfg.out):
        rundir.clear(cfg.out)
    rundir.create(cfg.out)
    if cfg.resume != "auto":
        return
    for tag in tags.remove_partial_saves(cfg.out / rundir.CHECKPOINTS):
        print(f"removed {cfg.out / rundir.CHECKPOINTS / tag}: an interrupted save (resuming "
              f"an earlier checkpoint)", file=sys.stderr)


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


def dropout_seed(seed: int, rank: int) -> int:
    """Each rank's torch RNG seed for dropout: a stream per rank, apart from the weights' seed
    (`seed` itself; 1_000_003 is a prime above any rank count, so no two (seed, rank) meet)."""
    return seed * 1_000_003 + rank + 1


def deepspeed_patches(cfg: TrainConfig, world: World) -> frozenset[str]:
    """The DeepSpeed patches this run may install (--deepspeed-patches), their targets checked
    in the installed DeepSpeed (app.runtime.registry.select): a patch named that cannot apply is
    a UserError here, before the run directory; under `all` one that cannot is left out with
    one line (main rank)."""
    patches, notes = registry.select(cfg.deepspeed_patches)
    if world.is_main:
        for note in notes:
            print(note, file=sys.stderr)
    return patches


def _engine(plan: Plan, cooldown: anomaly.Cooldown, patches: frozenset[str] = registry.ALL):
    """The model (same seed, same weights on every rank) inside the DeepSpeed engine with the
    selected patches; its LR schedule is the plan's times the cool-down after a rollback (part
    of the train state). A low-communication run (--dp-mode diloco): DeepSpeed's data-parallel
    world is the rank's island (app.runtime.islands), and the outer step rides on the engine
    (`engine.app_outer`, app.runtime.outer)."""
    cfg = plan.cfg
    isles = islands.make(plan.island_ranks) if plan.island_ranks else None
    # ZeRO-3: built partitioned (no rank holds the whole model), same weights as ZeRO 0-2
    zero3 = plan.ds_config if zero_stage(plan.ds_config) == 3 else None
    model = build_model(plan.model_config, gradient_checkpointing=cfg.gradient_checkpointing,
                        seed=cfg.seed, for_training=True, zero3_config=zero3)
    if plan.init_from is not None:  # a warm start: checked by settle (not at ZeRO-3)
        load_init_weights(model, plan.init_from)
    n_params = count_parameters(model)
    # ZeRO-1/2: groups of layer blocks, each partitioned on its own (app.runtime.overlap)
    groups = optimizer_groups(model, cfg.weight_decay, plan.switch.now.optimizer_blocks)
    engine = initialize(model, plan.ds_config, anomaly.scaled(plan.lr_lambda, cooldown), groups,
                        patches, mpu=isles.mpu if isles else None)
    if isles is not None:
        engine.app_outer = OuterSync(engine, isles, every=cfg.outer_every, lr=cfg.outer_lr,
                                     momentum=cfg.outer_momentum, dtype=cfg.outer_dtype)
    if cfg.compile:
        engine.compile()
    return engine, n_params


DILOCO_FROM_SCRATCH = (
    "note: --dp-mode diloco from random weights: DiLoCo starts from synchronously trained ones, "
    "and on this app its outer step from step 0 stalled or trailed synchronous training where a "
    "synchronous start did not (docs/benchmarks.md); train the first steps with --dp-mode sync, "
    "then resume with --dp-mode diloco (docs/recipes.md)")


def record_run(plan: Plan, engine, run_config: dict[str, Any], data_dir: Path,
               n_params: int, shape: telemetry.RunShape) -> None:
    """Main rank: the start-up banner, RUN_DIR/config.json and the run's copy of the tokenizer."""
    cfg, world = plan.cfg, plan.world
    print(f"model: {cfg.model_name} ({plan.objective}), {n_params / 1e6:.2f}M parameters, "
          f"{plan.precision}, ZeRO-{zero_stage(plan.ds_config)}, {world.world_size} rank(s) "
          f"x micro batch {engine.train_micro_batch_size_per_gpu()} x grad accum "
          f"{engine.gradient_accumulation_steps()} = {global_batch(engine)} samples/step",
          file=sys.stderr)
    print(f"gradients: {engine_facts(engine)['grad_reduction']}", file=sys.stderr)
    nodes = run_config["environment"]["nodes"]
    hint = stage_hint(zero_stage(plan.ds_config), nodes)
    if hint:
        print(hint, file=sys.stderr)
    print(telemetry.banner(shape, nodes=nodes,
                           total_steps=plan.total_steps, device=plan.device.model),
          file=sys.stderr)
    write_json_atomic(cfg.out / rundir.RUN_CONFIG, run_config)
    tok_src = data_dir / plan.manifest["tokenizer"].get("dir", TOKENIZER_DIR)
    if tok_src.is_dir():
        with output.writing(cfg.out / rundir.TOKENIZER_DIR):
            shutil.copytree(tok_src, cfg.out / rundir.TOKENIZER_DIR, dirs_exist_ok=True)


def stage_hint(stage: int, nodes: int) -> str | None:
    """The start-up line that points a ZeRO-0 run across nodes at `app plan`: ZeRO-0 sends every
    gradient byte during backward, where ZeRO-1 sends half of them (its weight all-gather)
    during the next forward. Which of them is faster depends on the link (docs/benchmarks.md,
    netsim rounds 6-7: ZeRO-1 ahead at comm = compute, ZeRO-0 ahead on an unshaped link)."""
    if stage != 0 or nodes < 2:
        return None
    return (f"network: ZeRO-0 across {nodes} nodes all-reduces every gradient during backward; "
            f"ZeRO-1 moves half of those bytes during the next forward instead. `python -m app "
            f"plan --nodes {nodes} --net-gbps G ...` compares the stages on your link")


def describe_run(plan: Plan, engine, world: World, data_dirs: list[Path], n_params: int,
                 threads: int | None) -> dict[str, Any]:
    """RUN_DIR/config.json: the resolved run, the DeepSpeed config and the environment."""
    cfg = plan.cfg
    return {
        "run": cfg.to_dict(),
        "model": {"preset": cfg.model_name, "objective": plan.objective,
                  "parameters": n_params, "config": plan.model_config.to_dict(),
                  "attention": plan.attention[0], "attention_why": plan.attention[1]},
        "batch": {"micro_batch": engine.train_micro_batch_size_per_gpu(),
                  "grad_accum": engine.gradient_accumulation_steps(),
                  "global_batch": global_batch(engine),
                  "global_batch_tokens": global_batch(engine) * cfg.seq_len},
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
                        "cpu": {**cpu_share().as_dict(), "threads": threads,
                                "loader_workers": loader_workers(cfg, world)},
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
                                head_fraction(plan.objective, cfg.mask_prob),
                                attention_span=plan.attention_span)
    peak = telemetry.peak_tflops(plan.device.model, plan.precision, tf32=cfg.tf32,
                                 override=cfg.peak_tflops)
    return telemetry.RunShape(global_batch=global_batch(engine), seq_len=cfg.seq_len,
                              world_size=plan.world.world_size, flops_per_token=per_token,
                              peak_tflops=peak)


def _trainer(plan: Plan, engine, world: World, data_dirs: list[Path], state: TrainState,
                  run_config: dict[str, Any], shape: telemetry.RunShape,
                  stops: StopRequests) -> Trainer:
    """The loop with its loaders (`data_dirs`: where each dataset is read from), logger,
    schedule and guards (`stops`: the agreed stop, made once the group exists)."""
    cfg = plan.cfg
    train_spec, train_batches, eval_sets = _loaders(plan, engine, world, data_dirs)
    logger = MetricsLogger(cfg.out, enabled=world.is_main, wandb=wandb_settings(cfg),
                           run_config=run_config,
                           resumed_step=state.step if plan.resume else None)
    schedule = Schedule(total_steps=plan.total_steps,
                        stop_step=min(cfg.stop_at_step or plan.total_steps, plan.total_steps),
                        log_every=cfg.log_every, eval_every=cfg.eval_every,
                        save_every=cfg.save_every, keep_last=cfg.keep_last,
                        skip_failed_saves=cfg.save_errors == "skip")
    guards = _guards(plan, world, state, engine, train_spec, logger, stops)
    return Trainer(engine=engine, world=world, device=plan.device.torch_device(world.local_rank),
                   schedule=schedule, state=state, seq_len=cfg.seq_len, objective=plan.objective,
                   train_batches=train_batches, eval_sets=eval_sets, logger=logger,
                   run_dir=cfg.out, shape=shape, compute_clock=ComputeClock(plan.device),
                   guards=guards, data_figures=lambda position: plan.sources.epochs(
                       position, plan.train_samples))


def loader_workers(cfg: TrainConfig, world: World) -> int:
    """Loader workers per rank: --num-workers, else the rank's share of its cores decides."""
    from app.data.loader import default_num_workers

    return (cfg.num_workers if cfg.num_workers is not None
            else default_num_workers(world.local_world_size))


def _loaders(plan: Plan, engine, world: World,
            data_dirs: list[Path]) -> tuple[Any, Callable, list[EvalSet]]:
    """(the train data's spec, its loader from a stream position without the skipped batches,
    the eval sets) of this rank; batch sizes read back from the engine, which owns them."""
    from app.data.loader import DataSpec, MixtureSpec, build_eval_loader, build_train_loader

    cfg, sources = plan.cfg, plan.sources
    workers = loader_workers(cfg, world)
    pin = plan.device.pin_memory
    micro = engine.train_micro_batch_size_per_gpu()

    def spec(split: str, i: int) -> DataSpec:  # a mixture's sources each with its own seed
        return DataSpec(data_dirs[i], split, cfg.seq_len, plan.objective, cfg.packing,
                        sources.seed(cfg.seed, i), cfg.mask_prob)

    train_spec = (MixtureSpec(tuple(spec("train", i) for i in range(len(data_dirs))),
                              tuple(sources.names), tuple(s.weight for s in sources.items))
                  if sources.is_mixture else spec("train", 0))

    def train_batches(consumed: int, skip: frozenset[int]):
        return build_train_loader(
            train_spec, micro_batch=micro, global_batch=global_batch(engine),
            dp_rank=world.rank, dp_size=world.world_size, consumed_samples=consumed,
            num_workers=workers, pin_memory=pin, skip=skip)

    def eval_set(i: int) -> EvalSet:
        return EvalSet(name=sources.names[i] if sources.is_mixture else None,
                       weight=sources.items[i].weight,
                       batches=lambda: build_eval_loader(
                           spec("val", i), micro_batch=micro, dp_rank=world.rank,
                           dp_size=world.world_size, max_samples=cfg.eval_samples,
                           num_workers=0, pin_memory=pin))

    return (train_spec, faults.slow_loaders(train_batches, world.rank),
            [eval_set(i) for i in plan.eval_sources])


def _guards(plan: Plan, world: World, state: TrainState, engine, train_spec,
                 logger: MetricsLogger, stops: StopRequests) -> Guards:
    """Anomaly recovery (its rules and monitor, the skipped batches: every rank reads them, a
    resume skips them too), the agreed stop signals, the watchdog."""
    from app.data.loader import batch_samples

    cfg, gbs = plan.cfg, global_batch(engine)
    rules = anomaly.Rules(policy=cfg.on_anomaly, window=cfg.spike_window, z=cfg.spike_z,
                          rise=cfg.spike_rise, max_rollbacks=cfg.max_rollbacks,
                          cooldown_steps=cfg.cooldown_steps, cooldown_factor=cfg.cooldown_factor)
    skip = rundir.read_skipped(cfg.out, since_step=state.phase_step)
    state.consumed_samples = skip_ahead(state.consumed_samples, gbs, skip)
    recovery = Recovery(
        rules=rules, monitor=anomaly.LossMonitor(rules, plan.device.torch_device(world.local_rank)),
        skip=skip, describe_batch=lambda g: batch_samples(train_spec, g, gbs), state=state,
        global_batch=gbs, run_dir=cfg.out, logger=logger, is_main=world.is_main)
    return Guards(recovery=recovery, stops=stops,
                  watchdog=Watchdog(cfg.hang_timeout, world.rank))
