"""`dataset.json`: the manifest of a dataset directory, and the checksums it records.

A dataset directory is complete exactly when `dataset.json` exists: it is written last, atomically
(temporary file, fsync, rename). Layout:

    DIR/dataset.json
    DIR/tokenizer/                 copy of the tokenizer (HF format), so DIR is self-contained
    DIR/<split>_<NNNNN>.bin/.idx   Megatron shards, e.g. train_00000.bin

Schema (format_version 1):

    {
      "format": "dspretrain-dataset", "format_version": 1,
      "dtype": "uint16" | "int32", "vocab_size": int, "eod_token_id": int,
      "pad_token_id": int|null, "mask_token_id": int|null,
      "tokenizer": {"dir": "tokenizer", "fingerprint": "xxh3_128:<hex of tokenizer.json>",
                    "kind": "wordpiece"|"bpe"|...,
                    "files": [{"name": "tokenizer.json", "bytes": int, "checksum": ".."}, ...]},
      "checksum_algorithm": "xxh3_128",
      "splits": {"train": {"documents": int, "tokens": int,
                           "shards": [{"name": "train_00000", "documents": int, "tokens": int,
                                       "bin_bytes": int, "idx_bytes": int,
                                       "bin_checksum": "xxh3_128:..",
                                       "idx_checksum": "xxh3_128:.."}]},
                 "val": {...}},
      "fingerprint": "xxh3_128:..",   # of the shard checksums + tokenizer: identifies the data
      "source": {"fingerprint": .., "files": int, "bytes": int, "documents": int},
      "input_bytes": int, "output_bytes": int, "size_reduction_pct": float,
      "command": "...", "created_at": "ISO-8601 UTC", ...
    }
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Literal

import numpy as np
import xxhash

from data_tools.errors import UserError
from data_tools.output import write_json_atomic
from data_tools.schema import NonNegativeInt, PositiveInt, Schema, check, check_regular, read_json

MANIFEST = "dataset.json"
FORMAT = "dspretrain-dataset"
FORMAT_VERSION = 1
TOKENIZER_DIR = "tokenizer"
CHECKSUM_ALGORITHM = "xxh3_128"
TOKEN_DTYPES = ("uint16", "int32")  # Megatron's two choices (data_tools.indexed.token_dtype)
_CHUNK = 8 << 20


def new_hasher():
    """xxh3_128: ~10x faster than sha256, so verification keeps up with the disk."""
    return xxhash.xxh3_128()


def format_digest(hasher) -> str:
    return f"{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}"


def read_chunks(f: BinaryIO, buf: memoryview, limit: int | None = None) -> Iterator[memoryview]:
    """The one read loop of checksums, verification and staging: successive chunks of the open
    file `f` (up to `limit` bytes), each read into `buf` (reused, so use a chunk before the
    next) and filled completely unless the file ends (network filesystems return short reads)."""
    left = limit
    while left is None or left > 0:
        want = len(buf) if left is None else min(len(buf), left)
        got = 0
        while got < want:
            n = f.readinto(buf[got:want])
            if not n:
                break
            got += n
        if not got:
            return
        yield buf[:got]
        if left is not None:
            left -= got
        if got < want:
            return


def file_checksum(path: str | os.PathLike, chunk: int = _CHUNK) -> str:
    h = new_hasher()
    with open(path, "rb", buffering=0) as f:
        for piece in read_chunks(f, memoryview(bytearray(chunk))):
            h.update(piece)
    return format_digest(h)


def checksum_and_range(path: str | os.PathLike, dtype: np.dtype | None = None, *,
                       copy_to: BinaryIO | None = None,
                       progress: Callable[[int], Any] | None = None
                       ) -> tuple[str, int | None, int | None]:
    """One read of `path`: its checksum and, given a token dtype, its smallest and largest id
    (None for an empty file). Each chunk is also written to `copy_to` (a copy made in the same
    pass) and counted by `progress(n)`."""
    h = new_hasher()
    lo = hi = None
    with open(path, "rb", buffering=0) as f:
        for chunk in read_chunks(f, memoryview(bytearray(_CHUNK))):  # a multiple of every dtype
            h.update(chunk)
            if copy_to is not None:
                copy_to.write(chunk)
            usable = len(chunk) - len(chunk) % dtype.itemsize if dtype is not None else 0
            if usable:
                ids = np.frombuffer(chunk[:usable], dtype=dtype)
                low, high = int(ids.min()), int(ids.max())
                lo, hi = (low, high) if lo is None else (min(lo, low), max(hi, high))
            if progress is not None:
                progress(len(chunk))
    return format_digest(h), lo, hi


def tokenizer_fingerprint(tokenizer_dir: str | os.PathLike) -> str:
    """Hash of tokenizer.json (the whole vocabulary, merges, normaliser and special tokens)."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.exists() and not path.is_symlink():
        raise UserError(f"{tokenizer_dir}: no tokenizer.json (not a Hugging Face tokenizer "
                        f"directory)")
    return file_checksum(check_regular(path))  # a FIFO, directory or dangling link: named


def dataset_fingerprint(manifest: dict[str, Any]) -> str:
    """Identifies the data: the tokenizer and every shard's checksums, in split order."""
    h = new_hasher()
    h.update(manifest["tokenizer"]["fingerprint"].encode())
    for split in sorted(manifest["splits"]):
        for shard in manifest["splits"][split]["shards"]:
            h.update(f"{split}/{shard['name']}/{shard['bin_checksum']}/{shard['idx_checksum']}"
                     .encode())
    return format_digest(h)


def split_entry(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """A split of dataset.json: its shards and their totals."""
    return {"documents": sum(s["documents"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards), "shards": shards}


def new_manifest(dtype: str, tokenizer_fields: dict[str, Any], splits: dict[str, Any],
                 **extra: Any) -> dict[str, Any]:
    """dataset.json of shards in `splits` (non-empty ones kept), with its fingerprint."""
    splits = {name: split for name, split in splits.items() if split["shards"]}
    m: dict[str, Any] = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "dtype": dtype, **tokenizer_fields,
        "checksum_algorithm": CHECKSUM_ALGORITHM, "splits": splits,
        "documents": sum(s["documents"] for s in splits.values()),
        "tokens": sum(s["tokens"] for s in splits.values()), **extra}
    m["fingerprint"] = dataset_fingerprint(m)
    return m


def write_manifest(dataset_dir: str | os.PathLike, manifest: dict[str, Any]) -> None:
    write_json_atomic(Path(dataset_dir) / MANIFEST, manifest)


class ShardEntry(Schema):
    name: str
    documents: NonNegativeInt | None = None
    tokens: NonNegativeInt | None = None
    bin_bytes: NonNegativeInt
    idx_bytes: NonNegativeInt
    bin_checksum: str
    idx_checksum: str


class SplitEntry(Schema):
    documents: NonNegativeInt | None = None
    tokens: NonNegativeInt | None = None
    shards: list[ShardEntry]


class TokenizerFile(Schema):
    name: str
    bytes: NonNegativeInt
    checksum: str


class TokenizerEntry(Schema):
    dir: str = TOKENIZER_DIR
    fingerprint: str
    kind: str | None = None
    files: list[TokenizerFile] | None = None


class ManifestSchema(Schema):
    """dataset.json as `load_manifest` accepts it (see the module docstring)."""

    format_version: Literal[1]
    dtype: Literal[TOKEN_DTYPES]
    vocab_size: PositiveInt
    eod_token_id: NonNegativeInt
    pad_token_id: NonNegativeInt | None = None
    mask_token_id: NonNegativeInt | None = None
    cls_token_id: NonNegativeInt | None = None
    bos_token_id: NonNegativeInt | None = None
    unk_token_id: NonNegativeInt | None = None
    special_token_ids: list[NonNegativeInt] | None = None
    tokenizer: TokenizerEntry
    splits: dict[str, SplitEntry]
    fingerprint: str
    documents: NonNegativeInt | None = None
    tokens: NonNegativeInt | None = None


def load_manifest(dataset_dir: str | os.PathLike) -> dict[str, Any]:
    """Read and check `DIR/dataset.json`. Raises UserError naming the file and the key."""
    d = Path(dataset_dir)
    if not d.exists():
        raise UserError(f"{d}: no such dataset directory")
    if not d.is_dir():
        raise UserError(f"{d}: not a directory")
    path = d / MANIFEST
    if not path.is_file():
        raise UserError(f"{d}: no {MANIFEST} (not a dataset, or prepare/stage did not finish)")
    manifest = read_json(path)
    if isinstance(manifest, dict) and manifest.get("format_version", FORMAT_VERSION) \
            != FORMAT_VERSION:
        raise UserError(f"{path}: format_version {manifest['format_version']!r} is not supported "
                        f"(this version reads {FORMAT_VERSION})")
    check(ManifestSchema, manifest, path)
    if "train" not in manifest["splits"]:
        raise UserError(f"{path}: key 'splits' has no 'train' split")
    return manifest


_NAMED_SPECIALS = ("eod_token_id", "pad_token_id", "mask_token_id", "cls_token_id",
                   "unk_token_id", "bos_token_id")


def special_ids(dataset_dir: str | os.PathLike, manifest: dict[str, Any]) -> set[int]:
    """Every special token id of the dataset's tokenizer (MLM never selects or draws them).

    `prepare` records them in dataset.json (`special_token_ids`); for a dataset made before it
    did, they are read from its tokenizer copy."""
    ids = {manifest.get(k) for k in _NAMED_SPECIALS}
    if manifest.get("special_token_ids") is not None:
        ids.update(manifest["special_token_ids"])
    else:
        tok_json = Path(dataset_dir) / manifest["tokenizer"].get("dir", TOKENIZER_DIR) \
            / "tokenizer.json"
        added = read_json(tok_json).get("added_tokens") or [] if tok_json.is_file() else []
        ids.update(t["id"] for t in added if t.get("special") and isinstance(t.get("id"), int))
    return {int(i) for i in ids if isinstance(i, int)}


def shard_prefixes(dataset_dir: str | os.PathLike, manifest: dict[str, Any],
                   split: str) -> list[Path]:
    """Paths (without .bin/.idx) of a split's shards, in order."""
    if split not in manifest["splits"]:
        return []
    return [Path(dataset_dir) / s["name"] for s in manifest["splits"][split]["shards"]]


def dataset_files(manifest: dict[str, Any]) -> list[tuple[str, int, str]]:
    """(relative path, bytes, checksum) of every shard and tokenizer file (what verify and stage
    check)."""
    out = []
    for split in manifest["splits"].values():
        for s in split["shards"]:
            out.append((f"{s['name']}.bin", s["bin_bytes"], s["bin_checksum"]))
            out.append((f"{s['name']}.idx", s["idx_bytes"], s["idx_checksum"]))
    tok = manifest["tokenizer"]
    for f in tok.get("files", []):
        out.append((f"{tok.get('dir', TOKENIZER_DIR)}/{f['name']}", f["bytes"], f["checksum"]))
    return out
