"""Reading a user's corpus: which files, in what order, and the documents inside them.

Directories are walked recursively in sorted order, so the document order, and with it the
dataset, is deterministic. A directory that Hugging Face `datasets.save_to_disk` wrote (its
`state.json` lists `_data_files`) is read as that dataset: its arrow files in the listed order,
nothing else (not the `cache-*.arrow` files a `.map()` leaves beside them). A `DatasetDict`
directory is refused with its split names: one split is what a corpus means. What is in each
file, per format, is formats.py's job.

Documents come out as *pieces* of at most about `PIECE_CHARS` characters, so that neither a huge
`.txt` file nor a huge JSON line is ever tokenized in one call (which would hold every token's
offsets in memory). Where possible a piece ends just before a space that precedes a non-space, or
after a newline between two non-spaces: WordPiece ignores whitespace, and GPT-2's byte-level
pre-tokenizer always splits there too (" word" starts a pre-token), so the ids equal those of the
whole document. Text with neither (no spaces for ~PIECE_CHARS/2) is cut at a newline, else anywhere.

Empty documents (an empty file, `""` under the key) are counted and yield nothing. Each
document's last piece carries its `Position`: where the input stands after it, and the counts so
far, so that a resumed prepare starts reading right after it (`pieces(start=...)`).
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import xxhash

from data_tools.errors import UserError
from data_tools.formats import FileRead, cut_point, records
from data_tools.schema import read_json

DEFAULT_INCLUDE = ("*.txt,*.jsonl,*.jsonl.gz,*.jsonl.zst,*.json.gz,*.json.zst,*.parquet,"
                   "*.arrow")
PIECE_CHARS = 1 << 20
HF_STATE = "state.json"
HF_DICT = "dataset_dict.json"


def _link(chain: str, file_digest: str) -> str:
    """The source fingerprint grows one file at a time: a hash of (chain so far, file digest),
    so a resume can carry it across the files it does not read again."""
    return xxhash.xxh3_128((chain + file_digest).encode()).hexdigest()


@dataclass
class CorpusStats:
    """What was read: the numbers that go into the summary and dataset.json."""

    files: int = 0
    bytes: int = 0
    documents: int = 0
    empty_documents: int = 0
    replaced_chars: int = 0
    chain: str = ""

    @property
    def fingerprint(self) -> str:
        return f"xxh3_128:{self.chain}"


@dataclass(frozen=True)
class Position:
    """Where the input stands after a document: file `file` read up to record `record` (a line,
    a row; 1 for a text file), and the counts up to there (`chain`: the fingerprint of the files
    before `file`)."""

    file: int
    record: int
    bytes: int
    documents: int
    empty_documents: int
    replaced_chars: int
    chain: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


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
            files.extend(_walk(p, globs))
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


def _walk(d: Path, globs: list[str]) -> list[Path]:
    """The matching files under `d`, names in sorted order, subdirectories where they sort
    (symbolic links to directories are not followed)."""
    hf = hf_data_files(d)
    if hf is not None:
        return [f for f in hf if any(fnmatch.fnmatch(f.name, g) for g in globs)]
    try:
        entries = sorted(os.scandir(d), key=lambda e: e.name)
    except OSError as e:
        raise UserError(f"{d}: cannot read directory ({e.strerror})") from None
    found: list[Path] = []
    for e in entries:
        if e.is_dir():
            if not e.is_symlink():
                found.extend(_walk(Path(e.path), globs))
        elif any(fnmatch.fnmatch(e.name, g) for g in globs):
            found.append(Path(e.path))
    return found


def hf_data_files(d: Path) -> list[Path] | None:
    """The arrow files of a `datasets.save_to_disk` directory, in order (None: not one)."""
    if (d / HF_DICT).is_file():
        info = read_json(d / HF_DICT)
        splits = info.get("splits") if isinstance(info, dict) else None
        splits = [str(s) for s in splits] if isinstance(splits, list) and splits else ["train"]
        raise UserError(f"{d}: a Hugging Face DatasetDict (splits: {', '.join(splits)}); pass "
                        f"one split's directory, e.g. {d / splits[0]}")
    if not (d / HF_STATE).is_file():
        return None
    state = read_json(d / HF_STATE)
    listed = state.get("_data_files") if isinstance(state, dict) else None
    if listed is None:
        return None  # some other state.json: an ordinary directory
    where = d / HF_STATE
    if not isinstance(listed, list) or not all(
            isinstance(f, dict) and isinstance(f.get("filename"), str) for f in listed):
        raise UserError(f"{where}: key '_data_files' is not a list of {{\"filename\": ...}}")
    files = []
    for entry in listed:
        name = entry["filename"]
        if "/" in name or name in ("", ".", ".."):
            raise UserError(f"{where}: key '_data_files' names {name!r}, not a file name")
        if not (d / name).is_file():
            raise UserError(f"{where}: lists {name}, which is missing")
        files.append(d / name)
    return files


class Corpus:
    """Streams the documents of some input files as pieces of text, counting what it reads."""

    def __init__(self, paths: Sequence[str | os.PathLike], include: str = DEFAULT_INCLUDE,
                 text_key: str = "text", strict: bool = False, piece_chars: int = PIECE_CHARS):
        self.files = list_files(paths, include)
        self.text_key = text_key
        self.strict = strict
        self.piece_chars = piece_chars
        self.stats = CorpusStats()
        self.stat_results: list[os.stat_result] = []
        for f in self.files:
            try:
                self.stat_results.append(f.stat())
            except OSError as e:
                raise UserError(f"{f}: cannot read ({e.strerror})") from None
        self.input_bytes = sum(s.st_size for s in self.stat_results)
        self._done_bytes = 0  # file bytes of the files finished (progress)
        self._read: FileRead | None = None

    @property
    def progress(self) -> int:
        """Bytes of the input files consumed so far (compressed, as on disk)."""
        return self._done_bytes + (self._read.pos if self._read is not None else 0)

    def pieces(self, start: Position | None = None) -> Iterator[tuple[str, bool, Position | None]]:
        """(text, is_last_piece_of_its_document, position after it if last), documents in order,
        from the start or right after `start`."""
        first = 0
        if start is not None:
            first = start.file
            self.stats = CorpusStats(files=first, bytes=start.bytes, documents=start.documents,
                                     empty_documents=start.empty_documents,
                                     replaced_chars=start.replaced_chars, chain=start.chain)
            self._done_bytes = sum(s.st_size for s in self.stat_results[:first])
        for index in range(first, len(self.files)):
            skip = start.record if start is not None and index == start.file else 0
            yield from self._file_pieces(index, skip)

    def _file_pieces(self, index: int, skip: int) -> Iterator[tuple[str, bool, Position | None]]:
        path, stats = self.files[index], self.stats
        stats.files += 1
        read = self._read = FileRead(path, self.text_key, self.strict, self.piece_chars, skip)
        base_bytes, base_replaced = stats.bytes, stats.replaced_chars
        started = False
        try:
            for text, last, record in records(read):
                if not last:
                    started = True
                    yield text, False, None
                    continue
                stats.bytes, stats.replaced_chars = base_bytes + read.bytes, \
                    base_replaced + read.replaced
                if not started and (not text or text.isspace()):
                    # nothing but whitespace is an empty document too: kept, it would be a lone
                    # end-of-document token, a sample with nothing to learn
                    stats.empty_documents += 1
                    continue
                started = False
                stats.documents += 1
                pos = Position(index, record, stats.bytes, stats.documents,
                               stats.empty_documents, stats.replaced_chars, stats.chain)
                while len(text) > self.piece_chars:
                    cut = cut_point(text, self.piece_chars)
                    yield text[:cut], False, None
                    text = text[cut:]
                yield text, True, pos
        except PermissionError as e:
            raise UserError(f"{path}: cannot read ({e.strerror})") from None
        except OSError as e:
            raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
        stats.bytes, stats.replaced_chars = base_bytes + read.bytes, base_replaced + read.replaced
        stats.chain = _link(stats.chain, read.hasher.hexdigest())
        self._done_bytes += self.stat_results[index].st_size
        self._read = None

    def batches(self, batch_chars: int, start: Position | None = None) -> Iterator[Batch]:
        """Pieces in batches of ~`batch_chars` characters (what a tokenizer takes per call),
        with the input bytes consumed so far (for a progress bar)."""
        batch = Batch()
        chars = 0
        for text, last, pos in self.pieces(start):
            batch.texts.append(text)
            batch.lasts.append(last)
            batch.positions.append(pos)
            chars += len(text)
            if chars >= batch_chars:
                batch.progress = self.progress
                yield batch
                batch, chars = Batch(), 0
        if batch.texts:
            batch.progress = self.progress
            yield batch


@dataclass
class Batch:
    """Pieces for one tokenizer call: texts, is-last flags, and each last piece's Position."""

    texts: list[str] = field(default_factory=list)
    lasts: list[bool] = field(default_factory=list)
    positions: list[Position | None] = field(default_factory=list)
    progress: int = 0
