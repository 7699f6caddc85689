"""The journal of a prepare run: what `prepare --resume` needs, written as shards complete
(docs/design.md, "Datasets").

Files in the dataset directory, all hidden, all removed once `dataset.json` is written:

    .prepare-journal.jsonl   line 1: the run's key (the tokenizer's fingerprint and every flag
                             that shapes the output); then one line a completed shard: the
                             shard's entry, the documents and tokens written, the input position
                             after the last document written (corpus.Position), and each split's
                             shard still open (name, documents, tokens, .bin bytes)
    .prepare-inputs.json     the input files (path, bytes, mtime) the last run read
    .<shard>.sizes           document sizes (int64) of a shard open at a checkpoint

A checkpoint is taken when a shard closes, between two documents: every completed shard is
final, and the other split's open shard is flushed (its .bin to that length, its sizes to the
sidecar). A journal line is appended and fsynced; a crash can only leave a torn last line, which
the reader drops. So a resume finds a consistent cut: completed shards kept as they are, open
shards cut back to their recorded length, anything newer removed, and the input read again from
the recorded position (files before it are not opened; the current file is re-read up to it
without decoding). Only the inputs up to that position must be unchanged: what comes after it
is read as it is now, as an uninterrupted run would.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from data_tools import output
from data_tools.cli import flag
from data_tools.corpus import Corpus, Position
from data_tools.errors import UserError
from data_tools.manifest import ShardEntry
from data_tools.schema import NonNegativeInt, Schema, check, read_json, read_jsonl

JOURNAL = ".prepare-journal.jsonl"
INPUTS = ".prepare-inputs.json"
FORMAT = "dspretrain-prepare-journal"
SPLITS = ("train", "val")


def sizes_path(prefix: Path) -> Path:
    """The sidecar holding the document sizes of the open shard `prefix`."""
    return prefix.with_name(f".{prefix.name}.sizes")


_SHARD_FILE = re.compile(r"^(\.?)(train|val)_(\d+)\.(bin|idx|sizes)$")


def shard_file(name: str) -> tuple[str, int, str] | None:
    """("train", 3, "bin") for `train_00003.bin`; "sizes" for the sidecar `.train_00003.sizes`;
    None for any other name."""
    m = _SHARD_FILE.match(name)
    if m is None or (m.group(1) == ".") != (m.group(4) == "sizes"):
        return None
    return m.group(2), int(m.group(3)), m.group(4)


def is_journal_file(name: str) -> bool:
    """A file the journal writes: itself, the input list, a sizes sidecar, or a temporary twin
    of the first two."""
    if name in (JOURNAL, INPUTS) or (shard_file(name) or ("", 0, ""))[2] == "sizes":
        return True
    return name.startswith((f".{JOURNAL}.", f".{INPUTS}.")) and name.endswith(".tmp")


def discard_uncommitted(out: Path, completed: dict[str, int],
                        open_shards: dict[str, dict[str, Any] | None]) -> None:
    """Remove what was written after a checkpoint: shards past it, sidecars of shards not open
    at it, and an open shard's .idx (from a finalize the checkpoint does not know of). An open
    shard's .bin stays; `ShardWriter(resume_sizes=...)` cuts it back."""
    with output.writing(out):
        for p in out.iterdir():
            parsed = shard_file(p.name)
            if parsed is None:
                continue
            split, index, kind = parsed
            done = completed[split]
            is_open = open_shards.get(split) is not None and index == done
            if (index < done and kind != "sizes") or (is_open and kind != "idx"):
                continue
            p.unlink(missing_ok=True)


def input_files(corpus: Corpus) -> list[dict[str, Any]]:
    return [{"path": str(f.resolve()), "bytes": s.st_size, "mtime_ns": s.st_mtime_ns}
            for f, s in zip(corpus.files, corpus.stat_results)]


# -- what the journal holds ------------------------------------------------------------------


class Header(Schema):
    format: Literal[FORMAT]
    format_version: Literal[1]
    key: dict[str, Any]


class OpenShard(Schema):
    name: str
    documents: NonNegativeInt
    tokens: NonNegativeInt
    bin_bytes: NonNegativeInt


class PositionEntry(Schema):
    file: NonNegativeInt
    record: NonNegativeInt
    bytes: NonNegativeInt
    documents: NonNegativeInt
    empty_documents: NonNegativeInt
    replaced_chars: NonNegativeInt
    chain: str


class Closed(Schema):
    split: Literal[SPLITS]
    shard: ShardEntry


class Checkpoint(Schema):
    closed: Closed
    documents: NonNegativeInt
    tokens: NonNegativeInt
    position: PositionEntry
    open: dict[Literal[SPLITS], OpenShard | None]


class InputFile(Schema):
    path: str
    bytes: NonNegativeInt
    mtime_ns: int


class InputsFile(Schema):
    files: list[InputFile]


@dataclass
class ResumePoint:
    """The last checkpoint of an interrupted run."""

    key: dict[str, Any]
    shards: dict[str, list[dict[str, Any]]]  # completed shards of each split, in order
    last: dict[str, Any]  # the last checkpoint line
    lines: list[dict[str, Any]]  # every valid journal line, header first

    @property
    def position(self) -> Position:
        return Position(**self.last["position"])

    @property
    def open(self) -> dict[str, dict[str, Any] | None]:
        return {s: self.last["open"].get(s) for s in SPLITS}

    @property
    def completed(self) -> int:
        return sum(len(v) for v in self.shards.values())


# -- the journal -----------------------------------------------------------------------------


class Journal:
    """The journal of the prepare run writing `out`."""

    def __init__(self, out: Path):
        self.out = out
        self.path = out / JOURNAL
        self.checkpoints = 0  # lines this run wrote

    def load(self) -> ResumePoint | None:
        """The last checkpoint (None: no journal, or no shard completed yet)."""
        if not self.path.is_file():
            return None
        lines = [record for _, record in read_jsonl(self.path)]
        if not lines:
            return None
        check(Header, lines[0], f"{self.path}: line 1")
        shards: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
        for i, line in enumerate(lines[1:], 2):
            check(Checkpoint, line, f"{self.path}: line {i}")
            shards[line["closed"]["split"]].append(line["closed"]["shard"])
        if len(lines) == 1:
            return None
        return ResumePoint(lines[0]["key"], shards, lines[-1], lines)

    def begin(self, key: dict[str, Any], inputs: list[dict[str, Any]],
              resume: ResumePoint | None) -> None:
        """Start this run's journal: the input list, then the header and the checkpoints it
        continues (rewritten whole, so a torn last line is gone before anything is appended)."""
        output.write_json_atomic(self.out / INPUTS, {"files": inputs})
        head = resume.lines if resume is not None else [
            {"format": FORMAT, "format_version": 1, "key": key,
             "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}]
        output.write_text_atomic(self.path, "".join(_line(r) for r in head))

    def record(self, checkpoint: dict[str, Any]) -> None:
        output.append_bytes(self.path, _line(checkpoint).encode())
        self.checkpoints += 1

    def remove(self) -> None:
        """The run is complete (or never got anywhere): the journal goes."""
        with output.writing(self.out):
            for p in self.out.iterdir():
                if is_journal_file(p.name):
                    p.unlink(missing_ok=True)


def _line(record: dict[str, Any]) -> str:
    return output.to_json(record, indent=None) + "\n"


# -- may this run continue that one? ---------------------------------------------------------


def check_resumable(out: Path, point: ResumePoint, key: dict[str, Any],
                    inputs: list[dict[str, Any]]) -> None:
    """UserError naming the first difference that would make the result differ from an
    uninterrupted run of this command."""
    reason = key_difference(point.key, key) or _inputs_difference(out, point, inputs)
    if reason:
        raise UserError(f"--out {out}: cannot resume: {reason} (start over with --overwrite)")


def key_difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    for name in sorted(set(old) | set(new)):
        was, now = old.get(name), new.get(name)
        if was == now:
            continue
        if name == "tokenizer":
            return f"the tokenizer changed (fingerprint {was}, now {now})"
        return f"{flag(name)} was {was!r}, now {now!r}"
    return None


def _inputs_difference(out: Path, point: ResumePoint,
                       inputs: list[dict[str, Any]]) -> str | None:
    """The inputs up to the resume position must be those the interrupted run read."""
    recorded = read_json(out / INPUTS, InputsFile,
                         missing=f"{out / INPUTS}: missing (the journal's input list)")["files"]
    upto = point.position.file
    if upto >= len(recorded):
        return f"{out / INPUTS} lists {len(recorded)} files, the journal is at file {upto + 1}"
    for i in range(upto + 1):
        was = recorded[i]
        if i >= len(inputs):
            return f"input {was['path']} is no longer among the inputs"
        now = inputs[i]
        if now["path"] != was["path"]:
            return f"input file {i + 1} is {now['path']}, was {was['path']}"
        if now["bytes"] != was["bytes"]:
            return f"input {now['path']} changed ({now['bytes']} bytes, was {was['bytes']})"
        if now["mtime_ns"] != was["mtime_ns"]:
            return f"input {now['path']} was modified since the interrupted run"
    return None
