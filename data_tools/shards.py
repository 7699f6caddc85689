"""One split of a dataset written as shards `<split>_NNNNN`, each closed once it holds
`shard_tokens` tokens (at the next document of the split, so documents never straddle shards),
with what a resumable prepare needs: the open shard's state at a checkpoint, and a restore from
one (resume.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from data_tools import manifest as mf
from data_tools import output
from data_tools.errors import UserError
from data_tools.indexed import FormatError, ShardWriter, bin_path, idx_path
from data_tools.resume import sizes_path


class SplitWriter:
    """Writes one split; `shards` lists the completed ones (dataset.json entries)."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int,
                 dtype_code: str = "deepspeed"):
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.dtype_code = dtype_code
        self.shards: list[dict[str, Any]] = []
        self.created: list[Path] = []
        self._writer: ShardWriter | None = None
        self._hasher = None
        self._saved = 0  # documents of the open shard already in its sizes sidecar
        self.path: Path = out  # the file being written, for error messages

    def full(self) -> bool:
        return self._writer is not None and self._writer.num_tokens >= self.shard_tokens

    def start_document(self) -> None:
        if self._writer is None:
            prefix = self.out / f"{self.split}_{len(self.shards):05d}"
            self.path = bin_path(prefix)
            self.created += [bin_path(prefix), idx_path(prefix), sizes_path(prefix)]
            self._writer = ShardWriter(prefix, self.dtype, self.dtype_code)
            self._hasher = mf.new_hasher()
            self._saved = 0

    def add(self, tokens: np.ndarray) -> None:
        self._hasher.update(tokens)
        self._writer.add_tokens(tokens)

    def end_document(self) -> None:
        self._writer.end_document()

    def close_shard(self) -> dict[str, Any]:
        """Finalize the open shard; its dataset.json entry."""
        w = self._writer
        self.path = idx_path(w.prefix)
        w.finalize()
        entry = {
            "name": w.prefix.name, "documents": w.num_documents, "tokens": w.num_tokens,
            "bin_bytes": bin_path(w.prefix).stat().st_size,
            "idx_bytes": idx_path(w.prefix).stat().st_size,
            "bin_checksum": mf.format_digest(self._hasher),
            "idx_checksum": mf.file_checksum(idx_path(w.prefix)),
        }
        self.shards.append(entry)
        sizes_path(w.prefix).unlink(missing_ok=True)
        self._writer = None
        return entry

    def finish(self) -> dict[str, Any]:
        if self._writer is not None:
            self.close_shard()
        return mf.split_entry(self.shards)

    # -- checkpoints -------------------------------------------------------------------------

    def open_entry(self) -> dict[str, Any] | None:
        """A checkpoint of the open shard (None: none open): its .bin flushed to disk and the
        sizes of its documents appended to the sidecar, so a resume can reopen it there."""
        w = self._writer
        if w is None:
            return None
        self.path = bin_path(w.prefix)
        w.flush()
        output.append_bytes(sizes_path(w.prefix), w.sizes_from(self._saved))
        self._saved = w.num_documents
        return {"name": w.prefix.name, "documents": w.num_documents, "tokens": w.num_tokens,
                "bin_bytes": w.num_tokens * self.dtype.itemsize}

    def restore(self, shards: list[dict[str, Any]], open_entry: dict[str, Any] | None) -> None:
        """Continue from a checkpoint: `shards` completed, `open_entry` (if any) reopened."""
        for s in shards:
            for path, size in ((self.out / f"{s['name']}.bin", s["bin_bytes"]),
                               (self.out / f"{s['name']}.idx", s["idx_bytes"])):
                if not path.is_file() or path.stat().st_size != size:
                    raise UserError(f"{path}: missing or resized since the interrupted run; "
                                    f"cannot resume (start over with --overwrite)")
        self.shards = list(shards)
        if open_entry is None:
            return
        prefix = self.out / open_entry["name"]
        if prefix.name != f"{self.split}_{len(shards):05d}":
            raise UserError(f"{self.out}: the journal's open shard {prefix.name} does not follow "
                            f"its {len(shards)} completed {self.split} shards")
        sizes = _read_sizes(prefix, open_entry["documents"])
        try:
            self._writer = ShardWriter(prefix, self.dtype, self.dtype_code,
                                       resume_sizes=sizes.tolist())
        except (FormatError, OSError) as e:
            raise UserError(f"cannot resume: {e} (start over with --overwrite)") from None
        if self._writer.num_tokens != open_entry["tokens"]:
            raise UserError(f"{sizes_path(prefix)}: sizes add up to {self._writer.num_tokens} "
                            f"tokens, the journal says {open_entry['tokens']}")
        self._hasher = mf.new_hasher()
        with open(bin_path(prefix), "rb", buffering=0) as f:
            for chunk in mf.read_chunks(f, memoryview(bytearray(8 << 20)),
                                        open_entry["bin_bytes"]):
                self._hasher.update(chunk)
        self._saved = len(sizes)
        self.path = bin_path(prefix)

    def close(self) -> None:
        """Stop writing (a failure): the files stay for the caller to keep or remove."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def remove_created(self) -> None:
        for p in self.created:
            p.unlink(missing_ok=True)


def _read_sizes(prefix: Path, documents: int) -> np.ndarray:
    """The first `documents` sizes of the open shard's sidecar (the rest, written after the
    checkpoint, is cut off)."""
    path = sizes_path(prefix)
    want = documents * 8
    try:
        with open(path, "r+b") as f:
            data = f.read(want)
            if len(data) < want:
                raise UserError(f"{path}: {len(data) // 8} document sizes, the journal says "
                                f"{documents}; cannot resume (start over with --overwrite)")
            f.truncate(want)
    except FileNotFoundError:
        if documents:
            raise UserError(f"{path}: missing; cannot resume (start over with --overwrite)") \
                from None
        return np.zeros(0, dtype=np.int64)
    return np.frombuffer(data, dtype="<i8")
