"""Flags from typed configs: a command's settings are a dataclass with a docstring under each
field (TrainConfig, PrepareConfig, StageConfig), and its flags are made from it, so the name, the
default and the help of a setting are written once. The same settings can come from a YAML or
JSON file (`--config FILE`, ConfigFile), checked by the flags' own types and choices.

Hand-written rather than jsonargparse or tyro: both were tried on TrainConfig (issue 20), and
neither keeps this CLI (`--seq-len`, bare `--compile`, `--data A B`) with one-line errors that
name the file and the key.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import inspect
import json
import math
import stat
import textwrap
from contextlib import contextmanager
from dataclasses import MISSING, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import yaml

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


# -- settings from a file ----------------------------------------------------------------------

class ConfigError(Exception):
    """A settings file that cannot be used; the message names the key (the caller, the file)."""


class ConfigFile(argparse.Action):
    """`--config FILE`: settings of the dataclass `cls` from YAML or JSON, keys = its field names.

    data_tools.errors.Parser reads the file before the command line (config_defaults), as the
    defaults of the flags, so a flag overrides the file wherever it stands, and each value is
    checked by its flag's own type and choices. `recorded`: the key under which a run's record
    keeps these settings (RUN_DIR/config.json's "run"), so the record repeats the run.
    `not_repeated`: settings a record keeps but does not repeat, what the run did to its output
    (`--resume never --overwrite` replaced an earlier run once; repeated, it would replace this
    one): a record read back leaves them at their defaults.
    """

    def __init__(self, option_strings: list[str], dest: str, cls: type,
                 recorded: str | None = None, not_repeated: tuple[str, ...] = (), **kw: Any):
        super().__init__(option_strings, dest, metavar="FILE", **kw)
        self.cls, self.recorded, self.not_repeated = cls, recorded, not_repeated
        self.read: str | None = None  # the file config_defaults applied, while it parses

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        if value != self.read:  # an abbreviated flag, or a parser without config_defaults
            parser.error(f"{option_string} {value}: not read (spell the flag out: "
                         f"{self.option_strings[0]} FILE)")
        setattr(namespace, self.dest, value)


def config_file(parser: argparse.ArgumentParser, cls: type, recorded: str | None = None,
                not_repeated: tuple[str, ...] = ()) -> None:
    """Add `--config FILE` for the settings dataclass `cls` (see ConfigFile)."""
    parser.add_argument("--config", action=ConfigFile, cls=cls, recorded=recorded,
                        not_repeated=not_repeated,
                        help="YAML or JSON file of these settings (keys: the flags without "
                        "'--', '_' for '-'; a run's RUN_DIR/config.json repeats the run); "
                        "flags override it")


@contextmanager
def config_defaults(parser: argparse.ArgumentParser, args: Sequence[str]) -> Iterator[None]:
    """While `parser` parses `args`: the settings of their `--config FILE` as the flags' defaults
    (a required flag the file sets is optional then). Parser state is restored afterwards."""
    actions = parser._actions  # argparse keeps no public list of a parser's actions
    config = next((a for a in actions if isinstance(a, ConfigFile)), None)
    path = config_path(args, config.option_strings) if config else None
    if path is None:
        yield
        return
    settings = {f.name for f in fields(config.cls)}
    by_dest = {a.dest: a for a in actions if a.dest in settings}
    try:
        values = read_settings(path, config.recorded, by_dest, config.not_repeated)
    except ConfigError as e:
        parser.error(f"{config.option_strings[0]} {path}: {e}")
    saved = [(by_dest[k], by_dest[k].default, by_dest[k].required) for k in values]
    for action, _, _ in saved:
        action.default, action.required = values[action.dest], False
    config.read = path
    try:
        yield
    finally:
        config.read = None
        for action, default, required in saved:
            action.default, action.required = default, required


def config_path(args: Sequence[str], options: Sequence[str]) -> str | None:
    """The FILE of the last `--config FILE` (or `--config=FILE`) in `args`."""
    path = None
    for i, arg in enumerate(args):
        if arg == "--":
            break
        name, eq, value = arg.partition("=")
        if name in options:
            path = value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return path


def read_settings(path: str, recorded: str | None, by_dest: dict[str, argparse.Action],
                  not_repeated: tuple[str, ...] = ()) -> dict[str, Any]:
    """The settings in file `path` by name, each checked as its flag would check it (a run's
    record without its `not_repeated` ones)."""
    data = load_file(Path(path))
    if recorded and isinstance(data.get(recorded), dict) and recorded not in by_dest:
        # a run's record: its settings are one section of it
        data = {k: v for k, v in data[recorded].items() if k not in not_repeated}
    out = {}
    for key, value in data.items():
        if key not in by_dest:
            near = difflib.get_close_matches(str(key).replace("-", "_"), by_dest, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(f"unknown setting {key!r}{hint}")
        try:
            out[key] = flag_value(by_dest[key], value)
        except ConfigError as e:
            raise ConfigError(f"{key}: {e}") from None
    return out


def load_file(path: Path) -> dict[str, Any]:
    """The mapping in a JSON (.json) or YAML file."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise ConfigError(f"cannot read ({e.strerror})") from None
    if not stat.S_ISREG(mode):  # a FIFO would block the read; a directory fails it
        raise ConfigError("a directory, not a file" if stat.S_ISDIR(mode)
                          else "not a regular file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError("not UTF-8 text") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"not valid JSON (line {e.lineno}: {e.msg})") from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f"line {mark.line + 1}: " if mark else ""
            raise ConfigError(f"not valid YAML ({line}{getattr(e, 'problem', None) or e})"
                              ) from None
    if not isinstance(data, dict):
        raise ConfigError("expected settings, one 'name: value' each")
    return data


def flag_value(action: argparse.Action, value: Any) -> Any:
    """`value` from a file as `action`'s flag would parse it: the same type and choices."""
    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            raise ConfigError(f"expected true or false, not {value!r}")
        return value
    if value is None:
        if action.default is None and not action.required:
            return None
        raise ConfigError("expected a value, not null")
    if action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        if not items and action.required:  # an empty list is "none" where the flag is optional
            raise ConfigError("expected at least one value")
        return [_one_value(action, v) for v in items]
    return _one_value(action, value)


def _one_value(action: argparse.Action, value: Any) -> Any:
    if isinstance(value, bool):
        raise ConfigError(f"expected a value, not {str(value).lower()} (YAML reads yes/no/on/off "
                          f"as true/false: quote them)")
    if isinstance(value, (list, dict)):
        kind = "list" if isinstance(value, list) else "mapping"
        raise ConfigError(f"expected one value, not a {kind}")
    text = str(value)  # what the flag would have received (str(float) round-trips)
    try:
        parsed = action.type(text) if action.type else text
    except argparse.ArgumentTypeError as e:
        raise ConfigError(str(e)) from None
    except (TypeError, ValueError):
        name = getattr(action.type, "__name__", repr(action.type))
        raise ConfigError(f"invalid {name} value: {value!r}") from None
    if action.choices is not None and parsed not in action.choices:
        raise ConfigError(f"invalid choice: {value!r} (choose from "
                          f"{', '.join(map(str, action.choices))})")
    return parsed
