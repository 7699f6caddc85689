"""`python -m data_tools prepare`: pretokenize a corpus into a dataset directory
(docs/design.md, "Datasets").

Pipeline: the parent reads documents (as bounded pieces, see corpus.py) and groups them into ~1 MB
batches; `--workers` processes tokenize batches with `encode_batch` and return numpy arrays; the
parent writes results strictly in input order. Reading and writing overlap tokenizing because a
few batches are always in flight, and memory stays bounded by that window.

Output is a pure function of the input, the tokenizer and the flags other than `--workers`:
the order is the input order, and whether a document goes to val depends only on its global index
`i`: document `i >= 1` is val when `ceil(i * f) > ceil((i - 1) * f)`. So document 1 is always val
(any corpus of 2+ documents gets a val document when f > 0), then every ~1/f-th document, and the
val share is `ceil((n - 1) * f) / n`. Empty documents are counted (summary, dataset.json) but
are not documents: they take no index and write nothing.

Resumable (resume.py): each completed shard is a checkpoint in the journal. A run that stops
(SIGKILL, preemption, a full disk, Ctrl-C) leaves its completed shards and the journal, never a
`dataset.json`; the same command with `--resume` continues from the last checkpoint, byte for
byte as an uninterrupted run. A run that stops before its first checkpoint removes what it made.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import select
import shlex
import shutil
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import chain
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import xxhash
from tqdm import tqdm

from data_tools import manifest as mf
from data_tools import output
from data_tools.cli import config_flags, finite_float, flag, from_args
from data_tools.corpus import DEFAULT_INCLUDE, PIECE_CHARS, Corpus, Position
from data_tools.errors import UserError
from data_tools.resume import (
    Journal,
    ResumePoint,
    check_resumable,
    discard_uncommitted,
    input_files,
    is_journal_file,
    key_difference,
    shard_file,
)
from data_tools.shards import SplitWriter
from data_tools.tokenizer_info import TokenizerInfo

DEFAULT_VAL_FRACTION = 0.01
DEFAULT_SHARD_TOKENS = 1_000_000_000
BATCH_CHARS = 1 << 20
DTYPE_CODES = ("deepspeed", "megatron")
# The flags that shape the output (with the tokenizer): a resume must use the same.
OUTPUT_FLAGS = ("val_fraction", "shard_tokens", "dtype_code", "text_key", "include", "strict",
                "piece_chars")


@dataclass
class PrepareConfig:
    """`python -m data_tools prepare` settings. Field names are the flags with '-' for '_'."""

    input: list[Path]
    """Files or directories (recursive) of .txt, .jsonl(.gz/.zst), .json.gz, .parquet, .arrow,
    Hugging Face save_to_disk directories."""
    tokenizer: Path
    """Hugging Face tokenizer directory."""
    out: Path
    """Dataset directory to write."""
    workers: int = os.cpu_count() or 1
    """Tokenizer processes, one per core by default; the output does not depend on it."""
    val_fraction: float = DEFAULT_VAL_FRACTION
    """Share of documents for the val split (0: no val split)."""
    text_key: str = "text"
    """JSON key or Parquet/Arrow column holding the text."""
    include: str = DEFAULT_INCLUDE
    """Comma-separated globs for directory walks; other patterns read as text."""
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    """Start a new shard once one holds this many tokens."""
    dtype_code: str = "deepspeed"
    """uint16 code in the .idx header: DeepSpeed's MMapIndexedDataset reads 6, Megatron-LM's
    reader 8 (int32 shards are the same for both)."""
    strict: bool = False
    """Invalid UTF-8 is an error, not replaced."""
    overwrite: bool = False
    """Replace a dataset already in --out (only a dataset: nothing else is ever removed)."""
    resume: bool = False
    """Continue an interrupted run in --out from its last completed shard (same command)."""
    batch_chars: int = BATCH_CHARS
    """Characters per tokenizer call (internal)."""
    piece_chars: int = PIECE_CHARS
    """Longest piece of a document tokenized at once (internal)."""

    def __post_init__(self) -> None:
        self.input = [Path(p) for p in self.input]
        self.tokenizer, self.out = Path(self.tokenizer), Path(self.out)
        for name, low in (("workers", 1), ("shard_tokens", 1), ("batch_chars", 1),
                          ("piece_chars", 64)):
            if getattr(self, name) < low:
                raise UserError(f"{flag(name)} {getattr(self, name)}: must be at least {low}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise UserError(f"--val-fraction {self.val_fraction}: must be in [0, 1)")
        if self.dtype_code not in DTYPE_CODES:
            raise UserError(f"--dtype-code {self.dtype_code!r}: expected one of "
                            f"{', '.join(DTYPE_CODES)}")
        if self.resume and self.overwrite:
            raise UserError("--resume and --overwrite: choose one (--overwrite starts over)")

    def command(self) -> str:
        """The command line that makes this dataset again."""
        parts = ["python", "-m", "data_tools", "prepare", "--input", *map(str, self.input),
                 "--tokenizer", str(self.tokenizer), "--out", str(self.out),
                 "--workers", str(self.workers), "--val-fraction", repr(self.val_fraction),
                 "--text-key", self.text_key, "--include", self.include,
                 "--shard-tokens", str(self.shard_tokens), "--dtype-code", self.dtype_code]
        parts += ["--strict"] * self.strict + ["--overwrite"] * self.overwrite
        return shlex.join(parts)

    def output_key(self, tok: TokenizerInfo) -> dict[str, Any]:
        """What the output depends on besides the input files (a resume must match it)."""
        return {"tokenizer": tok.fingerprint, **{k: getattr(self, k) for k in OUTPUT_FLAGS}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add = config_flags(p, PrepareConfig)
    add("input", nargs="+", required=True, metavar="PATH")
    add("tokenizer", type=Path, required=True, metavar="DIR")
    add("out", type=Path, required=True, metavar="DIR")
    add("workers", type=int, metavar="N")
    add("val_fraction", type=finite_float, metavar="F")
    add("text_key", metavar="KEY")
    add("include", metavar="GLOBS")
    add("shard_tokens", type=int, metavar="N")
    add("dtype_code", choices=DTYPE_CODES)
    add("strict", action="store_true")
    add("overwrite", action="store_true")
    add("resume", action="store_true")
    p.add_argument("--batch-chars", type=int, default=BATCH_CHARS, help=argparse.SUPPRESS)
    p.add_argument("--piece-chars", type=int, default=PIECE_CHARS, help=argparse.SUPPRESS)


# -- the workers -----------------------------------------------------------------------------

_worker_tok = None
_worker_eod: int = 0
_worker_dtype: np.dtype = np.dtype(np.int32)


def _init_worker(backend_json: str, eod: int, dtype: str, parent: int) -> None:
    """Each worker is one core: Rust threads on top of N processes would only oversubscribe."""
    global _worker_tok, _worker_eod, _worker_dtype
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and cleans up
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _worker_tok = Tokenizer.from_str(backend_json)
    _worker_tok.no_truncation()
    _worker_tok.no_padding()
    _worker_eod, _worker_dtype = eod, np.dtype(dtype)


def _exit_with_parent(parent: int) -> None:
    """A SIGKILLed parent (preemption) never closes the executor's queues: without this its
    workers would live on, each holding a tokenizer. The parent is `prepare`'s process, not the
    worker's own (the fork server's: `_pool_context`): waited on through a pidfd where the kernel
    has them (Linux 5.3+), else polled."""
    try:
        fd = os.pidfd_open(parent)
    except (AttributeError, OSError):  # no pidfd (or the parent is gone already)
        while _alive(parent):
            time.sleep(1.0)
    else:
        select.select([fd], [], [])  # readable once the parent has exited
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone (or another user's: the pid reused)
        return False
    return True


def _pool_context() -> Any:
    """The workers' start method: a fork server where the platform has one (Linux, macOS), which
    imports this module once and forks each worker from that clean, single-threaded process;
    else spawn. Never a fork of this process: it has threads (tqdm, tokenizers), and a fork
    copies the locks they hold. A spawned worker imports numpy and tokenizers itself (~0.6 CPU-s
    each); a process that prepares several times (the tests, a script) starts the server once."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # read when the server starts; ignored after
    return ctx


def encode_batch(texts: list[str], lasts: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of a batch of pieces, flat, with EOD after each document's last piece."""
    encodings = _worker_tok.encode_batch_fast(texts, add_special_tokens=False)
    eod = [_worker_eod]
    ids = [e.ids + eod if last else e.ids for e, last in zip(encodings, lasts)]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=_worker_dtype, count=int(lengths.sum()))
    return flat, lengths


def is_val(index: int, fraction: float) -> bool:
    """Split rule (see the module docstring): a pure function of the document's global index."""
    return index >= 1 and math.ceil(index * fraction) > math.ceil((index - 1) * fraction)


# -- the run ---------------------------------------------------------------------------------


class Preparer:
    """One prepare run: owns the output directory until the manifest is written."""

    def __init__(self, cfg: PrepareConfig, tok: TokenizerInfo, corpus: Corpus):
        self.cfg, self.tok, self.corpus = cfg, tok, corpus
        self.out: Path = cfg.out
        self.writers = {s: SplitWriter(self.out, s, tok.dtype, cfg.shard_tokens, cfg.dtype_code)
                        for s in ("train", "val")}
        self.journal = Journal(self.out)
        self.documents = 0
        self.tokens = 0
        self.position: Position | None = None  # the input after the last document written
        self.tokens_before = 0  # written by the runs this one continues
        self._doc_split: SplitWriter | None = None
        self.last_writer: SplitWriter | None = None  # names the file in a disk-full error

    def restore(self, point: ResumePoint) -> None:
        """Continue from the checkpoint of an interrupted run."""
        for name, w in self.writers.items():
            w.restore(point.shards[name], point.open[name])
        self.documents, self.tokens = point.last["documents"], point.last["tokens"]
        self.tokens_before = self.tokens
        self.position = point.position

    def write(self, flat: np.ndarray, lengths: np.ndarray, lasts: list[bool],
              positions: list[Position | None]) -> None:
        """Route a batch's pieces, in order, to the split of the document they belong to."""
        offset = 0
        for n, last, pos in zip(lengths.tolist(), lasts, positions):
            if self._doc_split is None:
                self._doc_split = self._start_document()
            self.last_writer = self._doc_split
            self._doc_split.add(flat[offset:offset + n])
            offset += n
            self.tokens += n
            if last:
                self._doc_split.end_document()
                self._doc_split = None
                self.documents += 1
                self.position = pos

    def _start_document(self) -> SplitWriter:
        split = self.writers["val" if is_val(self.documents, self.cfg.val_fraction) else "train"]
        if split.full():
            self._checkpoint(split.split, split.close_shard())
        split.start_document()
        return split

    def _checkpoint(self, split: str, closed: dict[str, Any]) -> None:
        """Between two documents, a shard just closed: record where a resume would start."""
        checkpoint = {
            "closed": {"split": split, "shard": closed},
            "documents": self.documents, "tokens": self.tokens,
            "position": self.position.to_json(),
            "open": {name: w.open_entry() for name, w in self.writers.items()}}
        output.fsync_dir(self.out)  # the new shard files' names, before the journal says so
        self.journal.record(checkpoint)  # the commit point

    def tokenize_all(self, progress) -> None:
        """Tokenize the corpus and write it, in input order; `progress` (a tqdm-like bar over
        input bytes, the caller's) advances as batches are written."""
        t0, tokens0 = time.perf_counter(), self.tokens
        with closing(self._encoded()) as encoded:  # the pool stops here, even on an error
            for flat, lengths, batch in encoded:
                self.write(flat, lengths, batch.lasts, batch.positions)
                progress.update(batch.progress - progress.n)
                secs = max(time.perf_counter() - t0, 1e-9)
                progress.set_postfix_str(f"docs={self.documents} "
                                         f"tok/s={(self.tokens - tokens0) / secs:,.0f}",
                                         refresh=False)

    def _encoded(self) -> Iterator[tuple[np.ndarray, np.ndarray, Any]]:
        """(ids, piece lengths, corpus.Batch) of each batch, in input order, tokenized on
        `workers` processes with a few batches always in flight: workers never wait for the
        parent, and memory stays bounded by the window."""
        workers = self.cfg.workers
        init = (self.tok.backend_json, self.tok.eod_token_id, self.tok.dtype.name, os.getpid())
        inflight: deque = deque()
        # an executor, unlike Pool, reports a worker killed by the OOM killer instead of
        # waiting for its result forever
        pool = ProcessPoolExecutor(workers, mp_context=_pool_context(),
                                   initializer=_init_worker, initargs=init)
        try:
            batches = self.corpus.batches(self.cfg.batch_chars, start=self.position)
            while True:
                while len(inflight) < 2 * workers + 1:
                    batch = next(batches, None)
                    if batch is None:
                        break
                    inflight.append((pool.submit(encode_batch, batch.texts, batch.lasts), batch))
                if not inflight:
                    return
                future, batch = inflight.popleft()
                try:
                    flat, lengths = future.result()
                except BrokenProcessPool:
                    raise UserError("a tokenizer worker process died (killed, or out of memory?); "
                                    "try fewer --workers") from None
                yield flat, lengths, batch
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def stop(self) -> bool:
        """After a failure: keep what the last checkpoint holds (True), or, with none, remove
        everything this run made (False)."""
        for w in self.writers.values():
            w.close()
        try:
            point = self.journal.load()  # what is committed is what the journal says
        except UserError:
            return True  # unreadable: keep everything for the user to look at
        if point is None:
            for w in self.writers.values():
                w.remove_created()
            self.journal.remove()
            shutil.rmtree(self.out / mf.TOKENIZER_DIR, ignore_errors=True)
            return False
        discard_uncommitted(self.out, {s: len(v) for s, v in point.shards.items()}, point.open)
        return True


# -- the output directory --------------------------------------------------------------------


def _prepare_out_dir(cfg: PrepareConfig, key: dict[str, Any], inputs: list[dict[str, Any]]
                     ) -> tuple[bool, ResumePoint | None]:
    """Make --out ready for writing: (this run created it, the checkpoint to continue from).

    Leftovers of an interrupted prepare (its files only, no dataset.json) are continued with
    --resume, replaced with --overwrite, refused otherwise when they hold completed shards (hours
    of work), and replaced without asking when they hold none. A complete dataset is replaced
    only with --overwrite; anything else is refused (docs/design.md, "Outputs")."""
    out = cfg.out
    ins = [("--input", p) for p in cfg.input] + [("--tokenizer", cfg.tokenizer)]
    entries = list(out.iterdir()) if out.is_dir() else []
    leftovers = bool(entries) and all(is_dataset_file(e) for e in entries) \
        and not (out / mf.MANIFEST).exists()
    if leftovers:
        output.check_apart(out, ins)
        point = None if cfg.overwrite else Journal(out).load()
        if point is not None and cfg.resume:
            check_resumable(out, point, key, inputs)
            return False, point
        if point is not None:
            raise UserError(f"--out {out}: holds an interrupted prepare ({point.completed} "
                            f"completed shards); add --resume to continue it, or --overwrite to "
                            f"start over")
    else:
        output.claim(out, "dataset", "data_tools prepare", overwrite=cfg.overwrite, inputs=ins,
                     recognise=lambda d: (d / mf.MANIFEST).is_file())
    if cfg.resume:
        print(f"prepare: nothing to resume in {out}; starting from the beginning",
              file=sys.stderr, flush=True)
    if not out.exists():
        output.make_dirs(out)
        return True, None
    # The manifest goes first: from here on the directory is not a complete dataset.
    with output.writing(out):
        (out / mf.MANIFEST).unlink(missing_ok=True)
        for e in entries:
            if is_dataset_file(e) and e.name != mf.MANIFEST:  # what prepare made, nothing else
                shutil.rmtree(e) if e.is_dir() else e.unlink()
    return False, None


def is_dataset_file(p: Path) -> bool:
    """Files a prepare run writes (its leftovers may be replaced), or an adopt run's marker."""
    if p.name in (mf.MANIFEST, mf.TOKENIZER_DIR) or is_journal_file(p.name):
        return True
    if p.name == output.MARKER:
        return output.marked_as(p.parent) == "dataset"
    if p.name.startswith(f".{mf.MANIFEST}.") and p.name.endswith(".tmp"):
        return True
    parsed = shard_file(p.name)
    return parsed is not None and parsed[2] != "sizes"


def _already_complete(cfg: PrepareConfig, key: dict[str, Any],
                      inputs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """With --resume, a dataset already complete in --out: its manifest when this very command
    made it (nothing left to do), an error when it was made from other inputs or settings."""
    if not (cfg.out / mf.MANIFEST).is_file():
        return None
    output.check_apart(cfg.out, [("--input", p) for p in cfg.input] +
                       [("--tokenizer", cfg.tokenizer)])
    m = mf.load_manifest(cfg.out)
    reason = key_difference(m["prepare_key"], key) if "prepare_key" in m else \
        "it records no prepare_key (adopted, or made by an older version)"
    if reason is None and m.get("source", {}).get("inputs_fingerprint") != _fingerprint(inputs):
        reason = "the input files differ"
    if reason:
        raise UserError(f"--out {cfg.out}: already holds a complete dataset, made otherwise "
                        f"({reason}); use --overwrite to replace it")
    return m


def _fingerprint(inputs: list[dict[str, Any]]) -> str:
    return mf.format_digest(xxhash.xxh3_128(output.to_json(inputs, indent=None).encode()))


# -- the manifest ----------------------------------------------------------------------------


def build_manifest(p: Preparer, splits: dict[str, Any], tok_files: list[dict[str, Any]],
                   inputs: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    stats, cfg = p.corpus.stats, p.cfg
    output_bytes = sum(s["bin_bytes"] + s["idx_bytes"]
                       for split in splits.values() for s in split["shards"])
    input_bytes = p.corpus.input_bytes
    return mf.new_manifest(
        p.tok.dtype.name, p.tok.manifest_fields(p.out, tok_files), splits,
        val_fraction=cfg.val_fraction, shard_tokens=cfg.shard_tokens, dtype_code=cfg.dtype_code,
        source={"fingerprint": stats.fingerprint, "files": stats.files, "bytes": stats.bytes,
                "documents": stats.documents, "empty_documents": stats.empty_documents,
                "replaced_invalid_utf8": stats.replaced_chars, "text_key": cfg.text_key,
                "include": cfg.include, "inputs_fingerprint": _fingerprint(inputs)},
        prepare_key=cfg.output_key(p.tok),
        # Output bytes count the shards (what training reads), not the tokenizer copy.
        input_bytes=input_bytes, output_bytes=output_bytes,
        size_reduction_pct=round(100.0 * (1 - output_bytes / input_bytes), 2)
        if input_bytes else 0.0,
        command=cfg.command(),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        seconds=round(seconds, 3))


# -- the command -----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    cfg = from_args(PrepareConfig, args)
    t0 = time.perf_counter()
    corpus = Corpus(cfg.input, cfg.include, cfg.text_key, cfg.strict, cfg.piece_chars)
    tok = TokenizerInfo(cfg.tokenizer)
    key, inputs = cfg.output_key(tok), input_files(corpus)
    if cfg.resume and (done := _already_complete(cfg, key, inputs)) is not None:
        print(f"prepare: {cfg.out} is already complete ({done['documents']} documents, "
              f"{done['tokens']} tokens); nothing to do", flush=True)
        return 0
    created_out, point = _prepare_out_dir(cfg, key, inputs)
    p = Preparer(cfg, tok, corpus)
    try:
        m = _prepare(p, point, inputs, t0)
    except BaseException as e:  # noqa: BLE001 - every failure decides what stays; re-raised
        kept = p.stop()
        if not kept and created_out:
            shutil.rmtree(cfg.out, ignore_errors=True)
        raise _failure(e, p, kept) from None
    p.journal.remove()  # after dataset.json: the run is complete whatever happens here
    _summary(m, p.tokens - p.tokens_before, time.perf_counter() - t0)
    return 0


def _failure(e: BaseException, p: Preparer, kept: bool) -> BaseException:
    """What to raise after `e` stopped the run: a write error as one line, and, when completed
    shards stay, how to continue."""
    kept_note = (f"{sum(len(w.shards) for w in p.writers.values())} completed shards kept in "
                 f"{p.out}; rerun the same command with --resume to continue")
    if isinstance(e, KeyboardInterrupt):
        if kept:
            print(f"prepare: {kept_note}", file=sys.stderr, flush=True)
        return e
    if isinstance(e, OSError):
        e = output.write_error(e, _current_path(p)) or e
    if isinstance(e, UserError) and kept:
        return UserError(f"{e} [{kept_note}]")
    return e


def _prepare(p: Preparer, point: ResumePoint | None, inputs: list[dict[str, Any]],
             t0: float) -> dict[str, Any]:
    """Tokenize (from the checkpoint, if any), close the shards, write dataset.json last."""
    cfg, corpus = p.cfg, p.corpus
    if point is not None:
        p.restore(point)
        discard_uncommitted(cfg.out, {s: len(v) for s, v in point.shards.items()}, point.open)
        _resume_note(p, point)
        shutil.rmtree(cfg.out / mf.TOKENIZER_DIR, ignore_errors=True)
    p.journal.begin(p.cfg.output_key(p.tok), inputs, point)
    tok_files = p.tok.copy_to(cfg.out / mf.TOKENIZER_DIR)
    done = sum(s.st_size for s in corpus.stat_results[:point.position.file]) if point else 0
    with tqdm(total=corpus.input_bytes, initial=done, unit="B", unit_scale=True,
              unit_divisor=1000, desc="prepare", dynamic_ncols=True, smoothing=0.1) as bar:
        p.tokenize_all(bar)
    if p.documents == 0:
        raise UserError(f"empty corpus: no documents in {len(corpus.files)} input file(s)"
                        + (f" ({corpus.stats.empty_documents} empty)"
                           if corpus.stats.empty_documents else ""))
    splits = {name: w.finish() for name, w in p.writers.items()}
    m = build_manifest(p, splits, tok_files, inputs, time.perf_counter() - t0)
    mf.write_manifest(cfg.out, m)
    return m


def _resume_note(p: Preparer, point: ResumePoint) -> None:
    pos = point.position
    split_text = ", ".join(f"{k} {len(v)}" for k, v in point.shards.items() if v)
    print(f"prepare: resuming {p.out}: {point.completed} completed shards kept ({split_text}), "
          f"{p.documents} documents / {p.tokens} tokens not tokenized again; reading on from "
          f"{p.corpus.files[pos.file]} after record {pos.record}", flush=True)


def _current_path(p: Preparer) -> Path:
    return p.last_writer.path if p.last_writer is not None else p.out


def _summary(m: dict[str, Any], tokens: int, seconds: float) -> None:
    """The result in one line; `tokens` and `seconds` are this run's (a resume's are fewer)."""
    s = m["source"]
    notes = (f", {s['replaced_invalid_utf8']} invalid UTF-8 sequences replaced"
             if s["replaced_invalid_utf8"] else "")
    notes += f", {s['empty_documents']} empty documents skipped" if s["empty_documents"] else ""
    split_text = ", ".join(f"{k} {v['documents']} docs / {v['tokens']} tokens"
                           for k, v in m["splits"].items())
    print(f"prepared {m['documents']} documents, {m['tokens']} tokens ({split_text}); "
          f"input {m['input_bytes'] / 1e6:.2f} MB -> output {m['output_bytes'] / 1e6:.2f} MB "
          f"({_change(m['size_reduction_pct'])}, {m['dtype']}); {seconds:.1f} s, "
          f"{tokens / max(seconds, 1e-9):,.0f} tokens/s{notes}", flush=True)


def _change(reduction_pct: float) -> str:
    """Compressed inputs (Parquet, .zst) can be smaller than their token ids."""
    return f"{reduction_pct:.1f}% smaller" if reduction_pct >= 0 else \
        f"{-reduction_pct:.1f}% larger"
