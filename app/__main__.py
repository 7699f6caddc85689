"""`python -m app COMMAND`: train | export | report | demo | plan | tune | convert | bench."""
from __future__ import annotations

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
    return run_cli("python -m app", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
