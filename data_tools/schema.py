"""Reading back what the project wrote: JSON files checked against one typed schema per file kind.

A file that does not fit (a key missing, a count negative, a string where a number belongs, a
binary line) is one line naming the file (and line) and the key, never a traceback deep in the
code that trusted it. Schemas are pydantic models in strict mode: no silent coercion of "5" to 5
or of true to 1, no NaN or infinity; keys a schema does not name are allowed (newer writers may
add some).
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Annotated, Any, Iterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from data_tools.errors import UserError

NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeFloat = Annotated[float, Field(ge=0)]


class Schema(BaseModel):
    """Base of every file schema: strict types, finite numbers, unknown keys allowed."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


_UNION_TAGS = ("float", "str", "int", "bool", "none")
_UNION_TAG_PREFIXES = ("list[", "dict[", "literal[", "function-", "constrained-", "nullable[")


def _key(loc: tuple) -> str:
    """'splits.train.shards[0].tokens' from pydantic's location (minus its union-member tags)."""
    out = ""
    for part in loc:
        if isinstance(part, str) and (part in _UNION_TAGS or part.startswith(_UNION_TAG_PREFIXES)):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def check(schema: type[Schema], data: Any, where: str | os.PathLike) -> Any:
    """`data` unchanged when it fits `schema`; else UserError naming `where` and the key."""
    try:
        schema.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        key = _key(err["loc"])
        if err["type"] == "missing":
            raise UserError(f"{where}: key '{key}' is missing") from None
        if err["type"] == "extra_forbidden":
            raise UserError(f"{where}: key '{key}' is not a key of this file (misspelt?)"
                            ) from None
        got = repr(err.get("input"))
        got = got if len(got) <= 40 else got[:37] + "..."
        msg = err["msg"][0].lower() + err["msg"][1:]
        raise UserError(f"{where}: key '{key}': {msg} (got {got})" if key else
                        f"{where}: {msg}") from None
    return data


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(text: str | bytes, where: str | os.PathLike) -> Any:
    """Parse JSON text strictly (no NaN/Infinity); UserError naming `where` and the line."""
    try:
        return json.loads(text, parse_constant=_no_constants)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: line {e.lineno}: not valid JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise UserError(f"{where}: not UTF-8 text") from None
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISDIR, "a directory"))


def not_regular(mode: int) -> str:
    """What a file of this st_mode is when it is not a regular file ("a FIFO", ...)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike, missing: str | None = None) -> int:
    """A read-only descriptor of `path`, refused in one line unless it is a regular file.

    The one gate for every file the project opens from a user's path: a FIFO with no writer
    would block the open (and a read) for ever, a device would read without end. Opened
    without blocking and checked by fstat, so what is checked is what is read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise UserError(missing or f"{path}: no such file") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UserError(f"{path}: is {not_regular(mode)}, expected a regular file")
    os.set_blocking(fd, True)
    return fd


def check_regular(path: str | os.PathLike, missing: str | None = None) -> Path:
    """`path`, after checking it is a regular file (for a library that opens it itself)."""
    os.close(open_regular(path, missing))
    return Path(path)


def read_regular(path: str | os.PathLike, missing: str | None = None) -> bytes:
    """The bytes of a regular file (open_regular); one line for any read error."""
    fd = open_regular(path, missing)
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None


def read_json(path: str | os.PathLike, schema: type[Schema] | None = None, *,
              missing: str | None = None) -> Any:
    """Parse (and check) a JSON file; UserError naming the file (and line, and key).

    `missing` is the message for a file that does not exist (default: "<path>: no such file").
    """
    data = parse_json(read_regular(path, missing), path)
    return check(schema, data, path) if schema is not None else data


def read_jsonl(path: str | os.PathLike, schema: type[Schema] | None = None
               ) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of a JSON-lines file. A torn last line (a writer killed mid-line) is
    skipped; any other bad line is one UserError naming the file, the line and the key."""
    lines = read_regular(path).split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        where = f"{path}: line {i + 1}"
        try:
            record = json.loads(raw.decode("utf-8"), parse_constant=_no_constants)
        except (UnicodeDecodeError, ValueError):
            if i == last:
                return  # torn by a crash mid-write
            raise UserError(f"{where}: not valid JSON") from None
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected a JSON object")
        yield i + 1, check(schema, record, where) if schema is not None else record
