"""Benchmark: `data_tools prepare` end to end vs the tokenizer's own `encode_batch`, same cores.

Corpus: the running Python's standard-library sources (every *.py under the stdlib directory,
site-packages excluded). For each tokenizer kind:

  reference  `Tokenizer.encode_batch(texts)` on the texts already in memory, Rust threads on all
             cores (TOKENIZERS_PARALLELISM=true), timed around the call only;
  prepare    `python -m data_tools prepare --workers N` in a subprocess, timed wall-clock around
             the whole command: start-up, reading, tokenizing, writing shards, checksums, manifest.

Both see the same texts (prepare's own corpus reader makes them) and report tokens/s and MB/s of
input; the ratio prepare/reference is the figure of merit (target >= 0.85). Runs alternate and
the median of `--repeats` is kept, so load from other processes hits both alike.

    python bench/bench_prepare.py [--kinds wordpiece,bpe] [--vocab-size 16000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "true"  # the reference uses every core through Rust

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_tools.corpus import Corpus  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAIN_SUBSET = ("json", "email", "http", "logging", "asyncio", "collections", "argparse.py",
                "typing.py", "inspect.py", "tarfile.py")


def stdlib_inputs() -> list[str]:
    """Every top-level entry of the stdlib except site-packages (third-party code)."""
    return [str(p) for p in sorted(STDLIB.iterdir()) if p.name != "site-packages"]


def data_tools(*argv: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "data_tools", *argv], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def bench_kind(kind: str, inputs: list[str], work: Path, args) -> dict:
    from tokenizers import Tokenizer

    tok_dir = work / f"tok-{kind}"
    data_tools("tokenizer", "--input", *[str(STDLIB / n) for n in TRAIN_SUBSET],
               "--include", "*.py", "--out", str(tok_dir), "--kind", kind,
               "--vocab-size", str(args.vocab_size))
    corpus = Corpus(inputs, "*.py")
    texts = [text for text, _, _ in corpus.pieces()]
    input_bytes = corpus.input_bytes
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.encode_batch(texts[:50], add_special_tokens=False)  # warm up the thread pool
    ref_s, fast_s, prep_s = [], [], []
    tokens = 0
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        encodings = tok.encode_batch(texts, add_special_tokens=False)
        ref_s.append(time.perf_counter() - t0)
        tokens = sum(len(e.ids) for e in encodings)
        del encodings
        t0 = time.perf_counter()
        tok.encode_batch_fast(texts, add_special_tokens=False)
        fast_s.append(time.perf_counter() - t0)
        out = work / f"data-{kind}"
        shutil.rmtree(out, ignore_errors=True)
        prep_s.append(data_tools("prepare", "--input", *inputs, "--include", "*.py",
                                 "--tokenizer", str(tok_dir), "--out", str(out),
                                 "--workers", str(args.workers)))
    import json

    manifest = json.loads((work / f"data-{kind}" / "dataset.json").read_text())
    prep_tokens = manifest["tokens"] - manifest["documents"]  # without the EOD tokens
    assert prep_tokens == tokens, (prep_tokens, tokens)
    ref, fast, prep = (statistics.median(x) for x in (ref_s, fast_s, prep_s))
    return {"kind": kind, "files": len(corpus.files), "documents": manifest["documents"],
            "tokens": tokens, "input_mb": input_bytes / 1e6, "ref_s": ref, "fast_s": fast,
            "prep_s": prep, "ratio": ref / prep, "ratio_fast": fast / prep,
            "reduction": manifest["size_reduction_pct"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="wordpiece,bpe")
    p.add_argument("--vocab-size", type=int, default=16000)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    inputs = stdlib_inputs()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, {platform.platform()}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_prepare.") as tmp:
        for kind in args.kinds.split(","):
            rows.append(bench_kind(kind, inputs, Path(tmp), args))
    print(f"corpus: {rows[0]['files']} .py files of {STDLIB} (site-packages excluded), "
          f"{rows[0]['input_mb']:.1f} MB; medians of {args.repeats} alternating runs; "
          f"prepare --workers {args.workers}\n")
    print("| tokenizer | tokens | encode_batch tok/s (MB/s) | encode_batch_fast tok/s (MB/s) "
          "| prepare tok/s (MB/s) | prepare / encode_batch | prepare / encode_batch_fast |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        def cell(s: float, r: dict = r) -> str:
            return f"{r['tokens'] / s:,.0f} ({r['input_mb'] / s:.2f})"
        print(f"| {r['kind']} | {r['tokens']:,} | {cell(r['ref_s'])} | {cell(r['fast_s'])} "
              f"| {cell(r['prep_s'])} | **{r['ratio']:.2f}** | {r['ratio_fast']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
