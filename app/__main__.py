"""`python -m app COMMAND`: train | export | report | demo | plan | tune | convert | bench."""
from __future__ import annotations

import gc
import importlib
import sys

from data_tools.errors import run_cli

# command -> (module exposing `add_arguments(parser)` and `run(args) -> int`, help)
COMMANDS = {
    "train": ("app.train",
              "pretrain a model on a dataset directory (start with the deepspeed launcher)"),
    "export": ("app.export", "write a run's weights, config and tokenizer in Hugging Face format"),
    "report": ("app.telemetry.report",
               "print a run's summary and plot its curves (RUN_DIR/curves.png)"),
    "demo": ("app.demo",
             "the whole pipeline on Python's standard-library sources (the quickstart)"),
    "plan": ("app.plan.command", "memory, batch and throughput per ZeRO stage before a run"),
    "tune": ("app.plan.tune",
             "measure the largest micro batch and the loader workers on this machine"),
    "convert": ("app.checkpoint.convert",
                "make a checkpoint loadable under another ZeRO stage and world size (offline)"),
    "bench": ("app.sweep.command", "the scaling sweep: tokens/s, step time, data wait, memory and "
              "scaling efficiency against world size, ZeRO stage, model (results.csv, plots)"),
}


def main(argv=None) -> int:
    if argv is not None:  # called in-process (tests, scripts): the collector is the caller's
        return run_cli("python -m app", __doc__, COMMANDS, argv)
    # A process of its own. A command's imports (torch, DeepSpeed, transformers) make ~500k
    # objects that live as long as the process; the automatic collections walking them are ~15 %
    # of a rank's start-up CPU. The collector is off until they are frozen: below for every
    # command but train, in app.runtime.engine.initialize for train (DeepSpeed is imported on the
    # way there). docs/design.md, "Start-up".
    gc.disable()
    try:
        argv = sys.argv[1:]
        if argv and argv[0] in COMMANDS:
            importlib.import_module(COMMANDS[argv[0]][0])  # what run_cli imports
        if not argv or argv[0] != "train":
            end_start_up()
        return run_cli("python -m app", __doc__, COMMANDS, argv)
    finally:
        gc.enable()  # a train that ended before its engine


def end_start_up() -> None:
    """What start-up made is kept for good: collected once, frozen out of the collector's way
    (never walked again, never freed), and the collector on again."""
    gc.collect()
    gc.freeze()
    gc.enable()


if __name__ == "__main__":
    sys.exit(main())
