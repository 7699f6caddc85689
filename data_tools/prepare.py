"""`python -m data_tools prepare`: pretokenize a corpus into a dataset directory (see DESIGN.md).

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
import fnmatch
import json
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
from datetime import datetime, timezone
from itertools import chain
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from tqdm import tqdm

from data_tools import manifest as mf
from data_tools import output
from data_tools.corpus import DEFAULT_INCLUDE, PIECE_CHARS, Corpus
from data_tools.errors import UserError, finite_float
from data_tools.indexed import ShardWriter, bin_path, idx_path, token_dtype

DEFAULT_VAL_FRACTION = 0.01
DEFAULT_SHARD_TOKENS = 1_000_000_000
BATCH_CHARS = 1 << 20
# What a tokenizer directory may hold that belongs to the tokenizer (copied into the dataset).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt", "*.model",
                   "chat_template.*")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="files or directories (recursive) of .txt, .jsonl, .jsonl.gz")
    p.add_argument("--tokenizer", required=True, type=Path, help="Hugging Face tokenizer directory")
    p.add_argument("--out", required=True, type=Path, help="dataset directory to write")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizer processes (default: all cores); output does not depend on it")
    p.add_argument("--val-fraction", type=finite_float, default=DEFAULT_VAL_FRACTION,
                   help="share of documents for the val split (0: no val split)")
    p.add_argument("--text-key", default="text", help="JSONL key holding the text")
    p.add_argument("--include", default=DEFAULT_INCLUDE,
                   help="comma-separated globs for directory walks; other patterns read as text")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                   help="start a new shard once one holds this many tokens")
    p.add_argument("--dtype-code", choices=("deepspeed", "megatron"), default="deepspeed",
                   help="uint16 code in the .idx header: DeepSpeed's MMapIndexedDataset reads 6, "
                        "Megatron-LM's reader 8 (int32 shards are the same for both)")
    p.add_argument("--strict", action="store_true", help="invalid UTF-8 is an error, not replaced")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already in --out")
    p.add_argument("--batch-chars", type=int, default=BATCH_CHARS, help=argparse.SUPPRESS)
    p.add_argument("--piece-chars", type=int, default=PIECE_CHARS, help=argparse.SUPPRESS)


# -- the tokenizer ---------------------------------------------------------------------------


class TokenizerInfo:
    """What prepare needs from a tokenizer directory: its backend, special ids, vocab, kind.

    Read from tokenizer.json and tokenizer_config.json / special_tokens_map.json directly, since
    importing transformers costs seconds; only a directory without those falls back to it.
    """

    _NAMES = ("sep", "eos", "pad", "mask", "cls", "bos")

    def __init__(self, directory: Path):
        if not directory.exists():
            raise UserError(f"{directory}: no such tokenizer directory")
        if not directory.is_dir():
            raise UserError(f"{directory}: not a directory (expected a tokenizer directory)")
        self.directory = directory
        from tokenizers import Tokenizer

        tok_json = directory / "tokenizer.json"
        config = self._read_config(directory)
        tokens = {n: _token_content(config.get(f"{n}_token")) for n in self._NAMES}
        max_len = config.get("model_max_length")
        if tok_json.is_file():
            try:
                self.backend_json = tok_json.read_text(encoding="utf-8")
                backend = Tokenizer.from_str(self.backend_json)
            except Exception as e:  # noqa: BLE001 - any failure means a corrupt file
                raise UserError(f"{tok_json}: corrupt tokenizer file ({_first_line(e)})") from None
        if not tok_json.is_file() or not (tokens["sep"] or tokens["eos"]):
            fast = self._load_with_transformers(directory)  # e.g. a vocab.txt-only BERT dir
            backend = fast.backend_tokenizer
            self.backend_json = backend.to_str()
            tokens = {n: getattr(fast, f"{n}_token", None) for n in self._NAMES}
            max_len = getattr(fast, "model_max_length", None)
        ids = {n: (backend.token_to_id(t) if t else None) for n, t in tokens.items()}
        model = json.loads(self.backend_json).get("model", {})
        self.kind = str(model.get("type") or "unknown").lower()
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(backend.get_vocab_size(with_added_tokens=True),
                              max(vocab.values(), default=-1) + 1)
        self.model_max_length = _int_or_none(max_len)
        first, second = ("sep", "eos") if self.kind == "wordpiece" else ("eos", "sep")
        eod = ids[first] if ids[first] is not None else ids[second]
        if eod is None:
            raise UserError(f"{directory}: the tokenizer has neither a sep nor an eos token to end "
                            f"each document with")
        self.eod_token_id = int(eod)
        self.special_ids = {f"{n}_token_id": _int_or_none(ids[n])
                            for n in ("pad", "mask", "cls", "bos")}
        self.dtype = token_dtype(self.vocab_size)
        self.files = self._read_files()

    @staticmethod
    def _read_config(directory: Path) -> dict[str, Any]:
        """Special tokens and model_max_length from the transformers side files, if present."""
        config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            path = directory / name
            if not path.is_file():
                continue
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise UserError(f"{path}: corrupt JSON ({_first_line(e)})") from None
            except OSError as e:
                raise UserError(f"{path}: cannot read ({e.strerror})") from None
            if not isinstance(data, dict):
                raise UserError(f"{path}: expected a JSON object")
            config.update({k: v for k, v in data.items() if v is not None})
        return config

    @staticmethod
    def _load_with_transformers(directory: Path):
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any failure here means an unusable directory
            raise UserError(f"{directory}: not a loadable tokenizer directory "
                            f"({_first_line(e)})") from None
        if not getattr(tok, "is_fast", False):
            raise UserError(f"{directory}: only fast (tokenizers-backed) tokenizers are supported")
        return tok

    def _read_files(self) -> dict[str, bytes]:
        """The tokenizer's own files (not a model's weights next to them), held in memory."""
        files = {}
        for f in sorted(self.directory.iterdir()):
            if f.is_file() and any(fnmatch.fnmatch(f.name, g) for g in TOKENIZER_FILES):
                try:
                    files[f.name] = f.read_bytes()
                except OSError as e:
                    raise UserError(f"{f}: cannot read ({e.strerror})") from None
        files.setdefault("tokenizer.json", self.backend_json.encode("utf-8"))
        return files

    def copy_to(self, dest: Path) -> list[dict[str, Any]]:
        """Write the tokenizer's files into the dataset (so it is self-contained); list them."""
        dest.mkdir(parents=True)
        for name, data in self.files.items():
            (dest / name).write_bytes(data)
        return [{"name": f.name, "bytes": f.stat().st_size, "checksum": mf.file_checksum(f)}
                for f in sorted(dest.iterdir()) if f.is_file()]


def _token_content(value) -> str | None:
    """A special token as written by transformers: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _int_or_none(v) -> int | None:
    return int(v) if isinstance(v, (int, np.integer)) and v < 1 << 62 else None


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


def _batches(corpus: Corpus, batch_chars: int) -> Iterator[tuple[list[str], list[bool], int]]:
    """(texts, is_last flags, corpus bytes read so far) in ~batch_chars batches."""
    texts: list[str] = []
    lasts: list[bool] = []
    chars = 0
    for text, last in corpus.pieces():
        texts.append(text)
        lasts.append(last)
        chars += len(text)
        if chars >= batch_chars:
            yield texts, lasts, corpus.stats.bytes
            texts, lasts, chars = [], [], 0
    if texts:
        yield texts, lasts, corpus.stats.bytes


class Preparer:
    """One prepare run: owns the output directory until the manifest is written."""

    def __init__(self, args: argparse.Namespace, tok: TokenizerInfo, corpus: Corpus):
        self.args, self.tok, self.corpus = args, tok, corpus
        self.out: Path = args.out
        self.writers = {s: SplitWriter(self.out, s, tok.dtype, args.shard_tokens,
                                      args.dtype_code)
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
                split = "val" if is_val(self.documents, self.args.val_fraction) else "train"
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

    def tokenize_all(self) -> None:
        workers = self.args.workers
        init = (self.tok.backend_json, self.tok.eod_token_id, self.tok.dtype.name)
        inflight: deque = deque()
        done_bytes = 0
        t0 = time.perf_counter()
        bar = tqdm(total=self.corpus.input_bytes, unit="B", unit_scale=True, unit_divisor=1000,
                   desc="prepare", dynamic_ncols=True, smoothing=0.1)
        # spawn: no fork after threads (tqdm, tokenizers); an executor, unlike Pool, reports a
        # worker killed by the OOM killer instead of waiting for its result forever.
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=init)
        try:
            batches = _batches(self.corpus, self.args.batch_chars)
            exhausted = False
            while True:
                # A few batches in flight: workers never wait for the parent, memory stays bounded.
                while not exhausted and len(inflight) < 2 * workers + 1:
                    item = next(batches, None)
                    if item is None:
                        exhausted = True
                        break
                    texts, lasts, read_bytes = item
                    inflight.append((pool.submit(encode_batch, texts, lasts), lasts, read_bytes))
                if not inflight:
                    break
                future, lasts, read_bytes = inflight.popleft()
                try:
                    flat, lengths = future.result()
                except BrokenProcessPool:
                    raise UserError("a tokenizer worker process died (killed, or out of memory?); "
                                    "try fewer --workers") from None
                self.write(flat, lengths, lasts)
                bar.update(read_bytes - done_bytes)
                done_bytes = read_bytes
                secs = max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix_str(f"docs={self.documents} tok/s={self.tokens / secs:,.0f}",
                                    refresh=False)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            bar.close()

    def abort(self) -> None:
        for w in self.writers.values():
            w.abort()
        shutil.rmtree(self.out / mf.TOKENIZER_DIR, ignore_errors=True)


def _prepare_out_dir(args: argparse.Namespace) -> bool:
    """Make --out ready for writing; True if this run created it (so cleanup removes it).

    Leftovers of an interrupted prepare (shards, no dataset.json) are replaced without asking;
    a complete dataset only with --overwrite; anything else is refused (docs/design.md,
    "Outputs")."""
    out: Path = args.out
    inputs = [("--input", Path(p)) for p in args.input] + [("--tokenizer", args.tokenizer)]
    entries = list(out.iterdir()) if out.is_dir() else []
    leftovers = bool(entries) and all(_ours(e) for e in entries) \
        and not (out / mf.MANIFEST).exists()
    if not leftovers:
        output.claim(out, "dataset", "data_tools prepare", overwrite=args.overwrite,
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


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this dataset (from the parsed flags)."""
    parts = ["python", "-m", "data_tools", "prepare", "--input", *map(str, args.input),
             "--tokenizer", str(args.tokenizer), "--out", str(args.out),
             "--workers", str(args.workers), "--val-fraction", repr(args.val_fraction),
             "--text-key", args.text_key, "--include", args.include,
             "--shard-tokens", str(args.shard_tokens), "--dtype-code", args.dtype_code]
    parts += ["--strict"] * args.strict + ["--overwrite"] * args.overwrite
    return shlex.join(parts)


def _check_args(args: argparse.Namespace) -> None:
    if args.workers < 1:
        raise UserError(f"--workers {args.workers}: must be at least 1")
    if not 0.0 <= args.val_fraction < 1.0:
        raise UserError(f"--val-fraction {args.val_fraction}: must be in [0, 1)")
    if args.shard_tokens < 1:
        raise UserError(f"--shard-tokens {args.shard_tokens}: must be at least 1")
    if args.batch_chars < 1:
        raise UserError(f"--batch-chars {args.batch_chars}: must be at least 1")
    if args.piece_chars < 64:
        raise UserError(f"--piece-chars {args.piece_chars}: must be at least 64")


def build_manifest(p: Preparer, splits: dict[str, Any], tok_files: list[dict[str, Any]],
                   seconds: float) -> dict[str, Any]:
    tok, stats, args = p.tok, p.corpus.stats, p.args
    output_bytes = sum(s["bin_bytes"] + s["idx_bytes"]
                       for split in splits.values() for s in split["shards"])
    input_bytes = p.corpus.input_bytes
    m: dict[str, Any] = {
        "format": mf.FORMAT, "format_version": mf.FORMAT_VERSION,
        "dtype": tok.dtype.name, "vocab_size": tok.vocab_size,
        "eod_token_id": tok.eod_token_id, **tok.special_ids,
        "model_max_length": tok.model_max_length,
        "tokenizer": {"dir": mf.TOKENIZER_DIR,
                      "fingerprint": mf.tokenizer_fingerprint(p.out / mf.TOKENIZER_DIR),
                      "kind": tok.kind, "source": str(args.tokenizer), "files": tok_files},
        "checksum_algorithm": mf.CHECKSUM_ALGORITHM,
        "splits": splits,
        "documents": p.documents, "tokens": p.tokens,
        "val_fraction": args.val_fraction, "shard_tokens": args.shard_tokens,
        "dtype_code": args.dtype_code,
        "source": {"fingerprint": stats.fingerprint, "files": stats.files, "bytes": stats.bytes,
                   "documents": stats.documents, "replaced_invalid_utf8": stats.replaced_chars,
                   "text_key": args.text_key, "include": args.include},
        # Output bytes count the shards (what training reads), not the tokenizer copy.
        "input_bytes": input_bytes, "output_bytes": output_bytes,
        "size_reduction_pct": round(100.0 * (1 - output_bytes / input_bytes), 2)
        if input_bytes else 0.0,
        "command": _command(args),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 3),
    }
    m["fingerprint"] = mf.dataset_fingerprint(m)
    return m


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    t0 = time.perf_counter()
    corpus = Corpus(args.input, args.include, args.text_key, args.strict, args.piece_chars)
    tok = TokenizerInfo(args.tokenizer)
    created_out = _prepare_out_dir(args)
    p = Preparer(args, tok, corpus)
    ok = False
    try:
        tok_files = tok.copy_to(args.out / mf.TOKENIZER_DIR)
        p.tokenize_all()
        if p.documents == 0:
            raise UserError(f"empty corpus: no documents in {len(corpus.files)} input file(s)")
        splits = {}
        for name, w in p.writers.items():
            split = w.finish()
            if split["shards"]:
                splits[name] = split
        m = build_manifest(p, splits, tok_files, time.perf_counter() - t0)
        mf.write_manifest(args.out, m)
        ok = True
    except OSError as e:
        raise output.write_error(e, _current_path(p)) from None
    finally:
        if not ok:
            p.abort()
            if created_out:
                shutil.rmtree(args.out, ignore_errors=True)
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
