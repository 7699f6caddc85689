"""Flags from typed configs: a command's settings are a dataclass with a docstring under each
field (TrainConfig, PrepareConfig, StageConfig), and its flags are made from it, so the name, the
default and the help of a setting are written once.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import math
import textwrap
from dataclasses import MISSING, fields
from functools import lru_cache
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def finite_float(text: str) -> float:
    """argparse type for every float flag: a number, never NaN or an infinity."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def flag(name: str) -> str:
    """The flag of a config field: `seq_len` -> `--seq-len`."""
    return "--" + name.replace("_", "-")


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass `cls` (the one source of its --help)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    out = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            out[node.target.id] = nxt.value.value
    return out


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """The config dataclass `cls` from parsed flags (other attributes of `args` ignored)."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def config_flags(parser: argparse.ArgumentParser, cls: type) -> Callable[..., None]:
    """`add(field, **argparse_kwargs)` that adds the field's flag with its default and help."""
    docs = field_docs(cls)
    defaults = {f.name: f.default for f in fields(cls)}

    def add(name: str, **kw: Any) -> None:
        default = defaults.get(name)
        if default is not None and default is not MISSING and "default" not in kw:
            kw["default"] = default
        help_text = docs.get(name, "").replace("%", "%%")  # argparse formats help with %
        if kw.get("default") not in (None, False, []) and "action" not in kw:
            help_text += f" (default {kw['default']})"
        parser.add_argument(flag(name), dest=name, help=help_text, **kw)

    return add
