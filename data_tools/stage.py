"""`python -m data_tools stage`: copy a dataset to node-local disk, verified, resumable, once.

Why: hundreds of nodes reading shards from Lustre/NFS for a whole run contend for it (the paper's
second lesson). A half-copied or silently corrupted shard costs a day of compute, so:

- Every byte is read once from the source and hashed as it streams through (the hash of the
  buffer that is written), then compared with the checksum in the source `dataset.json`.
- Files are written as `.NAME.partial`, fsynced, then renamed. An interrupted copy resumes from the
  partial's length (the part already there is re-hashed); if the result does not verify, that file
  is copied once more from the start before the source is blamed.
- `dst/dataset.json` (a byte copy of the source's) is written last: its presence means complete.
- Speed: files are copied in parallel (`workers` threads), in 8 MiB reads, with whole blocks
  written O_DIRECT (no page-cache copy; see `_Sink` and docs/benchmarks.md).
- `dst/.stage.lock` (an OS file lock) lets every local rank call this at once: one copies, the
  others wait, then find the complete copy.
- `dst/.stage-state.json` records (bytes, mtime_ns, checksum) of each file verified, so a second
  run on a complete destination only stats the files (`verify_existing` re-hashes them instead).
  A destination file with no record (copied by other means) is hashed and kept if it matches.
"""
from __future__ import annotations

import argparse
import errno
import fcntl
import json
import mmap
import os
import shutil
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator

from filelock import FileLock, Timeout
from tqdm import tqdm

from data_tools import output
from data_tools.cli import config_flags
from data_tools.errors import UserError
from data_tools.manifest import (
    MANIFEST,
    TOKENIZER_DIR,
    dataset_files,
    file_checksum,
    format_digest,
    load_manifest,
    new_hasher,
    read_chunks,
)

LOCK_NAME = ".stage.lock"
STATE_NAME = ".stage-state.json"
PARTIAL_SUFFIX = ".partial"
DEFAULT_WORKERS = 4  # I/O-bound threads: more streams help network filesystems; 4 was best here
BUFFER_BYTES = 8 << 20  # large sequential reads/writes; one buffer per worker thread
BLOCK_BYTES = 4096  # O_DIRECT alignment of buffer, offset and length; resume offsets round down
SPACE_MARGIN_BYTES = 1 << 20  # the manifest, the state file and block rounding
_STATE_SAVE_SECONDS = 2.0  # rewrite the state file at most this often while copying


@dataclass
class StageConfig:
    """`python -m data_tools stage` settings (and `stage()`'s). Fields are the flags."""

    src: Path
    """Dataset directory to copy."""
    dst: Path
    """Node-local destination directory."""
    workers: int = DEFAULT_WORKERS
    """Files copied in parallel."""
    overwrite: bool = False
    """Replace another dataset found at --dst (only the files it names)."""
    verify_existing: bool = False
    """Re-hash files already at --dst instead of trusting the state file."""
    progress: bool = True
    """Show a progress bar (--quiet turns it off)."""

    def __post_init__(self) -> None:
        self.src, self.dst = Path(self.src), Path(self.dst)
        if self.workers < 1:
            raise UserError(f"--workers must be at least 1, not {self.workers}")


@dataclass(frozen=True)
class FileSpec:
    """One file to stage: path relative to the dataset directory, size and expected checksum."""

    rel: str
    size: int
    checksum: str


@dataclass
class StageStats:
    """What a stage did; `copied_bytes == 0` means the destination was already complete."""

    files: int = 0
    total_bytes: int = 0
    copied_files: int = 0
    copied_bytes: int = 0
    rehashed_files: int = 0
    reused_files: int = 0
    waited_for_lock: bool = False
    seconds: float = 0.0

    def summary(self, dst: Path) -> str:
        rate = self.copied_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0
        return (f"staged {dst}: {self.files} files, {self.total_bytes / 1e6:.1f} MB; "
                f"copied {self.copied_files} files ({self.copied_bytes} bytes, {rate:.0f} MB/s), "
                f"re-hashed {self.rehashed_files}, already verified {self.reused_files}; "
                f"{self.seconds:.2f} s")


class _Cancelled(Exception):
    """Another worker failed or the user interrupted: stop, keeping the partial for a resume."""


# ----------------------------------------------------------------------------- what to copy

def _fingerprint(manifest: dict[str, Any]) -> str:
    """The dataset's identity; manifests without one (foreign) are identified by their splits."""
    if manifest.get("fingerprint"):
        return str(manifest["fingerprint"])
    h = new_hasher()
    h.update(json.dumps([manifest["splits"], manifest["tokenizer"]], sort_keys=True).encode())
    return format_digest(h)


def _safe_rel(rel: str, where: Path) -> str:
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise UserError(f"{where}: file name {rel!r} is not inside the dataset directory")
    return str(p)


def plan_files(src: Path, manifest: dict[str, Any]) -> list[FileSpec]:
    """Shards and tokenizer files to copy, from the manifest.

    A manifest without a tokenizer file list (older or foreign) gets the tokenizer directory as it
    is: its files are hashed here (they are small), and tokenizer.json must match the fingerprint.
    """
    where = src / MANIFEST
    tok = manifest["tokenizer"]
    if not isinstance(tok, dict):
        raise UserError(f"{where}: key 'tokenizer' is not an object")
    try:
        specs = [FileSpec(_safe_rel(rel, where), int(size), str(checksum))
                 for rel, size, checksum in dataset_files(manifest)]
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{where}: malformed shard or tokenizer file entry ({e!r})") from None
    if not tok.get("files"):
        tok_dir = src / _safe_rel(tok.get("dir", TOKENIZER_DIR), where)
        if not tok_dir.is_dir():
            raise UserError(f"{tok_dir}: tokenizer directory named in {where} is missing")
        for path in sorted(p for p in tok_dir.rglob("*") if p.is_file()):
            checksum = file_checksum(path)
            fingerprint = str(tok.get("fingerprint") or "")
            same_algorithm = fingerprint.split(":")[0] == checksum.split(":")[0]
            if path.name == "tokenizer.json" and same_algorithm and fingerprint != checksum:
                raise UserError(f"{path}: checksum {checksum} does not match the tokenizer "
                                f"fingerprint {tok['fingerprint']} in {where}")
            specs.append(FileSpec(path.relative_to(src).as_posix(), path.stat().st_size, checksum))
    seen: set[str] = set()
    for spec in specs:
        if spec.rel in seen:  # two workers would write the same partial file
            raise UserError(f"{where}: lists {spec.rel} twice")
        seen.add(spec.rel)
    return specs


def check_source_sizes(src: Path, specs: list[FileSpec]) -> None:
    """Refuse a missing or truncated source file before anything is copied."""
    for spec in specs:
        path = src / spec.rel
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise UserError(f"{path}: missing (listed in {src / MANIFEST})") from None
        if size != spec.size:
            raise UserError(f"{path}: {size} bytes, but {src / MANIFEST} records {spec.size} "
                            "(truncated or modified source)")


def check_free_space(dst: Path, needed_bytes: int, free_bytes: int | None = None) -> None:
    """Refuse to start a copy that cannot fit, before a byte is written."""
    if free_bytes is None:
        free_bytes = shutil.disk_usage(dst).free
    if needed_bytes + SPACE_MARGIN_BYTES > free_bytes:
        raise UserError(f"{dst}: not enough free space: the copy needs {needed_bytes / 1e6:.1f} MB "
                        f"(+{SPACE_MARGIN_BYTES / 1e6:.1f} MB margin), the disk has "
                        f"{free_bytes / 1e6:.1f} MB free")


def partial_path(path: Path) -> Path:
    """Hidden temporary name: a glob for *.bin never sees a half-copied shard."""
    return path.with_name(f".{path.name}{PARTIAL_SUFFIX}")


# ----------------------------------------------------------------------------- state file

class _State:
    """dst/.stage-state.json: files verified earlier, so a re-run does not re-hash them."""

    def __init__(self, dst: Path, fingerprint: str):
        self.path = dst / STATE_NAME
        self.fingerprint = fingerprint
        self.files: dict[str, dict[str, Any]] = {}
        self.foreign_files: list[str] = []
        self._lock = threading.Lock()
        self._saved_at = 0.0

    def load(self) -> str | None:
        """Read the records; return the fingerprint they belong to (None: no usable state).
        Records of another dataset (a partial stage of it) are kept in `foreign_files`."""
        self.files, self.foreign_files = {}, []
        try:
            data = json.loads(self.path.read_text())
            fingerprint, files = str(data["fingerprint"]), dict(data["files"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # missing or damaged: files are re-hashed instead, nothing is lost
        if fingerprint == self.fingerprint:
            self.files = files
        else:
            self.foreign_files = list(files)
        return fingerprint

    def valid(self, dst: Path, spec: FileSpec) -> bool:
        rec = self.files.get(spec.rel)
        if not rec or rec.get("checksum") != spec.checksum or rec.get("bytes") != spec.size:
            return False
        try:
            st = (dst / spec.rel).stat()
        except OSError:
            return False
        return st.st_size == spec.size and st.st_mtime_ns == rec.get("mtime_ns")

    def record(self, dst: Path, spec: FileSpec) -> None:
        st = (dst / spec.rel).stat()
        with self._lock:
            self.files[spec.rel] = {"bytes": spec.size, "mtime_ns": st.st_mtime_ns,
                                    "checksum": spec.checksum}
            if time.monotonic() - self._saved_at > _STATE_SAVE_SECONDS:
                self._save_locked(fsync=False)

    def save(self) -> None:
        with self._lock:
            self._save_locked(fsync=True)

    def _save_locked(self, fsync: bool) -> None:
        data = json.dumps({"fingerprint": self.fingerprint, "files": self.files}).encode()
        output.write_bytes_atomic(self.path, data, fsync=fsync)
        self._saved_at = time.monotonic()


# ----------------------------------------------------------------------------- copying

class _Sink:
    """The partial file being written. Whole blocks go with O_DIRECT where the filesystem takes
    it: no copy into the page cache and the disk writes as we go, which on a busy 2-CPU box
    doubled staging throughput (bench/bench_stage.py). tmpfs and some others refuse O_DIRECT:
    plain writes there, and for the unaligned tail of a file."""

    def __init__(self, path: Path, offset: int):
        flags = os.O_WRONLY | os.O_CREAT | (0 if offset else os.O_TRUNC)
        self.direct = getattr(os, "O_DIRECT", 0)
        try:
            self.fd = os.open(path, flags | self.direct, 0o644)
        except OSError as e:
            if not self.direct or e.errno != errno.EINVAL:
                raise
            self.direct = 0
            self.fd = os.open(path, flags, 0o644)
        os.ftruncate(self.fd, offset)
        os.lseek(self.fd, offset, os.SEEK_SET)

    def write(self, view: memoryview) -> None:
        aligned = len(view) - len(view) % BLOCK_BYTES if self.direct else 0
        if aligned:
            try:
                self._write_all(view[:aligned])
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._plain()  # refused at the first block (nothing written): plain writes
                self._write_all(view[:aligned])
            view = view[aligned:]
        if len(view):
            self._plain()
            self._write_all(view)

    def _write_all(self, view: memoryview) -> None:
        while len(view):
            view = view[os.write(self.fd, view):]

    def _plain(self) -> None:
        if self.direct:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~self.direct)
            self.direct = 0

    def close(self, fsync: bool) -> None:
        try:
            if fsync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)


class _Copier:
    """Copies or re-hashes one file at a time; many run in a thread pool (I/O and xxhash release
    the GIL)."""

    def __init__(self, src: Path, dst: Path, state: _State, bar: tqdm, stop: threading.Event):
        self.src, self.dst, self.state, self.bar, self.stop = src, dst, state, bar, stop
        self._local = threading.local()
        self._lock = threading.Lock()
        self.copied_files = self.copied_bytes = self.rehashed_files = 0

    def _buffer(self) -> memoryview:
        """Page-aligned (anonymous mmap), as O_DIRECT needs."""
        if not hasattr(self._local, "buf"):
            self._local.buf = memoryview(mmap.mmap(-1, BUFFER_BYTES))
        return self._local.buf

    def _chunks(self, f, nbytes: int) -> Iterator[memoryview]:
        """Up to `nbytes` of `f` from its position, in whole buffers (only the last chunk of a
        file may be short, so the O_DIRECT writes stay block-aligned); stops when cancelled."""
        for chunk in read_chunks(f, self._buffer(), nbytes):
            if self.stop.is_set():
                raise _Cancelled()
            yield chunk
            self.bar.update(len(chunk))

    def _hash_file(self, f, h, nbytes: int) -> int:
        """Hash up to `nbytes` from `f`'s current position; return how many there were."""
        done = 0
        for chunk in self._chunks(f, nbytes):
            h.update(chunk)
            done += len(chunk)
        return done

    def stage(self, spec: FileSpec) -> None:
        """Make dst/spec.rel a verified copy: keep a matching existing file, else copy."""
        target = self.dst / spec.rel
        if target.is_file() and target.stat().st_size == spec.size:
            h = new_hasher()
            with open(target, "rb", buffering=0) as f:
                self._hash_file(f, h, spec.size)
            if format_digest(h) == spec.checksum:
                self.state.record(self.dst, spec)
                with self._lock:
                    self.rehashed_files += 1
                return
            target.unlink()  # not valid: copied afresh (free-space check counted it as in place)
            self.bar.total += spec.size
        target.parent.mkdir(parents=True, exist_ok=True)
        self._copy(spec, target, resume=True)

    def _copy(self, spec: FileSpec, target: Path, resume: bool) -> None:
        source, part = self.src / spec.rel, partial_path(target)
        h, offset = new_hasher(), 0
        if resume and part.is_file() and part.stat().st_size <= spec.size:
            with open(part, "rb", buffering=0) as f:  # re-hash what an earlier run wrote
                keep = part.stat().st_size // BLOCK_BYTES * BLOCK_BYTES
                offset = self._hash_file(f, h, keep)
        with open(source, "rb", buffering=0) as fin:
            if hasattr(os, "posix_fadvise"):  # Linux: larger read-ahead on the shared FS
                os.posix_fadvise(fin.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            fin.seek(offset)
            sink, ok = _Sink(part, offset), False
            try:
                done = offset
                for chunk in self._chunks(fin, spec.size - offset):
                    h.update(chunk)  # hash the very buffer that is written
                    sink.write(chunk)
                    done += len(chunk)
                if done < spec.size:
                    raise UserError(f"{source}: ended at byte {done} of {spec.size} while "
                                    "copying (truncated or modified source)")
                ok = True
            finally:
                sink.close(fsync=ok)
        with self._lock:
            self.copied_bytes += spec.size - offset
        digest = format_digest(h)
        if digest != spec.checksum:
            if offset:  # the resumed part may be what is bad: start over before blaming the source
                self.bar.total += spec.size
                return self._copy(spec, target, resume=False)
            part.unlink(missing_ok=True)
            raise UserError(f"{source}: checksum {digest} does not match {spec.checksum} recorded "
                            f"in {self.src / MANIFEST} (corrupt source file)")
        os.replace(part, target)
        self.state.record(self.dst, spec)
        with self._lock:
            self.copied_files += 1


def _run_pool(copier: _Copier, specs: list[FileSpec], workers: int) -> None:
    """Stage `specs` on `workers` threads; on the first error or Ctrl-C stop the rest cleanly."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stage")
    try:
        futures = [pool.submit(copier.stage, s) for s in specs]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f.done() and f.exception()
                  and not isinstance(f.exception(), _Cancelled)]
        if failed:
            raise failed[0].exception()
    except BaseException:
        copier.stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------- the stage

def _prepare_dst(dst: Path) -> None:
    output.refuse_dangling(dst, "--dst")
    if dst.exists() and not dst.is_dir():
        raise UserError(f"{dst}: destination exists and is not a directory")
    try:
        dst.mkdir(parents=True, exist_ok=True)
        probe = dst / f".stage-probe.{os.getpid()}.{threading.get_ident()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise UserError(f"{dst}: destination is not writable ({e.strerror})") from None


def _check_dst_is_ours(dst: Path, specs: list[FileSpec]) -> None:
    """Refuse a non-empty destination that is neither a dataset nor a stage in progress: its
    files would be mixed with the dataset's (docs/design.md, "Outputs")."""
    if not dst.is_dir() or (dst / MANIFEST).exists() or (dst / STATE_NAME).exists():
        return
    expected = {LOCK_NAME} | {PurePosixPath(s.rel).parts[0] for s in specs}
    strangers = sorted(p.name for p in dst.iterdir()
                       if p.name not in expected and not p.name.startswith(".stage-probe.")
                       and not p.name.endswith((PARTIAL_SUFFIX, ".tmp")))
    if strangers:
        raise UserError(f"--dst {dst}: not empty and not a dataset (holds {strangers[0]}); "
                        f"choose an empty or new directory (nothing was changed)")


def _other_dataset(dst: Path, fingerprint: str, state: _State,
                   overwrite: bool) -> tuple[str, list[str]] | None:
    """(fingerprint, files) of another dataset at dst, complete or partly staged; None if none."""
    if (dst / MANIFEST).exists():
        try:
            old = load_manifest(dst)
        except UserError as e:
            if not overwrite:
                raise UserError(f"{e}; pass --overwrite to replace it") from None
            return "unreadable", []
        if _fingerprint(old) == fingerprint:
            return None
        names = [rel for rel, _, _ in dataset_files(old)]
        if not old["tokenizer"].get("files"):
            tok = dst / str(old["tokenizer"].get("dir", TOKENIZER_DIR))
            names += [p.relative_to(dst).as_posix() for p in tok.rglob("*") if p.is_file()]
        return _fingerprint(old), names
    recorded = state.load()
    if recorded not in (None, fingerprint):  # a partial stage of another dataset
        return recorded, state.foreign_files
    return None


class Stager:
    """One stage of the dataset at `src` into `dst`: plan (in the constructor), then under the
    destination's lock copy and commit, unless `dst` is complete already."""

    def __init__(self, cfg: StageConfig, on_wait: Callable[[], None] | None = None):
        self.cfg, self.on_wait = cfg, on_wait
        self.src, self.dst = cfg.src, cfg.dst
        # first, before dst is looked at: a bind mount of src is src (same device and inode)
        output.check_apart(self.dst, [("--src", self.src)], flag="--dst")
        manifest = load_manifest(self.src)
        self.manifest_bytes = (self.src / MANIFEST).read_bytes()
        if json.loads(self.manifest_bytes) != manifest:
            raise UserError(f"{self.src / MANIFEST}: changed while staging; run the stage again")
        self.fingerprint = _fingerprint(manifest)
        self.specs = sorted(plan_files(self.src, manifest), key=lambda s: -s.size)  # big first
        self.stats = StageStats(files=len(self.specs),
                                total_bytes=sum(s.size for s in self.specs))
        self.state = _State(self.dst, self.fingerprint)
        _check_dst_is_ours(self.dst, self.specs)

    def run(self) -> StageStats:
        started = time.monotonic()
        if not self.complete():  # reads only, so no lock: a complete dst may be read-only
            _prepare_dst(self.dst)
            lock = FileLock(str(self.dst / LOCK_NAME))
            try:
                lock.acquire(timeout=0)
            except Timeout:
                self.stats.waited_for_lock = True
                if self.on_wait:
                    self.on_wait()
                lock.acquire()  # released by the OS if its holder dies: a crash never blocks
            try:
                if not self.complete():  # another process may have finished while we waited
                    self.copy()
                    self.commit()
            finally:
                lock.release()
        self.stats.seconds = time.monotonic() - started
        return self.stats

    def complete(self) -> bool:
        """dst holds this dataset and every file was verified earlier (state records match)."""
        if self.cfg.verify_existing or not self.dst.is_dir() \
                or self.state.load() != self.fingerprint:
            return False
        try:
            dst_manifest = json.loads((self.dst / MANIFEST).read_text())
        except (OSError, ValueError):
            return False
        if not (isinstance(dst_manifest, dict) and _fingerprint(dst_manifest) == self.fingerprint
                and all(self.state.valid(self.dst, s) for s in self.specs)):
            return False
        self.stats.reused_files = len(self.specs)
        return True

    def copy(self) -> None:
        """Remove another dataset (--overwrite), then copy what is not verified yet."""
        dst = self.dst
        check_source_sizes(self.src, self.specs)  # before anything at dst is removed or written
        self._remove_other_dataset()
        if self.cfg.verify_existing:
            self.state.files = {}
        (dst / MANIFEST).unlink(missing_ok=True)  # incomplete or being verified: not done
        todo = [s for s in self.specs if not self.state.valid(dst, s)]
        self.stats.reused_files = len(self.specs) - len(todo)
        check_free_space(dst, self._bytes_to_write(todo) + len(self.manifest_bytes))
        with tqdm(total=sum(s.size for s in todo), desc=f"stage {dst.name or dst}", unit="B",
                  unit_scale=True, file=sys.stderr, disable=not self.cfg.progress or not todo,
                  mininterval=0.5, dynamic_ncols=True) as bar:
            copier = _Copier(self.src, dst, self.state, bar, threading.Event())
            try:
                _run_pool(copier, todo, min(self.cfg.workers, max(1, len(todo))))
            finally:
                self.stats.copied_files = copier.copied_files
                self.stats.copied_bytes = copier.copied_bytes
                self.stats.rehashed_files = copier.rehashed_files
                self.state.save()

    def _bytes_to_write(self, todo: list[FileSpec]) -> int:
        needed = 0
        for s in todo:
            target = self.dst / s.rel
            if target.is_file() and target.stat().st_size == s.size:
                continue  # re-hashed in place; replaced by a same-size copy if it does not match
            part = partial_path(target)
            have = part.stat().st_size if part.is_file() else 0
            needed += s.size - (have if have <= s.size else 0)
        return needed

    def _remove_other_dataset(self) -> None:
        """Refuse (or with --overwrite remove) another dataset at dst: only the files it names."""
        other = _other_dataset(self.dst, self.fingerprint, self.state, self.cfg.overwrite)
        if other is None:
            return
        fingerprint, names = other
        if not self.cfg.overwrite:
            raise UserError(f"{self.dst}: holds another dataset (fingerprint {fingerprint}, not "
                            f"{self.fingerprint}); pass --overwrite to replace it")
        (self.dst / MANIFEST).unlink(missing_ok=True)  # first: must not look complete meanwhile
        for rel in names:
            try:
                path = self.dst / _safe_rel(rel, self.dst / MANIFEST)
            except UserError:
                continue
            path.unlink(missing_ok=True)
            partial_path(path).unlink(missing_ok=True)
        self.state.path.unlink(missing_ok=True)
        self.state.files, self.state.foreign_files = {}, []

    def commit(self) -> None:
        """Make the copy durable, then write dataset.json: from now on dst is complete."""
        for directory in sorted({(self.dst / s.rel).parent for s in self.specs}):
            output.fsync_dir(directory)
        output.write_bytes_atomic(self.dst / MANIFEST, self.manifest_bytes)


def stage(src: Path, dst: Path, *, workers: int | None = None, overwrite: bool = False,
          progress: bool = True, verify_existing: bool = False,
          on_wait: Callable[[], None] | None = None) -> StageStats:
    """Copy and verify the dataset at `src` into `dst` (idempotent, resumable, lock-protected:
    every local rank may call it at once); returns what it did."""
    cfg = StageConfig(src, dst, DEFAULT_WORKERS if workers is None else workers, overwrite,
                      verify_existing, progress)
    try:
        return Stager(cfg, on_wait).run()
    except OSError as e:  # e.g. a read-only subdirectory, or a disk filled by someone else
        raise UserError(f"{e.filename or dst}: {e.strerror or e} (while staging into {dst}; "
                        f"partial files are kept for the next run)") from None


# ----------------------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = config_flags(parser, StageConfig)
    add("src", required=True, type=Path, metavar="DIR")
    add("dst", required=True, type=Path, metavar="DIR")
    add("workers", type=int, metavar="N")
    add("overwrite", action="store_true")
    add("verify_existing", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    def on_wait() -> None:
        print(f"waiting for another stage into {args.dst} to finish ({LOCK_NAME})",
              file=sys.stderr, flush=True)

    stats = stage(args.src, args.dst, workers=args.workers, overwrite=args.overwrite,
                  progress=not args.quiet, verify_existing=args.verify_existing, on_wait=on_wait)
    if args.json:
        print(json.dumps({"dst": str(args.dst), **stats.__dict__}))
    else:
        print(stats.summary(args.dst))
    return 0
