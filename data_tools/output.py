"""Everything the project writes goes through here: output directories, atomic files, and the one
handler that turns a failed write into one line.

The rules (docs/design.md, "Outputs"):
- A command writes a new output directory into a temporary sibling and renames it into place, so
  the destination is either the complete old output, the complete new one, or absent.
- `--overwrite` replaces only what the same command made before, recognised by the marker file
  each command leaves (`.dspretrain.json`, or for datasets their `dataset.json`); never a directory
  it does not recognise, and never one that equals, contains or lies inside one of its inputs
  (compared as files: the same device and inode, so a bind mount or another spelling of an input
  is refused too).
- Directories and files are created with the user's umask (a team shares them).
- A failed write is one line naming the path and the cause; for a full disk, how much was needed
  and how much was free.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

# the disk-full wording lives in errors.py (run_cli words an unhandled full disk the same way);
# checkpoint code reads it from here, with the rest of the write handling
from data_tools.errors import DISK_FULL, UserError, disk_full_message, free_bytes

MARKER = ".dspretrain.json"


# -- write errors ------------------------------------------------------------------------------

def write_error(e: BaseException, path: str | os.PathLike, needed: int | None = None
                ) -> UserError | None:
    """The one-line error for a write to `path` that failed with `e` (None: not a write failure,
    e.g. a bug, which keeps its traceback)."""
    if isinstance(e, UserError):
        return e
    if isinstance(e, OSError):
        if e.errno in DISK_FULL:
            return UserError(disk_full_message(e.filename or path, needed))
        where = e.filename or path
        if e.errno == errno.ENOTDIR:
            return UserError(f"{where}: a file stands where a directory is expected")
        return UserError(f"{where}: cannot write ({e.strerror or e})")
    # Libraries that do not raise OSError: torch.save ("PytorchStreamWriter failed writing file
    # ... enforce fail ... unexpected pos" on a full disk), the tokenizers and safetensors Rust
    # code ("No space left on device (os error 28)", sometimes as a panic)
    text = str(e)
    code = re.search(r"os error (\d+)", text)
    if code:
        return write_error(OSError(int(code.group(1)), os.strerror(int(code.group(1)))), path,
                           needed)
    if "PytorchStreamWriter" in text or "unexpected pos" in text or \
            type(e).__name__ == "PanicException":
        free = free_bytes(path)
        if free is not None and free < 1 << 20:
            return UserError(disk_full_message(path, needed))
        first = (text.strip().splitlines() or [type(e).__name__])[0]
        return UserError(f"{path}: cannot write ({first})")
    return None


@contextmanager
def writing(path: str | os.PathLike, needed: int | None = None) -> Iterator[None]:
    """Turn a failed write inside into one line naming `path` (other errors pass unchanged)."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, UserError):
        raise
    except BaseException as e:  # noqa: BLE001 - OSError, torch's RuntimeError, Rust panics
        error = write_error(e, path, needed)
        if error is None:
            raise
        raise error from None


# -- files -------------------------------------------------------------------------------------

def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, fsync: bool = True) -> None:
    """Readers see the old content or the whole new one, never a part; umask permissions."""
    path = Path(path)
    with writing(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes it 0600; a team must read it
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        if fsync:
            fsync_dir(path.parent)


def append_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Append and fsync: a journal's record (a crash can leave only a torn last record, which
    its reader drops); the directory is synced too when the file is new."""
    path = Path(path)
    with writing(path):
        new = not path.exists()
        with open(path, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if new:
            fsync_dir(path.parent)


def write_text_atomic(path: str | os.PathLike, text: str, *, fsync: bool = True) -> None:
    write_bytes_atomic(path, text.encode("utf-8"), fsync=fsync)


def to_json(data: Any, *, indent: int | None = 2) -> str:
    """JSON text; NaN and infinities are refused (they are not JSON)."""
    return json.dumps(data, indent=indent, allow_nan=False)


def write_json_atomic(path: str | os.PathLike, data: Any, *, fsync: bool = True) -> None:
    write_text_atomic(path, to_json(data) + "\n", fsync=fsync)


# -- output directories ------------------------------------------------------------------------

def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of `path` (None: it does not exist): what makes two paths one file."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _relation(out: Path, other: Path) -> str | None:
    """How `out` lies to `other`, by path and by file: a bind mount, a hard-linked or
    differently spelled path to the same directory has another path but the same
    (device, inode), for itself or for one of its parents."""
    o, i = out.resolve(), other.resolve()
    if o == i:
        return "is"
    if i.is_relative_to(o):
        return "contains"
    if o.is_relative_to(i):
        return "lies inside"
    o_id, i_id = _identity(o), _identity(i)
    if o_id is not None and o_id == i_id:
        return "is"
    if o_id is not None and any(_identity(p) == o_id for p in i.parents):
        return "contains"
    if i_id is not None and any(_identity(p) == i_id for p in (o, *o.parents)):
        return "lies inside"
    return None


def check_apart(out: Path, inputs: Iterable[tuple[str, Path]], flag: str = "--out") -> None:
    """Refuse an output that equals, contains or lies inside an input (`(flag, path)` pairs),
    compared as files (device and inode) as well as paths."""
    for in_flag, path in inputs:
        rel = _relation(out, Path(path))
        if rel is not None:
            raise UserError(f"{flag} {out}: {rel} the input {in_flag} {path}; choose an output "
                            f"directory apart from the inputs")


def mark(directory: Path, kind: str, command: str) -> None:
    """Leave the marker that lets `command --overwrite` recognise this output later."""
    write_json_atomic(directory / MARKER, {
        "kind": kind, "command": command,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}, fsync=False)


def marked_as(directory: Path) -> str | None:
    """The kind recorded in the directory's marker (None: no readable marker)."""
    try:
        data = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data.get("kind") if isinstance(data, dict) else None


def claim(out: Path, kind: str, command: str, *, overwrite: bool,
          inputs: Iterable[tuple[str, Path]] = (), flag: str = "--out",
          recognise: Callable[[Path], bool] | None = None) -> bool:
    """Check that `command` may write a `kind` to `out`; True when it will replace an old one.

    `recognise` accepts outputs of this kind made before markers existed (e.g. a dataset.json).
    """
    check_apart(out, inputs, flag)
    if not out.exists():
        refuse_dangling(out, flag)
        return False
    if not out.is_dir():
        raise UserError(f"{flag} {out}: exists and is not a directory")
    try:
        empty = not any(out.iterdir())
    except OSError as e:
        raise UserError(f"{flag} {out}: cannot read ({e.strerror})") from None
    if empty:
        return False
    ours = marked_as(out) == kind or (recognise is not None and recognise(out))
    if not ours:
        raise UserError(f"{flag} {out}: not empty and not a {kind} made by `{command}`; "
                        f"choose an empty or new directory (nothing was changed)")
    if not overwrite:
        raise UserError(f"{flag} {out}: already holds a {kind} (use --overwrite to replace it)")
    return True


def claim_file(path: Path, flag: str, *, ours: Callable[[Path], bool],
               what: str, inputs: Iterable[tuple[str, Path]] = ()) -> None:
    """The gate of a single file a command writes (`--plot PATH`): the same rules as `claim`
    for a directory. `path` is never an input (nor inside one: `check_apart`), never a file of
    a dataset, run or other output of this project (a directory holding a marker or a
    `dataset.json`), and when it exists it must be a regular file that `ours` recognises as
    a `what` this command wrote before; anything else is refused and left as it is."""
    check_apart(path, inputs, flag)
    refuse_dangling(path, flag)
    parent = path.parent
    for d in (parent, *parent.parents):
        if (d / MARKER).is_file() or (d / "dataset.json").is_file():
            owner = marked_as(d) or "dataset"
            raise UserError(f"{flag} {path}: inside {d}, a {owner} (nothing there was changed); "
                            f"choose a path outside it")
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_file():
        raise UserError(f"{flag} {path}: exists and is not a regular file (nothing was changed)")
    if not ours(path):
        raise UserError(f"{flag} {path}: exists and is not a {what} this command wrote; choose "
                        f"a new path (nothing was changed)")


def refuse_dangling(path: Path, flag: str = "--out") -> None:
    """Refuse a symlink whose target is missing: mkdir and open fail on it with an error that
    reads as a permission problem, which sends the user looking in the wrong place."""
    if path.is_symlink() and not path.exists():
        raise UserError(f"{flag} {path}: is a symlink to {os.readlink(path)}, "
                        f"which does not exist")


def make_dirs(path: Path, flag: str = "--out") -> None:
    """mkdir -p with the umask, one line on failure."""
    refuse_dangling(path, flag)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{flag} {path}: a file stands where a directory is expected") from None
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot create the directory ({e.strerror})") from None


@contextmanager
def new_dir(out: Path, kind: str, command: str, flag: str = "--out") -> Iterator[Path]:
    """Write a whole output directory: yields a temporary sibling (umask permissions) to fill;
    on success it is marked and renamed to `out` (replacing what was there, which `claim`
    allowed), on any failure removed. `out` is never seen half-written."""
    make_dirs(out.parent, flag)
    with writing(out.parent):
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it 0700
    try:
        with writing(out):
            yield tmp
            mark(tmp, kind, command)
            share(tmp)
        replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def share(directory: Path) -> None:
    """Give what a library wrote inside `directory` the umask's permissions (some write 0600
    files through temporary names, unreadable to the rest of a team)."""
    mask = umask()
    for p in directory.rglob("*"):
        # A hard link shares its mode with a file this command did not make (adopt links
        # shards): leave it as its owner set it.
        if not p.is_symlink() and (p.is_dir() or p.stat().st_nlink == 1):
            p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def replace_dir(new: Path, out: Path) -> None:
    """Rename `new` to `out`; an old `out` is moved aside first and deleted only afterwards."""
    with writing(out):
        old = None
        if out.exists() or out.is_symlink():
            old = out.with_name(f".{out.name}.old.{os.getpid()}")
            os.replace(out, old)
        try:
            os.replace(new, out)
        except BaseException:
            if old is not None:
                os.replace(old, out)
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
