"""The documents inside one input file, per format (docs/design.md, "Datasets").

- text (`.txt`, and whatever else `--include` matches): the whole file is one document, streamed
  as pieces (see corpus.py);
- JSON lines (`.jsonl`, `.json` streams), plain, gzip (`.gz`) or zstd (`.zst`, `.zstd`): one
  document per line under `--text-key`; `.json.gz` is JSON lines, as Dolma and C4 ship them;
- Parquet (`.parquet`): the `--text-key` column, read in record batches (one row group's column
  in memory at a time, never the file);
- Arrow IPC (`.arrow`, stream or file format; what Hugging Face `datasets.save_to_disk` writes):
  the `--text-key` column, record batch by record batch from a memory map.

A reader yields `(text, is_last_piece, record)`: `record` is how many records of the file the
document ends (a line number, a row number, 1 for a text file). It hashes every byte it reads
into the file's digest, counts what it decodes, and passes over the first `skip` records
without decoding them (a resumed prepare); a problem is one UserError naming the file and the
line, row or key.
"""
from __future__ import annotations

import codecs
import gzip
import io
import json
import re
import zlib
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import xxhash

from data_tools.errors import UserError

READ_BYTES = 1 << 20
_ZSTD_READ_BYTES = 1 << 18  # compressed bytes a step: at 20x, 5 MB out
_ROWS = 1024  # rows per record batch (Parquet)
_GOOD_CUT = re.compile(r"(?<=\S)\n(?=\S)|(?= \S)")
_SURROGATE = re.compile("[\ud800-\udfff]")

Record = tuple[str, bool, int]


@dataclass
class FileRead:
    """One input file being read: its settings, its digest, what was counted, how far it got."""

    path: Path
    text_key: str = "text"
    strict: bool = False
    piece_chars: int = 1 << 20
    skip: int = 0
    """Records already done (a resume): hashed, not decoded, counted or yielded."""
    hasher: xxhash.xxh3_128 = field(default_factory=xxhash.xxh3_128)
    bytes: int = 0
    """Content bytes read past `skip` (decompressed; a column's UTF-8 for Parquet/Arrow)."""
    replaced: int = 0
    """Invalid UTF-8 sequences replaced past `skip`."""
    pos: int = 0
    """Bytes of the file itself consumed so far (compressed; for the progress bar)."""

    @property
    def errors(self) -> str:
        return "strict" if self.strict else "dspretrain.count"


# The file decoding right now: codec error handlers are registered globally, so the handler
# finds its counter here (set around each decode call, never across a `yield`).
_decoding: ContextVar[FileRead | None] = ContextVar("dspretrain_decoding", default=None)


def _count_and_replace(err: UnicodeDecodeError) -> tuple[str, int]:
    """Codec error handler: U+FFFD like errors="replace", but counted for the summary."""
    read = _decoding.get()
    if read is not None:
        read.replaced += 1
    return "\ufffd", err.end


codecs.register_error("dspretrain.count", _count_and_replace)


def _decode(read: FileRead, decode: Callable, *args) -> str:
    token = _decoding.set(read)
    try:
        return decode(*args)
    finally:
        _decoding.reset(token)


def kind_of(path: Path) -> str:
    """'jsonl', 'parquet', 'arrow' or 'text', from the file name."""
    name = path.name
    stem = name.rsplit(".", 1)[0] if name.endswith((".gz", ".zst", ".zstd")) else name
    # A plain .json file may be one JSON value; compressed ones are line streams (C4, Dolma).
    if stem.endswith(".jsonl") or (stem.endswith(".json") and stem != name):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    return "text"


def records(read: FileRead) -> Iterator[Record]:
    """The documents of `read.path` in order (see the module docstring)."""
    reader = {"jsonl": _json_lines, "parquet": _parquet, "arrow": _arrow,
              "text": _text}[kind_of(read.path)]
    return reader(read)


def cut_point(text: str, limit: int) -> int:
    """Where to end a piece of at most `limit` chars: the last safe cut (see corpus.py)."""
    window = text[limit // 2:limit]
    best = -1
    for m in _GOOD_CUT.finditer(window):
        best = m.end()
    if best < 0:
        nl = window.rfind("\n")
        best = nl + 1 if nl >= 0 else len(window)
    return limit // 2 + best


# -- text ------------------------------------------------------------------------------------


def _text(read: FileRead) -> Iterator[Record]:
    path = read.path
    decoder = codecs.getincrementaldecoder("utf-8")(errors=read.errors)
    buf = ""
    with open(path, "rb") as f:
        while True:
            raw = f.read(READ_BYTES)
            read.hasher.update(raw)
            read.pos += len(raw)
            if read.skip:  # the document is done: only its digest is wanted
                if raw:
                    continue
                return
            read.bytes += len(raw)
            try:
                buf += _decode(read, decoder.decode, raw, not raw)
            except UnicodeDecodeError as e:
                raise UserError(f"{path}: invalid UTF-8 at byte {read.pos - len(raw) + e.start} "
                                f"(drop --strict to replace and count it)") from None
            while len(buf) > read.piece_chars:
                cut = cut_point(buf, read.piece_chars)
                yield buf[:cut], False, 0
                buf = buf[cut:]
            if not raw:
                break
    yield buf, True, 1  # "" with nothing before it: an empty document


# -- JSON lines ------------------------------------------------------------------------------


def _json_lines(read: FileRead) -> Iterator[Record]:
    path = read.path
    lineno = 0
    with open(path, "rb") as raw:
        stream = _decompressed(raw, path)
        try:
            for lineno, line in enumerate(stream, 1):
                read.hasher.update(line)
                read.pos = raw.tell()
                if lineno <= read.skip:
                    continue
                read.bytes += len(line)
                text = _json_text(read, line, lineno)
                if text is not None:
                    yield text, True, lineno
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise UserError(f"{path}: corrupt gzip file{_at('line', lineno)} ({e})") from None
        except _zstd_error() as e:
            raise UserError(f"{path}: corrupt zstd file{_at('line', lineno)} ({e})") from None


def _decompressed(raw: io.BufferedReader, path: Path):
    if path.name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if path.name.endswith((".zst", ".zstd")):
        return io.BufferedReader(ZstdStream(raw), buffer_size=READ_BYTES)
    return raw


def _zstd_error() -> type[Exception]:
    import zstandard

    return zstandard.ZstdError


class ZstdStream(io.RawIOBase):
    """A .zst file decompressed as it is read: frame after frame (pzstd and `zstd -T` write
    several), windows up to 2 GiB (`zstd --long`), and a cut-off last frame is an error where
    zstandard's own stream_reader would end quietly."""

    def __init__(self, raw: io.BufferedReader):
        import zstandard

        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor(max_window_size=1 << 31)
        self._frame = None  # the decompressor of a frame begun and not yet ended
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._out:
            data = self._raw.read(_ZSTD_READ_BYTES)
            if not data:
                if self._frame is not None:
                    raise _zstd_error()("the file ends inside a frame (truncated)")
                return 0
            self._out = memoryview(self._feed(data))
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _feed(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._frame is None:
                self._frame = self._dctx.decompressobj()
            out.append(self._frame.decompress(data))
            data = b""
            if self._frame.eof:
                data, self._frame = self._frame.unused_data, None
        return b"".join(out)


def _json_text(read: FileRead, raw: bytes, lineno: int) -> str | None:
    """The text of one JSON line (None for a blank line)."""
    where = f"{read.path}:{lineno}"
    try:
        line = _decode(read, raw.decode, "utf-8", read.errors)
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: invalid UTF-8 at column {e.start + 1} "
                        f"(drop --strict to replace and count it)") from None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        hint = " (.json files are read as JSON lines)" if line.lstrip().startswith("[") else ""
        raise UserError(f"{where}: malformed JSON line ({e.msg} at column {e.colno}){hint}") \
            from None
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    key = read.text_key
    if key not in obj:
        raise UserError(f"{where}: no key '{key}' (set --text-key)")
    text = obj[key]
    if not isinstance(text, str):
        raise UserError(f"{where}: key '{key}' is {type(text).__name__}, not a string")
    return text if text.isascii() else _fix_surrogates(read, text, where)


def _fix_surrogates(read: FileRead, text: str, where: str) -> str:
    """JSON escapes can encode lone surrogates ("\\ud800"), which are not valid UTF-8."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        if read.strict:
            raise UserError(f"{where}: key '{read.text_key}' holds a lone surrogate "
                            f"(invalid Unicode; drop --strict to replace it)") from None
        fixed, n = _SURROGATE.subn("\ufffd", text)
        read.replaced += n
        return fixed


# -- columns: Parquet and Arrow --------------------------------------------------------------


def _parquet(read: FileRead) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    try:
        with pq.ParquetFile(read.path) as pf:
            _check_column(read, pf.schema_arrow, "Parquet")
            total, size = max(pf.metadata.num_rows, 1), read.path.stat().st_size
            for batch in pf.iter_batches(batch_size=_ROWS, columns=[read.text_key],
                                         use_threads=False):
                column = batch.column(0)
                yield from _rows(read, column, row)
                row += len(column)
                read.pos = size * row // total
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, OSError) and e.errno:
            raise  # the filesystem's (permission, I/O), not the file's
        raise UserError(f"{read.path}: corrupt Parquet file{_at('row', row)} "
                        f"({_first_line(e)})") from None


def _arrow(read: FileRead) -> Iterator[Record]:
    import pyarrow as pa

    row = 0
    try:
        with pa.memory_map(str(read.path)) as source:
            for batch in _ipc_batches(source):
                if row == 0:
                    _check_column(read, batch.schema, "Arrow")
                column = batch.column(read.text_key)
                yield from _rows(read, column, row)
                row += len(column)
                read.pos = source.tell()
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, OSError) and e.errno:
            raise
        raise UserError(f"{read.path}: corrupt Arrow file{_at('row', row)} "
                        f"({_first_line(e)})") from None


def _ipc_batches(source) -> Iterator:
    """Record batches of an Arrow IPC stream (what `datasets` writes) or file."""
    import pyarrow as pa

    is_file_format = source.read(6) == b"ARROW1"
    source.seek(0)
    if not is_file_format:
        yield from pa.ipc.open_stream(source)
        return
    reader = pa.ipc.open_file(source)
    for i in range(reader.num_record_batches):
        yield reader.get_batch(i)


def _check_column(read: FileRead, schema, fmt: str) -> None:
    import pyarrow as pa

    key = read.text_key
    index = schema.get_field_index(key)
    if index < 0:
        names = ", ".join(schema.names[:8]) + (", ..." if len(schema.names) > 8 else "")
        raise UserError(f"{read.path}: no column '{key}' in this {fmt} file (columns: {names}; "
                        f"set --text-key)")
    t = schema.field(index).type
    if pa.types.is_dictionary(t):
        t = t.value_type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
        raise UserError(f"{read.path}: column '{key}' is {t}, not a string")


def _rows(read: FileRead, column, first_row: int) -> Iterator[Record]:
    """The rows of one record batch's text column, hashed as its UTF-8 bytes and lengths."""
    import pyarrow as pa

    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if not pa.types.is_large_string(column.type):
        column = column.cast(pa.large_string())  # one offset width for the hash
    if column.null_count:
        bad = int(np.argmax(column.is_null().to_numpy(zero_copy_only=False)))
        raise UserError(f"{read.path}: row {first_row + bad + 1}: column '{read.text_key}' is "
                        f"null, not a string")
    _, offsets_buf, data = column.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64, count=len(column) + 1 + column.offset)
    offsets = offsets[column.offset:]
    lengths = np.diff(offsets)
    read.hasher.update(lengths.astype("<i8").tobytes())
    if data is not None:
        read.hasher.update(memoryview(data)[int(offsets[0]):int(offsets[-1])])
    start = max(read.skip - first_row, 0)
    if start >= len(column):
        return
    sizes = lengths.tolist()
    for i, text in enumerate(column.slice(start).to_pylist(), start):
        read.bytes += sizes[i]
        yield text, True, first_row + i + 1


def _at(unit: str, done: int) -> str:
    """Where reading failed: past the first `done` lines or rows (nothing: at the start)."""
    return f" at {unit} {done + 1}" if done else ""


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
