"""User-facing errors and the command-line dispatcher shared by `data_tools` and `app`.

A problem the user can fix is one line on stderr (what, and where), exit status 2, no traceback.
Tracebacks are for bugs.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Mapping, NoReturn, Sequence

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A problem with the user's input. The message says what is wrong and where."""


class Stopped(Exception):
    """The command stopped on purpose (a preemption, the anomaly policy): one line, and its own
    exit status, which says what to do next."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (no usage dump) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message}\n")


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
        from data_tools.output import DISK_FULL, disk_full_message
        what = (disk_full_message(e.filename or "?") if e.errno in DISK_FULL
                else f"{e.filename or 'a file'}: {e.strerror or e}")
        print(f"{prog} {args.command}: error: {what}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"{prog} {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130
