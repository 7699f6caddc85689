"""The manifest of a checkpoint tag: every file with its size and xxh3_64 checksum, written last.

A tag is complete when its manifest is there and every file it lists has its size and checksum;
what is missing says what went wrong: no manifest (while train_state.json says one was due) is
an interrupted save, a missing or different file is a damaged tag, and the file is named. Tags
made before manifests existed have none and no `manifest` entry in train_state.json: they are
"unverified" (checked for structure only, as before).

Who hashes what: each rank hashes the files it wrote (rank r: rng_rank{r}.pt and DeepSpeed's
*_pp_rank_{r}_* partitions; rank 0 also every file without a rank), right after its own save;
the entries are gathered to rank 0, which writes manifest.json once every rank's files are on
disk. On several nodes a rank cannot see another node's local disk, so no rank hashes a file it
did not write. Hashing files just written reads them from the page cache (bench: docs). A tag's
files are hashed several at once (`checksums`): xxhash lets go of the GIL, so each file gets a
core of its own where there are cores to spare, and the digests are those of one at a time.
"""
from __future__ import annotations

import mmap
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash

from data_tools import output
from data_tools.errors import UserError
from data_tools.schema import NonNegativeInt, Schema, read_json

NAME = "manifest.json"
# The save's own mark, written first (rank 0) and removed once the manifest is written: a tag
# with it and no manifest is a save this app began and did not finish, the only tag ever deleted
SAVING = ".saving"
# in a tag or an export, not of it: never listed (an export's marker is written after it)
BOOKKEEPING = (NAME, SAVING, output.MARKER)
ALGORITHM = "xxh3_64"
HASH_THREADS = min(8, len(os.sched_getaffinity(0)))
# rng_rank{R}.pt and outer_rank{R}.pt are ours; DeepSpeed's ZeRO partitions are
# (bf16_)zero_pp_rank_{R}_mp_rank_..
RANK_RE = re.compile(r"^(?:rng|outer)_rank(\d+)\.pt$|(?:^|_)pp_rank_(\d+)_")
ISLAND_RE = re.compile(r"^island(\d+)$")  # a low-communication run's island K (store.ISLAND_DIR)


class Entry(Schema):
    size: NonNegativeInt
    xxh3_64: str


class ManifestFile(Schema):
    """TAG/manifest.json."""

    algorithm: str
    files: dict[str, Entry]


def checksum(path: Path) -> str:
    """xxh3_64 of the file's bytes, mapped rather than read (3-4x faster: no copy out of the
    page cache)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_64(b"").hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return xxhash.xxh3_64(m).hexdigest()


def checksums(paths: list[Path]) -> list[str]:
    """`checksum` of each file, in order, up to HASH_THREADS files at a time."""
    threads = min(len(paths), HASH_THREADS)
    if threads < 2:
        return [checksum(p) for p in paths]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(checksum, paths))


def writer_of(name: str, island: tuple[int, int] | None = None) -> int:
    """The rank that writes file `name` of a tag (0 for every file without a rank). `name` may
    be a path in the tag; under an island's directory (`islandK/`, a low-communication run with
    `island` = (this rank's island, ranks an island)) DeepSpeed's rank numbers are the island's:
    island K's rank r is K x size + r."""
    parts = Path(name).parts
    m = RANK_RE.search(parts[-1])
    own = int(m.group(1) or m.group(2)) if m else 0
    isle = ISLAND_RE.match(parts[0]) if len(parts) > 1 else None
    if isle is None or island is None:
        return own
    return int(isle.group(1)) * island[1] + own


def own_entries(tag_dir: Path, rank: int,
                island: tuple[int, int] | None = None) -> dict[str, dict[str, Any]]:
    """This rank's files in `tag_dir`, hashed (call after this rank's save returned).
    `island`: (this rank's island, ranks an island) in a low-communication run."""
    files = sorted(p for p in tag_dir.rglob("*")
                   if p.is_file() and p.name not in BOOKKEEPING
                   and writer_of(str(p.relative_to(tag_dir)), island) == rank)
    return {str(p.relative_to(tag_dir)): {"size": p.stat().st_size, ALGORITHM: digest}
            for p, digest in zip(files, checksums(files))}


def gather_entries(entries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every rank's entries, merged (a collective where there are several ranks)."""
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return entries
    every: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, entries)
    return {k: v for part in every for k, v in part.items()}


def write(tag_dir: Path, entries: dict[str, dict[str, Any]]) -> None:
    """The manifest, atomically (main rank, after every rank's files are on disk)."""
    output.write_json_atomic(tag_dir / NAME, {"algorithm": ALGORITHM,
                                              "files": dict(sorted(entries.items()))})


_verified: dict[tuple, bool] = {}


def verify(tag_dir: Path) -> bool:
    """True when the tag's files match its manifest, False when it has none (a tag made before
    manifests); UserError naming the first file that is missing, of another size or corrupt,
    or not listed: a manifest verifies only when it covers every file of the tag (an empty or
    partial one verifies nothing)."""
    path = tag_dir / NAME
    if not path.is_file():
        return False
    manifest = read_json(path, ManifestFile)
    if manifest["algorithm"] != ALGORITHM:
        raise UserError(f"{path}: algorithm {manifest['algorithm']!r}, expected {ALGORITHM}")
    if not manifest["files"]:
        raise UserError(f"{path}: lists no files: an empty manifest verifies nothing")
    unlisted = sorted(str(p.relative_to(tag_dir)) for p in tag_dir.rglob("*")
                      if p.is_file() and p.name not in BOOKKEEPING
                      and str(p.relative_to(tag_dir)) not in manifest["files"])
    if unlisted:
        raise UserError(f"{tag_dir / unlisted[0]}: not listed in {NAME}: a partial manifest "
                        f"verifies nothing")
    todo = {}  # file -> its key in _verified: present, of its size, not read yet
    for name, entry in manifest["files"].items():
        f = tag_dir / name
        if not f.is_file():
            what = "not a regular file" if os.path.lexists(f) else "missing"
            raise UserError(f"{f}: {what} (listed in {NAME}): the checkpoint is incomplete")
        stat = f.stat()
        if stat.st_size != entry["size"]:
            raise UserError(f"{f}: {stat.st_size} bytes, {entry['size']} when saved: the file "
                            f"is truncated or replaced")
        key = (str(f), stat.st_size, stat.st_mtime_ns, entry[ALGORITHM])
        if key not in _verified:  # read once per process (settle, then load)
            todo[f] = key
    for (f, key), digest in zip(todo.items(), checksums(list(todo))):
        if digest != key[3]:
            raise UserError(f"{f}: checksum {ALGORITHM} differs from {NAME}'s: the file is "
                            f"corrupt (changed after the save)")
        _verified[key] = True
    return True
