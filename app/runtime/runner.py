"""`python -m app.runtime.runner ARGS`: DeepSpeed's launcher, `deepspeed ARGS`, with Python's
collector paused for its imports (docs/design.md, "Start-up").

The same `main()` the `deepspeed` command and `python -m deepspeed.launcher.runner` run
(`deepspeed.launcher.runner`, DeepSpeed 0.19), the same arguments and exit status; launch.sh starts
it. Its import of `deepspeed` brings torch and most of DeepSpeed, and Python's automatic
collections walked that growing heap again and again: 2.9 CPU-s against 2.2 with them paused
(0.19.8, docs/benchmarks.md, "The launcher's start-up"), paid once a job on its first node. What
the runner starts (DeepSpeed's launch.py, the ranks) is started as DeepSpeed starts it.
"""
from __future__ import annotations

import gc
import sys


def main() -> int:
    gc.disable()
    try:
        from deepspeed.launcher.runner import main as deepspeed_main
    finally:
        # what the imports made stays for the process's life: out of the collector's way
        gc.collect()
        gc.freeze()
        gc.enable()
    deepspeed_main()  # exits with the job's status where that is an error; returns otherwise
    return 0


if __name__ == "__main__":
    sys.exit(main())
