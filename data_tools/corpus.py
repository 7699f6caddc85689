"""Reading a user's corpus: which files, in what order, and the documents inside them.

A `.txt` file (and any file matched by another `--include` pattern, e.g. `*.py`) is one document;
a `.jsonl`/`.jsonl.gz` file holds one document per line under `--text-key`. Directories are walked
recursively in sorted order, so the document order, and with it the dataset, is deterministic.

Documents come out as *pieces* of at most about `PIECE_CHARS` characters, so that neither a huge
`.txt` file nor a huge JSON line is ever tokenized in one call (which would hold every token's
offsets in memory). Where possible a piece ends just before a space that precedes a non-space, or
after a newline between two non-spaces: WordPiece ignores whitespace, and GPT-2's byte-level
pre-tokenizer always splits there too (" word" starts a pre-token), so the ids equal those of the
whole document. Text with neither (no spaces for ~PIECE_CHARS/2) is cut at a newline, else anywhere.
"""
from __future__ import annotations

import codecs
import fnmatch
import gzip
import json
import os
import re
import zlib
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import xxhash

from data_tools.errors import UserError

DEFAULT_INCLUDE = "*.txt,*.jsonl,*.jsonl.gz"
PIECE_CHARS = 1 << 20
_READ_BYTES = 1 << 20
_GOOD_CUT = re.compile(r"(?<=\S)\n(?=\S)|(?= \S)")
_SURROGATE = re.compile("[\ud800-\udfff]")

# The stats of the corpus decoding right now: codec error handlers are registered globally, so
# the handler finds its corpus here (set around each decode call, never across a `yield`).
_decoding: ContextVar[CorpusStats | None] = ContextVar("dspretrain_decoding", default=None)


def _count_and_replace(err: UnicodeDecodeError) -> tuple[str, int]:
    """Codec error handler: U+FFFD like errors="replace", but counted for the summary."""
    stats = _decoding.get()
    if stats is not None:
        stats.replaced_chars += 1
    return "\ufffd", err.end


codecs.register_error("dspretrain.count", _count_and_replace)


@dataclass
class CorpusStats:
    """What was read: the numbers that go into the summary and dataset.json."""

    files: int = 0
    bytes: int = 0
    documents: int = 0
    replaced_chars: int = 0
    hasher: xxhash.xxh3_128 = field(default_factory=xxhash.xxh3_128)

    @property
    def fingerprint(self) -> str:
        return f"xxh3_128:{self.hasher.hexdigest()}"


def parse_include(include: str) -> list[str]:
    globs = [g.strip() for g in include.split(",") if g.strip()]
    if not globs:
        raise UserError(f"--include {include!r}: no patterns")
    return globs


def list_files(paths: Sequence[str | os.PathLike], include: str = DEFAULT_INCLUDE) -> list[Path]:
    """Inputs in the order given: files as they are, directories walked in sorted order and
    filtered by `include`; a file reached twice is read once."""
    globs = parse_include(include)
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            if not os.access(p, os.R_OK | os.X_OK):
                raise UserError(f"{p}: directory is not readable")
            found = []
            for root, dirs, names in os.walk(p, onerror=_walk_error):
                dirs.sort()
                for name in names:
                    if any(fnmatch.fnmatch(name, g) for g in globs):
                        found.append(Path(root) / name)
            files.extend(sorted(found, key=lambda f: f.relative_to(p).parts))
        elif p.exists():
            raise UserError(f"{p}: not a regular file or directory")
        else:
            raise UserError(f"{p}: no such file or directory")
    seen: set[Path] = set()
    files = [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]
    if not files:
        raise UserError(f"no input files in {' '.join(map(str, paths))} "
                        f"(matching --include {','.join(globs)})")
    return files


def _walk_error(e: OSError) -> None:
    raise UserError(f"{e.filename}: cannot read directory ({e.strerror})")


def is_jsonl(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".jsonl.gz"))


class Corpus:
    """Streams the documents of some input files as pieces of text, counting what it reads."""

    def __init__(self, paths: Sequence[str | os.PathLike], include: str = DEFAULT_INCLUDE,
                 text_key: str = "text", strict: bool = False, piece_chars: int = PIECE_CHARS):
        self.files = list_files(paths, include)
        self.text_key = text_key
        self.strict = strict
        self.piece_chars = piece_chars
        self.stats = CorpusStats()
        self.input_bytes = 0
        for f in self.files:
            try:
                self.input_bytes += f.stat().st_size
            except OSError as e:
                raise UserError(f"{f}: cannot read ({e.strerror})") from None

    @property
    def _errors(self) -> str:
        return "strict" if self.strict else "dspretrain.count"

    def pieces(self) -> Iterator[tuple[str, bool]]:
        """(text, is_last_piece_of_its_document), documents in order; empty ones skipped."""
        for path in self.files:
            self.stats.files += 1
            try:
                if is_jsonl(path):
                    yield from self._jsonl_pieces(path)
                else:
                    yield from self._text_pieces(path)
            except PermissionError as e:
                raise UserError(f"{path}: cannot read ({e.strerror})") from None
            except (gzip.BadGzipFile, EOFError, zlib.error) as e:
                raise UserError(f"{path}: corrupt gzip file ({e})") from None
            except OSError as e:
                raise UserError(f"{path}: cannot read ({e.strerror or e})") from None

    def batches(self, batch_chars: int) -> Iterator[tuple[list[str], list[bool], int]]:
        """(pieces, is-last flags, corpus bytes read so far) in batches of ~`batch_chars`
        characters: what a tokenizer takes per call."""
        texts: list[str] = []
        lasts: list[bool] = []
        chars = 0
        for text, last in self.pieces():
            texts.append(text)
            lasts.append(last)
            chars += len(text)
            if chars >= batch_chars:
                yield texts, lasts, self.stats.bytes
                texts, lasts, chars = [], [], 0
        if texts:
            yield texts, lasts, self.stats.bytes

    def _decode(self, decode, *args) -> str:
        token = _decoding.set(self.stats)  # the error handler counts into this corpus
        try:
            return decode(*args)
        finally:
            _decoding.reset(token)

    def _text_pieces(self, path: Path) -> Iterator[tuple[str, bool]]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors=self._errors)
        buf = ""
        offset = 0
        emitted = False
        with open(path, "rb") as f:
            while True:
                raw = f.read(_READ_BYTES)
                self._account(raw)
                try:
                    buf += self._decode(decoder.decode, raw, not raw)
                except UnicodeDecodeError as e:
                    raise UserError(f"{path}: invalid UTF-8 at byte {offset + e.start} "
                                    f"(drop --strict to replace and count it)") from None
                offset += len(raw)
                while len(buf) > self.piece_chars:
                    cut = _cut_point(buf, self.piece_chars)
                    yield buf[:cut], False
                    emitted = True
                    buf = buf[cut:]
                if not raw:
                    break
        if buf or emitted:
            self.stats.documents += 1
            yield buf, True

    def _jsonl_pieces(self, path: Path) -> Iterator[tuple[str, bool]]:
        opener = gzip.open if path.name.endswith(".gz") else open
        key = self.text_key
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                self._account(raw)
                try:
                    line = self._decode(raw.decode, "utf-8", self._errors)
                except UnicodeDecodeError as e:
                    raise UserError(f"{path}:{lineno}: invalid UTF-8 at column {e.start + 1} "
                                    f"(drop --strict to replace and count it)") from None
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}:{lineno}: malformed JSON line ({e.msg} at column "
                                    f"{e.colno})") from None
                if not isinstance(obj, dict):
                    raise UserError(f"{path}:{lineno}: expected a JSON object, got "
                                    f"{type(obj).__name__}")
                if key not in obj:
                    raise UserError(f"{path}:{lineno}: no key '{key}' (set --text-key)")
                text = obj[key]
                if not isinstance(text, str):
                    raise UserError(f"{path}:{lineno}: key '{key}' is {type(text).__name__}, "
                                    f"not a string")
                if not text.isascii():
                    text = self._fix_surrogates(text, path, lineno)
                if not text:
                    continue
                self.stats.documents += 1
                while len(text) > self.piece_chars:
                    cut = _cut_point(text, self.piece_chars)
                    yield text[:cut], False
                    text = text[cut:]
                yield text, True

    def _fix_surrogates(self, text: str, path: Path, lineno: int) -> str:
        """JSON escapes can encode lone surrogates ("\\ud800"), which are not valid UTF-8."""
        try:
            text.encode("utf-8")
            return text
        except UnicodeEncodeError:
            if self.strict:
                raise UserError(f"{path}:{lineno}: key '{self.text_key}' holds a lone surrogate "
                                f"(invalid Unicode; drop --strict to replace it)") from None
            fixed, n = _SURROGATE.subn("\ufffd", text)
            self.stats.replaced_chars += n
            return fixed

    def _account(self, raw: bytes) -> None:
        self.stats.bytes += len(raw)
        self.stats.hasher.update(raw)


def _cut_point(text: str, limit: int) -> int:
    """Where to end a piece of at most `limit` chars: the last safe cut (see the module doc)."""
    window = text[limit // 2:limit]
    best = -1
    for m in _GOOD_CUT.finditer(window):
        best = m.end()
    if best < 0:
        nl = window.rfind("\n")
        best = nl + 1 if nl >= 0 else len(window)
    return limit // 2 + best
