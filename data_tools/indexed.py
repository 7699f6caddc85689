"""Megatron-LM's memory-mapped indexed format (`MMIDIDX`, version 1): `<prefix>.bin` and
`<prefix>.idx`.

`.bin` holds the token ids of every sequence back to back. `.idx` holds:

    magic  b"MMIDIDX\\x00\\x00"   9 bytes
    version                      <Q  (1)
    dtype code                   <B
    sequence count N             <Q
    document count D             <Q  (D = N + 1 here: one sequence per document)
    sizes                        int32[N]   tokens per sequence
    pointers                     int64[N]   byte offset of each sequence in .bin
    document index               int64[D]   sequence index where each document starts, then N

Written by hand (not through DeepSpeed's builder) so that data tools need neither torch nor
DeepSpeed, and so a shard streams to disk without holding its tokens in memory.

Dtype codes: Megatron-LM and DeepSpeed agree on 1..5 (uint8, int8, int16, int32, int64) but not
above: uint16 is 8 in Megatron-LM and 6 in DeepSpeed (where 6 is float64 in Megatron and 8 is
uint64 in DeepSpeed). We write DeepSpeed's code for uint16 by default, so the shards read back
unchanged through `deepspeed...indexed_dataset.MMapIndexedDataset`; `code_convention="megatron"`
writes Megatron's. The reader accepts both: token ids are never floats, and the .bin size tells
uint16 from uint64.
"""
from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path
from typing import Sequence

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8

# Codes both conventions share.
_COMMON_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64}
_UINT16_CODE = {"deepspeed": 6, "megatron": 8}
_WRITE_BUFFER = 1 << 20  # fewer syscalls when documents are short


class FormatError(ValueError):
    """A shard that does not follow the format (the message names the file)."""


class ShardChanged(FormatError):
    """A shard's .bin cut short while it is read (`IndexedShard.check_extent`)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 when every id fits with room to spare, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def dtype_code(dtype, convention: str = "deepspeed") -> int:
    dtype = np.dtype(dtype)
    if dtype == np.uint16:
        return _UINT16_CODE[convention]
    for code, dt in _COMMON_CODES.items():
        if np.dtype(dt) == dtype:
            return code
    raise ValueError(f"unsupported token dtype {dtype}")


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


class ShardWriter:
    """Streams documents into `<prefix>.bin`; writes `<prefix>.idx` on `finalize()`.

    Each document is one sequence (as Megatron's preprocess_data.py writes it without sentence
    splitting); the caller appends the end-of-document token itself. Only the per-document sizes
    stay in memory (8 bytes a document). `resume_sizes` reopens a shard a killed run left open:
    its .bin is cut back to those documents and written on from there.
    """

    def __init__(self, prefix: str | os.PathLike, dtype, code_convention: str = "deepspeed",
                 *, resume_sizes: Sequence[int] | None = None):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        self.code = dtype_code(self.dtype, code_convention)
        self._sizes = array("q", () if resume_sizes is None else resume_sizes)  # 8 B a document
        self._open_size = 0
        self.num_tokens = sum(self._sizes)
        if resume_sizes is None:
            self._bin = open(bin_path(prefix), "wb", buffering=_WRITE_BUFFER)
        else:
            self._bin = _reopen(bin_path(prefix), self.num_tokens * self.dtype.itemsize)

    def add_document(self, tokens) -> None:
        self.add_tokens(tokens)
        self.end_document()

    def add_tokens(self, tokens) -> None:
        """Append to the current document without ending it (a long document comes in pieces)."""
        arr = np.ascontiguousarray(tokens, dtype=self.dtype)
        self._bin.write(memoryview(arr).cast("B"))
        self._open_size += int(arr.size)
        self.num_tokens += int(arr.size)

    def end_document(self) -> None:
        self._sizes.append(self._open_size)
        self._open_size = 0

    @property
    def num_documents(self) -> int:
        return len(self._sizes)

    def sizes_from(self, first: int) -> bytes:
        """Sizes of documents `first`... as little-endian int64 bytes (a resume's sidecar)."""
        return np.asarray(self._sizes[first:], dtype="<i8").tobytes()

    def flush(self) -> None:
        """Everything written so far is on disk (a checkpoint of a resumable run)."""
        if self._open_size:
            raise ValueError(f"{self.prefix}: flush() inside a document")
        self._bin.flush()
        os.fsync(self._bin.fileno())

    def finalize(self, fsync: bool = True) -> None:
        if self._open_size:
            raise ValueError(f"{self.prefix}: finalize() inside a document (call end_document())")
        self._bin.flush()
        if fsync:
            os.fsync(self._bin.fileno())
        self._bin.close()
        sizes = np.frombuffer(self._sizes, dtype=np.int64) if self._sizes else np.zeros(0, np.int64)
        if sizes.size and sizes.max() > np.iinfo(np.int32).max:
            raise ValueError(f"{self.prefix}: a document longer than 2^31 tokens")
        pointers = np.zeros(sizes.size, dtype=np.int64)
        if sizes.size > 1:
            np.cumsum(sizes[:-1] * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(sizes.size + 1, dtype=np.int64)
        with open(idx_path(self.prefix), "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", self.code))
            f.write(struct.pack("<Q", sizes.size))
            f.write(struct.pack("<Q", doc_idx.size))
            f.write(sizes.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_idx.tobytes(order="C"))
            f.flush()
            if fsync:
                os.fsync(f.fileno())

    def close(self) -> None:
        """Stop writing without an index (a failed run); the .bin stays as far as it got."""
        try:
            self._bin.close()
        except OSError:
            pass  # flushing the buffer failed (disk full): the caller keeps or removes the file

    def abort(self) -> None:
        """Close and remove what was written."""
        self.close()
        for p in (bin_path(self.prefix), idx_path(self.prefix)):
            p.unlink(missing_ok=True)


def _reopen(path: Path, keep_bytes: int):
    """`path` opened for appending after its first `keep_bytes` bytes (the rest is dropped)."""
    f = open(path, "r+b", buffering=_WRITE_BUFFER)
    try:
        size = os.fstat(f.fileno()).st_size
        if size < keep_bytes:
            raise FormatError(f"{path}: {size} bytes, expected at least {keep_bytes} (truncated)")
        f.truncate(keep_bytes)
        f.seek(keep_bytes)
    except BaseException:
        f.close()
        raise
    return f


class IndexedShard:
    """Read-only, memory-mapped view of one `<prefix>.bin/.idx` pair.

    Opening costs O(1) in the dataset size: nothing is read until indexed. Safe to create inside
    each DataLoader worker (the memmaps are opened lazily on first use and not pickled).
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = Path(prefix)
        ip, bp = idx_path(prefix), bin_path(prefix)
        for p in (ip, bp):
            if not p.is_file():
                raise FormatError(f"{p}: missing")
        idx_bytes = ip.stat().st_size
        bin_bytes = bp.stat().st_size
        with open(ip, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:len(MAGIC)] != MAGIC:
            raise FormatError(f"{ip}: not a Megatron MMIDIDX index (bad magic)")
        off = len(MAGIC)
        (version,) = struct.unpack_from("<Q", head, off)
        (code,) = struct.unpack_from("<B", head, off + 8)
        (self.num_sequences,) = struct.unpack_from("<Q", head, off + 9)
        (self.num_doc_idx,) = struct.unpack_from("<Q", head, off + 17)
        if version != VERSION:
            raise FormatError(f"{ip}: index version {version}, expected {VERSION}")
        n, d = self.num_sequences, self.num_doc_idx
        expected_idx = HEADER_BYTES + n * 4 + n * 8 + d * 8
        if idx_bytes != expected_idx:
            raise FormatError(f"{ip}: {idx_bytes} bytes, header says {expected_idx}")
        self._sizes_off = HEADER_BYTES
        self._pointers_off = HEADER_BYTES + n * 4
        self._doc_off = HEADER_BYTES + n * 12
        self.bin_bytes = bin_bytes
        self._idx_mm = None
        self._bin_mm = None
        self._bin_fd: int | None = None  # the mapped file, for `check_extent`
        self.code = code
        self.dtype = self._resolve_dtype(code, ip)  # may read the sizes (code 8)

    def _resolve_dtype(self, code: int, ip: Path) -> np.dtype:
        if code in _COMMON_CODES:
            return np.dtype(_COMMON_CODES[code])
        if code in (6, 8):
            # uint16 in one convention; float64 (Megatron 6) or uint64 (DeepSpeed 8) in the other.
            # Token ids are integers, so 6 is uint16; for 8 the .bin size decides.
            if code == 6:
                return np.dtype(np.uint16)
            total = int(self.sizes.sum()) if self.num_sequences else 0
            if total * 2 == self.bin_bytes:
                return np.dtype(np.uint16)
            if total * 8 == self.bin_bytes:
                return np.dtype(np.uint64)
            raise FormatError(f"{bin_path(self.prefix)}: {self.bin_bytes} bytes, the index "
                              f"holds {total} tokens (dtype code 8: 2 bytes each in Megatron-LM, "
                              f"8 in DeepSpeed): truncated, or not this index's .bin")
        raise FormatError(f"{ip}: unknown dtype code {code}")

    # -- lazily opened memmaps (not pickled: each DataLoader worker maps its own) --------------

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_idx_mm"] = None
        state["_bin_mm"] = None
        state["_bin_fd"] = None
        return state

    def __del__(self) -> None:
        if getattr(self, "_bin_fd", None) is not None:
            os.close(self._bin_fd)

    def check_extent(self, end: int) -> None:
        """Raise ShardChanged when the .bin no longer holds its first `end` tokens: a shard
        truncated under a running job (reading a mapped page past the file's end is a SIGBUS:
        the process dies with "Bus error" and no message). One fstat of the mapped file."""
        if self._bin_fd is None:
            self._bin_fd = os.open(bin_path(self.prefix), os.O_RDONLY)
        size = os.fstat(self._bin_fd).st_size
        if size < end * self.dtype.itemsize:
            raise ShardChanged(f"{bin_path(self.prefix)}: {size} bytes now, {self.bin_bytes} "
                               f"when the run opened it: the shard was truncated under the "
                               f"running job (restore or re-stage the dataset, check it with "
                               f"`python -m data_tools inspect --verify`, then resume)")

    @property
    def _idx(self) -> np.memmap:
        if self._idx_mm is None:
            self._idx_mm = np.memmap(idx_path(self.prefix), dtype=np.uint8, mode="r")
        return self._idx_mm

    @property
    def sizes(self) -> np.ndarray:
        """Tokens per sequence (int32, memory-mapped)."""
        return np.frombuffer(self._idx, dtype=np.int32, count=self.num_sequences,
                             offset=self._sizes_off)

    @property
    def pointers(self) -> np.ndarray:
        """Byte offset of each sequence in the .bin (int64, memory-mapped)."""
        return np.frombuffer(self._idx, dtype=np.int64, count=self.num_sequences,
                             offset=self._pointers_off)

    @property
    def doc_idx(self) -> np.ndarray:
        return np.frombuffer(self._idx, dtype=np.int64, count=self.num_doc_idx,
                             offset=self._doc_off)

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the shard as one flat memory-mapped array (documents back to back)."""
        if self._bin_mm is None:
            if self.bin_bytes == 0:
                return np.zeros(0, dtype=self.dtype)
            # a plain ndarray over the map: slicing a np.memmap costs ~1.5 us more a sample
            if self._bin_fd is None:  # the file `check_extent` asks: the one mapped
                self._bin_fd = os.open(bin_path(self.prefix), os.O_RDONLY)
            self._bin_mm = np.memmap(bin_path(self.prefix), dtype=self.dtype,
                                     mode="r").view(np.ndarray)
        return self._bin_mm

    @property
    def num_tokens(self) -> int:
        return self.bin_bytes // self.dtype.itemsize

    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence (document) `i` as a view into the .bin memmap."""
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start:start + int(self.sizes[i])]

    def check_consistency(self) -> None:
        """Structural check of .idx against .bin (no token read). Raises FormatError."""
        ip = idx_path(self.prefix)
        if self.bin_bytes % self.dtype.itemsize:
            raise FormatError(f"{bin_path(self.prefix)}: size is not a multiple of {self.dtype}")
        n = self.num_sequences
        if n == 0:
            if self.bin_bytes:
                raise FormatError(f"{ip}: no sequences but the .bin holds {self.bin_bytes} bytes")
            return
        sizes = self.sizes.astype(np.int64)
        if (sizes < 0).any():
            raise FormatError(f"{ip}: negative sequence size")
        expected = np.zeros(n, dtype=np.int64)
        np.cumsum(sizes[:-1] * self.dtype.itemsize, out=expected[1:])
        if not np.array_equal(expected, self.pointers):
            raise FormatError(f"{ip}: pointers do not match the sizes")
        total = int(sizes.sum()) * self.dtype.itemsize
        if total != self.bin_bytes:
            raise FormatError(f"{bin_path(self.prefix)}: {self.bin_bytes} bytes, the index says "
                              f"{total} (truncated or wrong .idx)")
        doc = self.doc_idx
        if doc.size == 0 or doc[0] != 0 or doc[-1] != n or (np.diff(doc) < 0).any():
            raise FormatError(f"{ip}: document index is not a monotone 0..{n} sequence")
