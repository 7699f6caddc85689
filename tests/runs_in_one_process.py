"""Several `app train` runs one after another in one process (a world of one, or the ranks a
launcher started): `build(cfg)`, `fit()`, release its patches, next. The interpreter, torch,
DeepSpeed and transformers load once, and the process group is made once, where a subprocess per
run pays them every time (tests/helpers.py's run_app: ~7 s; a 2-rank launch: ~15 s).

    python tests/runs_in_one_process.py JOBS.json       # JOBS: {name: {"args": [...],
                                                         #        "env": {...}}, ...}

Each job's `args` are `app train` flags (parsed by the app's own parser); `env` sets test
switches (DSPRETRAIN_TEST_*) for that job only. Rank 0 prints one line `RUN name exit summary`
a job; a job that ends with a UserError or Stopped prints its exit status and message. The runs
are the app's, not a copy of it: config.json, metrics.jsonl, checkpoints are written as
`python -m app train` writes them.
"""
from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(name: str, job: dict) -> tuple[int, dict]:
    import argparse

    from app.build import build
    from app.config import TrainConfig, add_arguments
    from app.runtime import registry
    from data_tools.errors import Stopped, UserError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    saved = {k: os.environ.get(k) for k in job.get("env", {})}
    os.environ.update(job.get("env", {}))
    built = None
    try:
        cfg = TrainConfig.from_args(parser.parse_args([str(a) for a in job["args"]]))
        built = build(cfg)
        summary = built.trainer.fit()
        return 0, {"summary": summary, "patches": list(built.engine.app_patches)}
    except Stopped as e:
        return e.code, {"error": str(e)}
    except UserError as e:
        return 2, {"error": str(e)}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if built is not None:
            built.trainer.close()
            registry.release(built.engine)
        del built
        gc.collect()


def main(path: str) -> int:
    jobs = json.loads(Path(path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    for name, job in jobs.items():
        code, result = run(name, job)
        if rank == 0:
            print(f"RUN {name} {code} {json.dumps(result, default=str)}", flush=True)
    from app.runtime.dist import shutdown
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[-1]))
