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
val share is `ceil((n - 1) * f) / n`. Empty documents are skipped and do not count.

Failure or Ctrl-C removes everything this run created; `dataset.json` is written last, so a
directory without it is never mistaken for a dataset.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import shlex
import shutil
import signal
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import closing
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from itertools import chain
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from tqdm import tqdm

from data_tools import manifest as mf
from data_tools import output
from data_tools.corpus import DEFAULT_INCLUDE, PIECE_CHARS, Corpus
from data_tools.cli import config_flags, finite_float, flag
from data_tools.errors import UserError
from data_tools.indexed import ShardWriter, bin_path, idx_path
from data_tools.tokenizer_info import TokenizerInfo

DEFAULT_VAL_FRACTION = 0.01
DEFAULT_SHARD_TOKENS = 1_000_000_000
BATCH_CHARS = 1 << 20
DTYPE_CODES = ("deepspeed", "megatron")


@dataclass
class PrepareConfig:
    """`python -m data_tools prepare` settings. Field names are the flags with '-' for '_'."""

    input: list[Path]
    """Files or directories (recursive) of .txt, .jsonl, .jsonl.gz."""
    tokenizer: Path
    """Hugging Face tokenizer directory."""
    out: Path
    """Dataset directory to write."""
    workers: int = os.cpu_count() or 1
    """Tokenizer processes, one per core by default; the output does not depend on it."""
    val_fraction: float = DEFAULT_VAL_FRACTION
    """Share of documents for the val split (0: no val split)."""
    text_key: str = "text"
    """JSONL key holding the text."""
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

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "PrepareConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def command(self) -> str:
        """The command line that makes this dataset again."""
        parts = ["python", "-m", "data_tools", "prepare", "--input", *map(str, self.input),
                 "--tokenizer", str(self.tokenizer), "--out", str(self.out),
                 "--workers", str(self.workers), "--val-fraction", repr(self.val_fraction),
                 "--text-key", self.text_key, "--include", self.include,
                 "--shard-tokens", str(self.shard_tokens), "--dtype-code", self.dtype_code]
        parts += ["--strict"] * self.strict + ["--overwrite"] * self.overwrite
        return shlex.join(parts)


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
    p.add_argument("--batch-chars", type=int, default=BATCH_CHARS, help=argparse.SUPPRESS)
    p.add_argument("--piece-chars", type=int, default=PIECE_CHARS, help=argparse.SUPPRESS)


# -- the workers -----------------------------------------------------------------------------

_worker_tok = None
_worker_eod: int = 0
_worker_dtype: np.dtype = np.dtype(np.int32)


def _init_worker(backend_json: str, eod: int, dtype: str) -> None:
    """Each worker is one core: Rust threads on top of N processes would only oversubscribe."""
    global _worker_tok, _worker_eod, _worker_dtype
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and cleans up
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _worker_tok = Tokenizer.from_str(backend_json)
    _worker_tok.no_truncation()
    _worker_tok.no_padding()
    _worker_eod, _worker_dtype = eod, np.dtype(dtype)


def encode_batch(texts: list[str], lasts: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of a batch of pieces, flat, with EOD after each document's last piece."""
    encodings = _worker_tok.encode_batch_fast(texts, add_special_tokens=False)
    eod = [_worker_eod]
    ids = [e.ids + eod if last else e.ids for e, last in zip(encodings, lasts)]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=_worker_dtype, count=int(lengths.sum()))
    return flat, lengths


# -- the writer ------------------------------------------------------------------------------


class SplitWriter:
    """Writes one split as shards `<split>_NNNNN`, each capped at `shard_tokens` tokens."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int,
                 dtype_code: str = "deepspeed"):
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.dtype_code = dtype_code
        self.shards: list[dict[str, Any]] = []
        self.created: list[Path] = []
        self._writer: ShardWriter | None = None
        self._hasher = None
        self.path: Path = out  # the file being written, for error messages

    def start_document(self) -> None:
        if self._writer is None or self._writer.num_tokens >= self.shard_tokens:
            self._close_shard()
            prefix = self.out / f"{self.split}_{len(self.shards):05d}"
            self.path = bin_path(prefix)
            self.created += [bin_path(prefix), idx_path(prefix)]
            self._writer = ShardWriter(prefix, self.dtype, self.dtype_code)
            self._hasher = mf.new_hasher()

    def add(self, tokens: np.ndarray) -> None:
        self._hasher.update(tokens)
        self._writer.add_tokens(tokens)

    def end_document(self) -> None:
        self._writer.end_document()

    def _close_shard(self) -> None:
        w = self._writer
        if w is None:
            return
        self.path = idx_path(w.prefix)
        w.finalize()
        self.shards.append({
            "name": w.prefix.name, "documents": w.num_documents, "tokens": w.num_tokens,
            "bin_bytes": bin_path(w.prefix).stat().st_size,
            "idx_bytes": idx_path(w.prefix).stat().st_size,
            "bin_checksum": mf.format_digest(self._hasher),
            "idx_checksum": mf.file_checksum(idx_path(w.prefix)),
        })
        self._writer = None

    def finish(self) -> dict[str, Any]:
        self._close_shard()
        return {"documents": sum(s["documents"] for s in self.shards),
                "tokens": sum(s["tokens"] for s in self.shards), "shards": self.shards}

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
        for p in self.created:
            p.unlink(missing_ok=True)


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
        self.documents = 0
        self.tokens = 0
        self._doc_split: SplitWriter | None = None
        self.last_writer: SplitWriter | None = None  # names the file in a disk-full error

    def write(self, flat: np.ndarray, lengths: np.ndarray, lasts: list[bool]) -> None:
        """Route a batch's pieces, in order, to the split of the document they belong to."""
        offset = 0
        for n, last in zip(lengths.tolist(), lasts):
            if self._doc_split is None:
                split = "val" if is_val(self.documents, self.cfg.val_fraction) else "train"
                self._doc_split = self.writers[split]
                self._doc_split.start_document()
            self.last_writer = self._doc_split
            self._doc_split.add(flat[offset:offset + n])
            offset += n
            if last:
                self._doc_split.end_document()
                self._doc_split = None
                self.documents += 1
        self.tokens += int(flat.size)

    def tokenize_all(self, progress) -> None:
        """Tokenize the corpus and write it, in input order; `progress` (a tqdm-like bar over
        input bytes, the caller's) advances as batches are written."""
        t0, done = time.perf_counter(), 0
        with closing(self._encoded()) as encoded:  # the pool stops here, even on an error
            for flat, lengths, lasts, read_bytes in encoded:
                self.write(flat, lengths, lasts)
                progress.update(read_bytes - done)
                done = read_bytes
                secs = max(time.perf_counter() - t0, 1e-9)
                progress.set_postfix_str(f"docs={self.documents} tok/s={self.tokens / secs:,.0f}",
                                         refresh=False)

    def _encoded(self) -> Iterator[tuple[np.ndarray, np.ndarray, list[bool], int]]:
        """(ids, piece lengths, is-last flags, corpus bytes read) of each batch, in input order,
        tokenized on `workers` processes with a few batches always in flight: workers never wait
        for the parent, and memory stays bounded by the window."""
        workers = self.cfg.workers
        init = (self.tok.backend_json, self.tok.eod_token_id, self.tok.dtype.name)
        inflight: deque = deque()
        # spawn: no fork after threads (tqdm, tokenizers); an executor, unlike Pool, reports a
        # worker killed by the OOM killer instead of waiting for its result forever.
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=init)
        try:
            batches = self.corpus.batches(self.cfg.batch_chars)
            while True:
                while len(inflight) < 2 * workers + 1:
                    item = next(batches, None)
                    if item is None:
                        break
                    texts, lasts, read_bytes = item
                    inflight.append((pool.submit(encode_batch, texts, lasts), lasts, read_bytes))
                if not inflight:
                    return
                future, lasts, read_bytes = inflight.popleft()
                try:
                    flat, lengths = future.result()
                except BrokenProcessPool:
                    raise UserError("a tokenizer worker process died (killed, or out of memory?); "
                                    "try fewer --workers") from None
                yield flat, lengths, lasts, read_bytes
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def abort(self) -> None:
        for w in self.writers.values():
            w.abort()
        shutil.rmtree(self.out / mf.TOKENIZER_DIR, ignore_errors=True)


def _prepare_out_dir(cfg: PrepareConfig) -> bool:
    """Make --out ready for writing; True if this run created it (so cleanup removes it).

    Leftovers of an interrupted prepare (shards, no dataset.json) are replaced without asking;
    a complete dataset only with --overwrite; anything else is refused (docs/design.md,
    "Outputs")."""
    out = cfg.out
    inputs = [("--input", p) for p in cfg.input] + [("--tokenizer", cfg.tokenizer)]
    entries = list(out.iterdir()) if out.is_dir() else []
    leftovers = bool(entries) and all(_ours(e) for e in entries) \
        and not (out / mf.MANIFEST).exists()
    if not leftovers:
        output.claim(out, "dataset", "data_tools prepare", overwrite=cfg.overwrite,
                     inputs=inputs, recognise=lambda d: (d / mf.MANIFEST).is_file())
    else:
        output.check_apart(out, inputs)
    if not out.exists():
        output.make_dirs(out)
        return True
    # The manifest goes first: from here on the directory is not a complete dataset.
    with output.writing(out):
        (out / mf.MANIFEST).unlink(missing_ok=True)
        for e in entries:
            if _ours(e) and e.name != mf.MANIFEST:  # what prepare made, nothing else
                shutil.rmtree(e) if e.is_dir() else e.unlink()
    return False


def _ours(p: Path) -> bool:
    """Files a prepare run writes (leftovers of an interrupted run may be replaced)."""
    if p.name in (mf.MANIFEST, mf.TOKENIZER_DIR):
        return True
    if p.name.startswith(f".{mf.MANIFEST}.") and p.name.endswith(".tmp"):
        return True
    stem, _, ext = p.name.rpartition(".")
    split, _, num = stem.partition("_")
    return ext in ("bin", "idx") and split in ("train", "val") and num.isdigit()


def build_manifest(p: Preparer, splits: dict[str, Any], tok_files: list[dict[str, Any]],
                   seconds: float) -> dict[str, Any]:
    tok, stats, cfg = p.tok, p.corpus.stats, p.cfg
    output_bytes = sum(s["bin_bytes"] + s["idx_bytes"]
                       for split in splits.values() for s in split["shards"])
    input_bytes = p.corpus.input_bytes
    m: dict[str, Any] = {
        "format": mf.FORMAT, "format_version": mf.FORMAT_VERSION,
        "dtype": tok.dtype.name, "vocab_size": tok.vocab_size,
        "eod_token_id": tok.eod_token_id, **tok.special_ids,
        "special_token_ids": tok.special_token_ids,
        "model_max_length": tok.model_max_length,
        "tokenizer": {"dir": mf.TOKENIZER_DIR,
                      "fingerprint": mf.tokenizer_fingerprint(p.out / mf.TOKENIZER_DIR),
                      "kind": tok.kind, "source": str(cfg.tokenizer), "files": tok_files},
        "checksum_algorithm": mf.CHECKSUM_ALGORITHM,
        "splits": splits,
        "documents": p.documents, "tokens": p.tokens,
        "val_fraction": cfg.val_fraction, "shard_tokens": cfg.shard_tokens,
        "dtype_code": cfg.dtype_code,
        "source": {"fingerprint": stats.fingerprint, "files": stats.files, "bytes": stats.bytes,
                   "documents": stats.documents, "replaced_invalid_utf8": stats.replaced_chars,
                   "text_key": cfg.text_key, "include": cfg.include},
        # Output bytes count the shards (what training reads), not the tokenizer copy.
        "input_bytes": input_bytes, "output_bytes": output_bytes,
        "size_reduction_pct": round(100.0 * (1 - output_bytes / input_bytes), 2)
        if input_bytes else 0.0,
        "command": cfg.command(),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 3),
    }
    m["fingerprint"] = mf.dataset_fingerprint(m)
    return m


def run(args: argparse.Namespace) -> int:
    cfg = PrepareConfig.from_args(args)
    t0 = time.perf_counter()
    corpus = Corpus(cfg.input, cfg.include, cfg.text_key, cfg.strict, cfg.piece_chars)
    tok = TokenizerInfo(cfg.tokenizer)
    created_out = _prepare_out_dir(cfg)
    p = Preparer(cfg, tok, corpus)
    ok = False
    try:
        tok_files = tok.copy_to(cfg.out / mf.TOKENIZER_DIR)
        with tqdm(total=corpus.input_bytes, unit="B", unit_scale=True, unit_divisor=1000,
                  desc="prepare", dynamic_ncols=True, smoothing=0.1) as bar:
            p.tokenize_all(bar)
        if p.documents == 0:
            raise UserError(f"empty corpus: no documents in {len(corpus.files)} input file(s)")
        splits = {}
        for name, w in p.writers.items():
            split = w.finish()
            if split["shards"]:
                splits[name] = split
        m = build_manifest(p, splits, tok_files, time.perf_counter() - t0)
        mf.write_manifest(cfg.out, m)
        ok = True
    except OSError as e:
        raise output.write_error(e, _current_path(p)) from None
    finally:
        if not ok:
            p.abort()
            if created_out:
                shutil.rmtree(cfg.out, ignore_errors=True)
    _summary(m, time.perf_counter() - t0)
    return 0


def _current_path(p: Preparer) -> Path:
    return p.last_writer.path if p.last_writer is not None else p.out


def _summary(m: dict[str, Any], seconds: float) -> None:
    s = m["source"]
    replaced = (f", {s['replaced_invalid_utf8']} invalid UTF-8 sequences replaced"
                if s["replaced_invalid_utf8"] else "")
    split_text = ", ".join(f"{k} {v['documents']} docs / {v['tokens']} tokens"
                           for k, v in m["splits"].items())
    print(f"prepared {m['documents']} documents, {m['tokens']} tokens ({split_text}); "
          f"input {m['input_bytes'] / 1e6:.2f} MB -> output {m['output_bytes'] / 1e6:.2f} MB "
          f"({m['size_reduction_pct']:.1f}% smaller, {m['dtype']}); {seconds:.1f} s, "
          f"{m['tokens'] / max(seconds, 1e-9):,.0f} tokens/s{replaced}", flush=True)
