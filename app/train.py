"""`python -m app train`: pretrain a model on a dataset directory.

config -> `build` (app/build.py: plan, run directory, data staging, process group, engine,
resume, Trainer) -> Trainer.fit -> reference logits -> summary. Start it with the deepspeed
launcher (or launch.sh) for many ranks; a bare `python -m app train` is a world of one.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from app.faults import preemption

# Before the imports below load torch (seconds): a scheduler's signal from the first moment
# ends the run at build's first safe point instead of killing it (app/faults/preemption.py).
preemption.catch()

from app import config as config_mod
from app import reference, rundir
from app.build import build
from app.config import TrainConfig
from app.runtime.dist import barrier, lost_peer, shutdown
from app.settle import Plan
from data_tools.errors import EXIT_USER_ERROR, Stopped, UserError
from data_tools.output import write_json_atomic

EXIT_LOST_PEER = 1  # another rank failed first: its output has the reason


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config_mod.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Train; the exit status is also written for launch.sh (app.faults.preemption)."""
    code = 1
    try:
        code = train(args)
    except Exception as e:
        stopped = preemption.starting_stopped(e)  # a start-up a stop signal broke
        code = exit_status(stopped or e)
        if stopped is None:
            raise
        raise stopped from None
    except KeyboardInterrupt:
        code = 130
        raise
    finally:
        preemption.record_exit(code)
        if code != preemption.EXIT_PREEMPTED:  # a stopping rank keeps its handlers to the end:
            preemption.release()  # the launcher's own SIGTERM must not cut the line saying why
    return code


def exit_status(error: Exception) -> int:
    """The status data_tools.errors.run_cli gives `error`."""
    if isinstance(error, Stopped):
        return error.code
    return EXIT_USER_ERROR if isinstance(error, (UserError, OSError)) else 1


def train(args: argparse.Namespace) -> int:
    started = time.time()
    cfg = TrainConfig.from_args(args)
    built = build(cfg)
    plan, world, trainer = built.plan, built.world, built.trainer
    try:
        summary = trainer.fit()
    except RuntimeError as e:
        if not lost_peer(e):
            raise
        raise Stopped(f"rank {world.rank} lost a peer in a collective (another rank stopped: "
                      f"its own output says why)", EXIT_LOST_PEER) from None
    finally:
        trainer.close()
    reference.record(built.engine, cfg.out, seq_len=cfg.seq_len, step=built.state.step,
                     vocab_size=int(plan.manifest["vocab_size"]), device=trainer.device,
                     precision=plan.precision, is_main=world.is_main)
    if world.is_main:
        finish(plan, summary, started)
    barrier()
    shutdown()
    return 0


def finish(plan: Plan, summary: dict[str, Any], started: float) -> None:
    """Main rank: RUN_DIR/summary.json and the last line."""
    cfg = plan.cfg
    summary = {**summary, "wall_seconds": round(time.time() - started, 3),
               "stopped_early": summary["steps"] < plan.total_steps,
               "resumed_from": str(plan.resume[0] / plan.resume[1]) if plan.resume else None}
    write_json_atomic(cfg.out / rundir.SUMMARY, summary)
    print(f"done: {summary['steps']} steps, {summary['tokens_seen']:,} tokens, "
          f"{summary['tokens_per_sec']:,.0f} tokens/s; run in {cfg.out}", file=sys.stderr)
