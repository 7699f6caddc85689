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

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import xxhash

from data_tools.errors import UserError

MANIFEST = "dataset.json"
FORMAT = "dspretrain-dataset"
FORMAT_VERSION = 1
TOKENIZER_DIR = "tokenizer"
CHECKSUM_ALGORITHM = "xxh3_128"
_CHUNK = 8 << 20


def new_hasher():
    """xxh3_128: ~10x faster than sha256, so verification keeps up with the disk."""
    return xxhash.xxh3_128()


def format_digest(hasher) -> str:
    return f"{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}"


def file_checksum(path: str | os.PathLike, chunk: int = _CHUNK) -> str:
    h = new_hasher()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return format_digest(h)


def tokenizer_fingerprint(tokenizer_dir: str | os.PathLike) -> str:
    """Hash of tokenizer.json (the whole vocabulary, merges, normaliser and special tokens)."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{tokenizer_dir}: no tokenizer.json (not a Hugging Face tokenizer "
                        f"directory)")
    return file_checksum(path)


def dataset_fingerprint(manifest: dict[str, Any]) -> str:
    """Identifies the data: the tokenizer and every shard's checksums, in split order."""
    h = new_hasher()
    h.update(manifest["tokenizer"]["fingerprint"].encode())
    for split in sorted(manifest["splits"]):
        for shard in manifest["splits"][split]["shards"]:
            h.update(f"{split}/{shard['name']}/{shard['bin_checksum']}/{shard['idx_checksum']}"
                     .encode())
    return format_digest(h)


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write JSON so that readers see either nothing or the whole file."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write a file so that readers see the old content or the whole new one, never a part."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes it 0600; others must read a dataset
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_json(path: str | os.PathLike, *, missing: str | None = None) -> Any:
    """Parse a JSON file; UserError naming the file (and the line) when it is unusable.

    `missing` is the message for a file that does not exist (default: "<path>: no such file").
    """
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(missing or f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None


def write_manifest(dataset_dir: str | os.PathLike, manifest: dict[str, Any]) -> None:
    write_json_atomic(Path(dataset_dir) / MANIFEST, manifest)


_REQUIRED = ("format_version", "dtype", "vocab_size", "eod_token_id", "tokenizer", "splits")


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
    if not isinstance(manifest, dict):
        raise UserError(f"{path}: expected a JSON object")
    for key in _REQUIRED:
        if key not in manifest:
            raise UserError(f"{path}: missing key '{key}'")
    if manifest["format_version"] != FORMAT_VERSION:
        raise UserError(f"{path}: format_version {manifest['format_version']!r} is not supported "
                        f"(this version reads {FORMAT_VERSION})")
    splits = manifest["splits"]
    if not isinstance(splits, dict) or "train" not in splits:
        raise UserError(f"{path}: key 'splits' has no 'train' split")
    for name, split in splits.items():
        if not isinstance(split, dict) or not isinstance(split.get("shards"), list):
            raise UserError(f"{path}: key 'splits.{name}.shards' is missing or not a list")
        for i, shard in enumerate(split["shards"]):
            for key in ("name", "bin_bytes", "idx_bytes", "bin_checksum", "idx_checksum"):
                if key not in shard:
                    raise UserError(f"{path}: key 'splits.{name}.shards[{i}].{key}' is missing")
    return manifest


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
