"""`python -m app demo`: the whole pipeline on a real corpus already on this machine.

Python's own standard-library sources (code, like the paper's corpus) go through every step a user
runs on their own data: train a tokenizer, pretokenize into shards, inspect and verify, train
bert-tiny through launch.sh (the real deepspeed launcher), export to Hugging Face format, and
load the export back with `transformers`. Each step is the real command, printed before it runs.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from data_tools.errors import UserError

REPO = Path(__file__).resolve().parent.parent
# Standard-library parts left out: tests, third-party packages, GUI toolkits, vendored copies.
_SKIP = {"test", "tests", "site-packages", "dist-packages", "idlelib", "tkinter", "turtledemo",
         "lib2to3", "ensurepip", "__pycache__", "pydoc_data",
         # the build configuration directory (config-3.11-x86_64-linux-gnu on Debian, ...)
         Path(sysconfig.get_config_var("LIBPL") or "config").name}


def add_arguments(p) -> None:
    p.add_argument("--out", type=Path, default=Path("runs/demo"),
                   help="where the tokenizer, dataset, run and export go (default: runs/demo)")
    p.add_argument("--max-steps", type=int, default=1000,
                   help="optimizer steps (default 1000: ~1.5 min of bert-tiny on 2 idle cores)")
    p.add_argument("--procs", type=int, default=1, help="ranks on this box (default 1)")
    p.add_argument("--objective", choices=("mlm", "clm"), default="mlm")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--fresh", action="store_true",
                   help="redo every step (default: reuse the tokenizer/dataset made before)")


def stdlib_inputs() -> list[Path]:
    """The standard library's own modules and packages, found on this machine."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    if not lib.is_dir():
        raise UserError(f"{lib}: the Python standard library sources are not on this machine")
    inputs = [p for p in sorted(lib.iterdir())
              if p.name not in _SKIP and not p.name.startswith(".")
              and ((p.is_file() and p.suffix == ".py")
                   or (p.is_dir() and (p / "__init__.py").exists()))]
    if not inputs:
        raise UserError(f"{lib}: no .py sources found")
    return inputs


def _run(cmd: list, env: dict | None = None, inputs: list[str] = ()) -> None:
    """Run one step, echoing it as a shell command (the corpus paths folded into one word)."""
    shown = [str(c) for c in cmd if str(c) not in inputs]
    if inputs:
        at = shown.index("--input") + 1
        shown[at:at] = [f"<{len(inputs)} stdlib modules and packages>"]
    print(f"\n$ {shlex.join(shown)}", flush=True)
    rc = subprocess.call([str(c) for c in cmd], env=env)
    if rc != 0:
        raise UserError(f"step failed (exit {rc}): {shlex.join(map(str, cmd[:6]))} ...")


def run(args) -> int:
    if args.max_steps <= 0 or args.procs <= 0 or args.vocab_size <= 0:
        raise UserError("--max-steps, --procs and --vocab-size must be positive")
    t0 = time.time()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    kind = "wordpiece" if args.objective == "mlm" else "bpe"
    tok_dir, data_dir = out / f"tokenizer-{kind}", out / f"dataset-{kind}"
    run_dir, export_dir = out / f"run-{args.objective}", out / f"export-{args.objective}"
    py = sys.executable
    inputs = [str(p) for p in stdlib_inputs()]
    print(f"corpus: {len(inputs)} modules and packages of the Python standard library "
          f"({sysconfig.get_paths()['stdlib']})")

    if args.fresh or not (tok_dir / "tokenizer.json").exists():
        _run([py, "-m", "data_tools", "tokenizer", "--input", *inputs, "--include", "*.py",
              "--kind", kind, "--vocab-size", str(args.vocab_size), "--out", tok_dir],
             inputs=inputs)
    if args.fresh or not (data_dir / "dataset.json").exists():
        _run([py, "-m", "data_tools", "prepare", "--input", *inputs, "--include", "*.py",
              "--tokenizer", tok_dir, "--out", data_dir, "--val-fraction", "0.02",
              "--overwrite"], inputs=inputs)
    _run([py, "-m", "data_tools", "inspect", data_dir, "--verify", "--decode", "1"])

    env = dict(os.environ)
    env.setdefault("WANDB_MODE", "offline")
    _run(["bash", REPO / "launch.sh", "--procs-per-node", str(args.procs), "--",
          "--data", data_dir, "--out", run_dir, "--objective", args.objective,
          "--model", "bert-tiny" if args.objective == "mlm" else "gpt-tiny",
          "--max-steps", str(args.max_steps), "--resume", "never", "--overwrite",
          "--eval-every", str(max(args.max_steps // 5, 1)), "--log-every", "25",
          "--save-every", str(args.max_steps)], env=env)
    _run([py, "-m", "app", "report", run_dir])
    _run([py, "-m", "app", "export", run_dir, "--out", export_dir])
    _check_export(export_dir, args.objective)

    print(f"\ndone in {time.time() - t0:.0f} s")
    print(f"  dataset:    {data_dir}")
    print(f"  run:        {run_dir}  (metrics.jsonl, summary.json, curves.png, wandb/)")
    print(f"  checkpoint: {run_dir / 'checkpoints'}")
    print(f"  export:     {export_dir}  (transformers.from_pretrained loads it)")
    return 0


def _check_export(export_dir: Path, objective: str) -> None:
    """Load the export with plain transformers, as a user would, and show a prediction."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import pipeline

    if objective == "mlm":
        fill = pipeline("fill-mask", model=str(export_dir), device=-1)
        text = f"import os\nfor name in os.{fill.tokenizer.mask_token}(path):"
        best = fill(text, top_k=3)
        print(f"\nfill-mask on {text!r}: " + ", ".join(f"{b['token_str']!r} ({b['score']:.2f})"
                                                     for b in best))
    else:
        gen = pipeline("text-generation", model=str(export_dir), device=-1)
        text = "def main():\n    "
        print(f"\ngeneration from {text!r}: "
              f"{gen(text, max_new_tokens=20, do_sample=False)[0]['generated_text']!r}")
