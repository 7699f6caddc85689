"""The run directory: the names of its files, the schema each is read back through, and which
directories `app train` may write into or replace (docs/design.md, "Run directory").

    RUN_DIR/.dspretrain.json  marker: this is a run directory of `app train`
    RUN_DIR/config.json       resolved run config + DeepSpeed config + environment facts
    RUN_DIR/metrics.jsonl     one JSON object per log interval and per eval
    RUN_DIR/summary.json      written at the end: steps, tokens, wall time, throughput, best eval
    RUN_DIR/reference.pt      the final model's logits on a fixed batch (checks an export)
    RUN_DIR/tokenizer/        copy of the dataset's tokenizer (an export takes it from here)
    RUN_DIR/checkpoints/      DeepSpeed checkpoint tags + `latest` (app.checkpoint.store, .tags)
    RUN_DIR/wandb/            the wandb run (its id in wandb/run_id, so a resume continues it)
    RUN_DIR/skipped_batches.jsonl  global batches skipped after an anomaly (every resume too)
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Literal

from data_tools import output
from data_tools.errors import UserError
from data_tools.schema import NonNegativeFloat, NonNegativeInt, Schema, check, read_json, read_jsonl

KIND = "run directory"
COMMAND = "app train"
RUN_CONFIG = "config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
REFERENCE = "reference.pt"
CHECKPOINTS = "checkpoints"
TOKENIZER_DIR = "tokenizer"
WANDB_ID = "wandb/run_id"
SKIPPED = "skipped_batches.jsonl"


class ModelEntry(Schema):
    preset: str
    objective: Literal["mlm", "clm"]
    parameters: NonNegativeInt
    config: dict[str, Any]


class RunConfigFile(Schema):
    """RUN_DIR/config.json, as `app export` and `app report` need it."""

    model: ModelEntry
    zero_stage: Literal[0, 1, 2, 3] = 0
    precision: Literal["bf16", "fp16", "fp32"] = "fp32"
    run: dict[str, Any]
    data: dict[str, Any] = {}


class SummaryFile(Schema):
    steps: NonNegativeInt
    tokens_seen: NonNegativeInt
    tokens_per_sec: NonNegativeFloat = 0.0
    wall_seconds: NonNegativeFloat = 0.0


class MetricRecord(Schema):
    """One line of metrics.jsonl: counters, then named figures (numbers, or null)."""

    step: NonNegativeInt
    consumed_samples: NonNegativeInt | None = None
    tokens_seen: NonNegativeInt
    __pydantic_extra__: dict[str, float | str | None]


class SkippedBatch(Schema):
    """One line of skipped_batches.jsonl."""

    step: NonNegativeInt
    global_batch: NonNegativeInt
    positions: list[NonNegativeInt]
    samples: list[NonNegativeInt] = []
    sources: list[str] = []
    """With a mixture: the source of each sample (parallel to `samples`)."""
    reason: str


def read_skipped(run_dir: Path, since_step: int = 0) -> frozenset[int]:
    """The global batches this run skips (read at every start, so a resume skips them too):
    those skipped after `since_step`, where the run's sequence-length phase began (an earlier
    phase's batch indices are of its own stream of samples)."""
    path = run_dir / SKIPPED
    if not path.is_file():
        return frozenset()
    return frozenset(r["global_batch"] for _, r in read_jsonl(path, SkippedBatch)
                     if r["step"] > since_step)


def add_skipped(run_dir: Path, record: dict[str, Any]) -> None:
    """Append a skipped batch (main rank), the file rewritten whole and atomically."""
    path = run_dir / SKIPPED
    old = path.read_text() if path.is_file() else ""
    output.write_text_atomic(path, old + output.to_json(record, indent=None) + "\n")


def read_run_config(run_dir: Path) -> dict[str, Any]:
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    return read_json(run_dir / RUN_CONFIG, RunConfigFile,
                     missing=f"{run_dir}: no {RUN_CONFIG} (not a run directory of app train)")


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / SUMMARY
    return read_json(path, SummaryFile) if path.is_file() else None


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of metrics.jsonl (a line torn by a crash at the end is skipped)."""
    path = run_dir / METRICS
    if not path.is_file():
        raise UserError(f"{run_dir}: no {METRICS} (not a run directory, or no step logged yet)")
    return [record for _, record in read_jsonl(path, MetricRecord)]


def _made_before_markers(path: Path) -> bool:
    """A run directory written before the marker existed: its config.json has our shape."""
    try:
        check(RunConfigFile, read_json(path / RUN_CONFIG), path)
        return True
    except UserError:
        return False


def is_run_dir(path: Path) -> bool:
    return output.marked_as(path) == KIND or _made_before_markers(path)


def check_out(out: Path, data: list[Path], is_main: bool = True,
              init_from: Path | None = None) -> None:
    """`--out` may be new, empty, or a run directory; never an input: a dataset (of a mixture),
    the `--init-from` source, or inside or around one (the gate of data_tools/output.py, so
    `--overwrite` cannot clear the weights the run is to start from). Whether a directory that
    is there may be used is the main rank's call: it creates the run directory while the other
    ranks still settle, so they could see it half made (its marker being written) and refuse a
    run directory that is fine."""
    output.check_apart(out, [("--data", d) for d in data]
                       + ([("--init-from", init_from)] if init_from is not None else []))
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    if is_main and out.is_dir() and any(out.iterdir()) and not is_run_dir(out):
        raise UserError(f"--out {out}: not empty and not a run directory of `{COMMAND}`; "
                        f"choose an empty or new directory (nothing was changed)")


def create(out: Path) -> None:
    output.make_dirs(out)
    if output.marked_as(out) != KIND:
        with output.writing(out):
            output.mark(out, KIND, COMMAND)


def clear(out: Path) -> None:
    """--overwrite: remove what a previous run left (only the files this app writes)."""
    with output.writing(out):
        shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
        for name in (METRICS, SUMMARY, REFERENCE, RUN_CONFIG, WANDB_ID, SKIPPED):
            (out / name).unlink(missing_ok=True)
