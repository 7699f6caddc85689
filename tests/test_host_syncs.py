"""No host sync in a training step (issue 22): real `python -m app train` runs with a probe
(tests/step_probe.py `count_host_syncs`, installed before the app runs: in a fork of the tests' warm
process, tests/zygote.py, or by a sitecustomize.py first on PYTHONPATH in a fresh one) that
counts DeepSpeed's accelerator `synchronize()` calls and host reads of tensors by call site. A
run of N steps and one of 2N steps, logging, evaluating and saving only at the last step, must
make the same calls: nothing may grow with the steps, at every ZeRO stage, in fp32 and bf16
(the CPU accelerator has bf16; fp16 is GPU-only, and its dynamic loss scale reads an overflow
flag each step by design), and with gradient accumulation.

DeepSpeed's `synchronize()` is a no-op on CPU but the call is made where it would drain a GPU,
so counting calls sees on CPU what costs on a GPU. Syncs made only on a GPU (streams) are listed
in docs/gpu.md, not seen here.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, TINY, clean_env, python

N = 4
STEP_PROBE = str(REPO / "tests" / "step_probe.py")
PROBE = f"""import importlib.util, os
_spec = importlib.util.spec_from_file_location("host_sync_probe", {STEP_PROBE!r})
_probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_probe)
_probe.count_host_syncs(os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
"""


# the probe first, then `python -m app ARGV` (a fork of the warm process, whose torch and
# accelerators the probe patches where they are loaded already: tests/step_probe.py)
PROBED_APP = """import runpy, sys
import app.__main__
from tests.step_probe import count_host_syncs
count_host_syncs(sys.argv[1])
sys.argv = [app.__main__.__file__, *sys.argv[2:]]  # as `python -m app` sets it
runpy.run_path(app.__main__.__file__, run_name="__main__")
"""


def counted(tmp_path: Path, data: Path, steps: int, *args: str) -> dict:
    """The probe's counts for the training process of one 1-rank run of `steps` steps."""
    probe = tmp_path / f"probe{steps}"
    (probe / "out").mkdir(parents=True)
    last = str(steps)  # log, eval and save once, at the last step of both runs
    # 4 x 32 tokens a micro batch: what is counted is the calls a step makes, not its size, and
    # a bf16 step on CPU costs by its tokens (most of a bf16 run's CPU at 64)
    proc = python("-c", PROBED_APP, probe / "out", "train", "--data", data, "--out",
                  tmp_path / f"run{steps}", *TINY, "--model", "bert-tiny", "--seed", "5",
                  "--max-steps", last, "--log-every", last, "--eval-every", last, "--save-every",
                  last, "--eval-samples", "8", "--seq-len", "32", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(p.read_text()) for p in (probe / "out").glob("*.json")]
    recs = [r for r in recs if r["argv"] and r["argv"][0].endswith(f"app{os.sep}__main__.py")]
    assert len(recs) == 1, [r["argv"] for r in recs]
    counts = recs[0]["counts"]
    assert counts.get("patched_accelerators") and counts.get("patched_torch"), counts
    return recs[0]


def growth(short: dict, long: dict) -> dict[str, float]:
    """Call sites whose count grew from the N-step run to the 2N-step one, per extra step."""
    def where(site: str) -> str:
        return re.sub(r"\S*/(site-packages|dist-packages)/", "", site.replace(f"{REPO}/", ""))
    keys = set(short["sites"]) | set(long["sites"])
    grew = {k: long["sites"].get(k, 0) - short["sites"].get(k, 0) for k in keys}
    return {where(k): d / N for k, d in grew.items() if d > 0}


CONFIGS = {"zero0-fp32": ["--zero", "0", "--precision", "fp32"],
           "zero1-fp32": ["--zero", "1", "--precision", "fp32"],
           "zero2-fp32": ["--zero", "2", "--precision", "fp32"],
           "zero3-fp32": ["--zero", "3", "--precision", "fp32"],
           "zero0-bf16": ["--zero", "0", "--precision", "bf16"],
           "zero1-bf16": ["--zero", "1", "--precision", "bf16"],
           "zero2-bf16": ["--zero", "2", "--precision", "bf16"],
           "zero3-bf16": ["--zero", "3", "--precision", "bf16"],
           "zero2-bf16-accum2": ["--zero", "2", "--precision", "bf16", "--grad-accum", "2"],
           # FlexAttention's block masks built each forward from the packed documents' ids
           "zero1-fp32-flex-doc-packed": ["--zero", "1", "--precision", "fp32", "--packing",
                                          "doc-packed", "--attn", "flex", "--dropout", "0"]}


@pytest.mark.slow  # two app runs each: 30-50 s a config on the shared 2-core box
@pytest.mark.parametrize("config", list(CONFIGS))
def test_no_host_sync_grows_with_the_steps(mlm_dataset, tmp_path, config):
    args = CONFIGS[config]
    short, long = (counted(tmp_path, mlm_dataset, n, *args) for n in (N, 2 * N))
    grew = growth(short, long)
    assert not grew, f"{config} grows, per step: {grew}"


def test_the_probe_counts_syncs_and_reads(tmp_path):
    """3 synchronize() calls and 3 host reads in a script are counted as such (the probe is the
    measure above: a probe that counts nothing would pass it)."""
    probe = tmp_path / "probe"
    (probe / "out").mkdir(parents=True)
    (probe / "sitecustomize.py").write_text(PROBE)
    script = tmp_path / "three.py"
    script.write_text("import torch\nfrom deepspeed.accelerator import get_accelerator\n"
                      "for _ in range(3):\n    get_accelerator().synchronize()\n"
                      "t = torch.ones(3) * 2\nt.sum().item(); float(t[0]); t.tolist()\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True,
                          text=True, env=clean_env(PYTHONPATH=f"{probe}{os.pathsep}{REPO}"),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rec,) = [json.loads(p.read_text()) for p in (probe / "out").glob("*.json")]
    assert rec["counts"]["synchronize"] == 3 and rec["counts"]["read"] == 3, rec["counts"]
    # the way the runs above are probed: in a fork of the warm process, torch loaded already
    forked = tmp_path / "forked"
    forked.mkdir()
    proc = python("-c", "import runpy, sys\nfrom tests.step_probe import count_host_syncs\n"
                  "count_host_syncs(sys.argv[1])\nrunpy.run_path(sys.argv[2])", forked, script)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rec,) = [json.loads(p.read_text()) for p in forked.glob("*.json")]
    assert rec["counts"]["synchronize"] == 3 and rec["counts"]["read"] == 3, rec["counts"]
