"""User-facing errors and the command-line dispatcher shared by `data_tools` and `app`.

A problem the user can fix is one line on stderr (what, and where), exit status 2, no traceback.
Tracebacks are for bugs. The wording of a full disk is here too, so that output.py (which turns
failed writes into these errors) and run_cli (the last resort) say it alike.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import os
import shutil
import sys
from pathlib import Path
from typing import Mapping, NoReturn, Sequence

from data_tools.cli import config_defaults

EXIT_USER_ERROR = 2
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


class UserError(Exception):
    """A problem with the user's input. The message says what is wrong and where."""


class Stopped(Exception):
    """The command stopped on purpose (a preemption, the anomaly policy): one line, and its own
    exit status, which says what to do next."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent)."""
    try:
        return shutil.disk_usage(_existing(path)).free
    except OSError:
        return None


def mb(n: int | float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _existing(path: str | os.PathLike) -> Path:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def out_of_inodes(path: str | os.PathLike) -> str | None:
    """The mount point holding `path` when its filesystem has no free inodes, else None: ENOSPC
    with megabytes free means no file entries are left, and "out of disk space" would mislead."""
    p = _existing(path)
    try:
        if os.statvfs(p).f_favail != 0:
            return None
    except (OSError, AttributeError):
        return None
    p = p.resolve()
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return str(p)


def disk_full_message(path: str | os.PathLike, needed: int | None = None) -> str:
    mount = out_of_inodes(path)
    if mount is not None:
        return f"out of inodes (no free file entries) on {mount} writing {path}"
    free = free_bytes(path)
    parts = [f"out of disk space writing {path}"]
    if needed is not None:
        parts.append(f"it needs about {mb(needed)}")
    if free is not None:
        parts.append(f"{mb(free)} free there")
    return "; ".join(parts)


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (no usage dump) and exits 2, and reads a
    `--config FILE` (data_tools/cli.py, ConfigFile) before the flags, which override it."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        with config_defaults(self, args):
            return super().parse_known_args(args, namespace)


def run_cli(prog: str, description: str, commands: Mapping[str, tuple[str, str]],
            argv: Sequence[str] | None = None) -> int:
    """Dispatch `prog COMMAND ...` to `module.run(args)`, after `module.add_arguments(parser)`.

    `commands` maps a command name to (module path, one-line help). Only the chosen command's
    module is imported, so `--help` and light commands stay fast (torch/deepspeed import slowly).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = Parser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    chosen = argv[0] if argv else None
    for name, (module_path, help_text) in commands.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_path)
            module.add_arguments(p)
            p.set_defaults(func=module.run)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USER_ERROR
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"{prog} {args.command}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except Stopped as e:
        print(f"{prog} {args.command}: stopped: {e} (exit status {e.code})", file=sys.stderr,
              flush=True)
        return e.code
    except OSError as e:  # the environment, not a bug: a full disk, a permission, a missing file
        what = (disk_full_message(e.filename or "?") if e.errno in DISK_FULL
                else f"{e.filename or 'a file'}: {e.strerror or e}")
        print(f"{prog} {args.command}: error: {what}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"{prog} {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130
