"""`app train --data`: the dataset directories a run reads, and their weights.

    --data DIR                    one dataset, read as ever (its order, its seed)
    --data 0.7:DIR_A 0.3:DIR_B    a weighted mixture (weights are relative: 7:A 3:B is the same)
    --data MIXTURE.json           {"sources": [{"path": DIR, "weight": W, "name": N}, ...]}
                                  (paths relative to the file; names optional)

Everything is checked here, before any process group and before anything is written: each
weight (a finite number above 0), each dataset (its dataset.json), one tokenizer for all (the
fingerprints in their dataset.json), no source listed twice. A source's name (metrics
`data/<name>/epoch`, `eval/<name>/loss`, its --stage-to subdirectory) is given in the mixture file
or is its directory's name, made unique.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, cast

from pydantic import ConfigDict

from app.data.mixture import MAX_SOURCES, Mixture, describe, source_seed
from data_tools.errors import UserError
from data_tools.manifest import MANIFEST, format_digest, load_manifest, new_hasher
from data_tools.schema import Schema, read_json

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class SourceEntry(Schema):
    """One source of a mixture file. Unlike the files the project writes (where a newer writer
    may add keys), a user's mixture file has no key to skip: a misspelt "wieght" is refused."""

    model_config = ConfigDict(extra="forbid")
    path: str
    weight: Any
    """A number above 0 (checked with the flags' weights, for one message)."""
    name: str | None = None


class MixtureFile(Schema):
    """A mixture file (`--data MIXTURE.json`): "sources" and nothing else."""

    model_config = ConfigDict(extra="forbid")

    sources: list[SourceEntry]


@dataclass(frozen=True)
class Source:
    name: str
    path: Path
    weight: float
    """As given (relative to the others')."""
    manifest: dict[str, Any]


@dataclass(frozen=True)
class Sources:
    """The datasets of a run: one, or a weighted mixture (`mixture` set)."""

    items: tuple[Source, ...]
    mixture: Mixture | None

    @property
    def is_mixture(self) -> bool:
        return self.mixture is not None

    @property
    def manifest(self) -> dict[str, Any]:
        """The first dataset's manifest: vocabulary and special ids (shared by all)."""
        return self.items[0].manifest

    @property
    def paths(self) -> list[Path]:
        return [s.path for s in self.items]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.items]

    def seed(self, seed: int, index: int) -> int:
        """A source's seed: the run's for a lone dataset (as ever), else its own."""
        return source_seed(seed, index) if self.is_mixture else seed

    @property
    def fingerprint(self) -> str:
        """The data's identity: the dataset's fingerprint, or a hash of the mixture's sources'
        fingerprints and quantised shares (what decides the stream; names and paths do not)."""
        if self.mixture is None:
            return self.manifest["fingerprint"]
        h = new_hasher()
        for s, share in zip(self.items, self.mixture.shares.tolist()):
            h.update(f"{s.manifest['fingerprint']}:{share}\n".encode())
        return format_digest(h)

    def record(self) -> list[dict[str, Any]]:
        """The mixture as config.json, wandb and the checkpoint record it."""
        assert self.mixture is not None, "record() is a mixture's"
        return [{"name": s.name, "path": str(s.path), "weight": s.weight, "share": share,
                 "fingerprint": s.manifest["fingerprint"]}
                for s, share in zip(self.items, self.mixture.fractions)]

    def epochs(self, position: int, num_samples: Sequence[int]) -> dict[str, float]:
        """`data/<name>/epoch` of a mixture at a stream position: how often each source has been
        read through (an upsampled small source shows its repeats). Nothing for one dataset."""
        if self.mixture is None:
            return {}
        drawn = self.mixture.drawn(position).tolist()
        return {f"data/{s.name}/epoch": round(d / n, 6)
                for s, d, n in zip(self.items, drawn, num_samples)}

    def staged(self, stage_to: Path) -> list[Path]:
        """Where --stage-to puts each dataset: DIR itself for one, DIR/<name> for a mixture."""
        return [stage_to / s.name for s in self.items] if self.is_mixture else [stage_to]

    def check_resume(self, saved: list[dict[str, Any]] | None, where: Path) -> None:
        """Refuse to resume a mixture run on another mixture (sources or weights), or on one
        dataset, and the other way round (`saved`: the checkpoint's record, None for one)."""
        now = self.record() if self.is_mixture else None
        if [(s["fingerprint"], s["share"]) for s in now or []] == [
                (s.get("fingerprint"), s.get("share")) for s in saved or []]:
            return
        raise UserError(f"{where}: the checkpoint was trained on {_said(saved)}, --data is "
                        f"{_said(now)} (other sources or weights): refusing to resume on a "
                        f"changed mixture (use a new --out, or --resume never)")


def _said(record: list[dict[str, Any]] | None) -> str:
    if not record:
        return "one dataset"
    # record() writes every source's name and share
    return "the mixture " + describe(cast("list[str]", [s.get("name") for s in record]),
                                     cast("list[float]", [s.get("share") for s in record]))


def read_sources(data: Path | Sequence[str]) -> Sources:
    """The run's datasets from --data (TrainConfig.data), every one checked. A mixture of one
    source is that dataset alone (its weight and name aside)."""
    if isinstance(data, Path):
        return Sources((Source(data.name, data, 1.0, load_manifest(data)),), None)
    wanted = (_from_file(Path(data[0])) if len(data) == 1 and data[0].endswith(".json")
              else [_from_arg(a) for a in data])
    if len(wanted) > MAX_SOURCES:
        raise UserError(f"--data: {len(wanted)} sources; a mixture takes at most {MAX_SOURCES}")
    total = sum(weight for _, weight, _, _ in wanted)  # inf when it overflows
    if not math.isfinite(total):
        raise UserError(f"--data: the weights sum to more than the largest number "
                        f"({describe_weights(wanted)}); weights are relative: scale them down")
    found = [(path, weight, name, _manifest(path, where)) for path, weight, name, where in wanted]
    _check_distinct(found)
    items = _named(found)
    _check_tokenizers(items)
    if len(items) == 1:
        return Sources(items, None)
    return Sources(items, Mixture([s.weight for s in items]))


def describe_weights(wanted: Sequence[tuple[Path, float, Any, Any]]) -> str:
    return ", ".join(f"{weight:g}:{path}" for path, weight, _, _ in wanted)


def is_mixture_arg(arg: str) -> bool:
    """Whether a lone --data argument is a weighted source or a mixture file (not a directory)."""
    return not Path(arg).is_dir() and (":" in arg or arg.endswith(".json"))


def _manifest(path: Path, where: str | None) -> dict[str, Any]:
    """dataset.json of a source; an error names the mixture file's entry (a flag names itself)."""
    try:
        return load_manifest(path)
    except UserError as e:
        if where is None:
            raise
        raise UserError(f"{where}: {e}") from None


def _weight(text: Any, where: str) -> float:
    try:
        if isinstance(text, bool) or not isinstance(text, (str, int, float)):
            raise TypeError(text)
        value = float(text)
    except (TypeError, ValueError):
        raise UserError(f"{where}: weight {text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"{where}: weight {text!r} must be a finite number above 0")
    return value


def _from_arg(arg: str) -> tuple[Path, float, None, None]:
    weight, sep, path = arg.partition(":")
    if not sep or not path:
        raise UserError(f"--data {arg}: a mixture lists each dataset as WEIGHT:DIR (e.g. "
                        f"0.7:{arg})")
    return Path(path), _weight(weight, f"--data {arg}"), None, None


def _from_file(path: Path) -> list[tuple[Path, float, str | None, str]]:
    entries = read_json(path, MixtureFile)["sources"]
    if not entries:
        raise UserError(f"{path}: key 'sources' is empty")
    out, names = [], set()
    for i, e in enumerate(entries):
        where = f"{path}: sources[{i}]"
        name = e.get("name")
        if name is not None and not NAME_RE.match(name):
            raise UserError(f"{where}: name {name!r}: use letters, digits, '.', '_' and '-' "
                            f"(at most 64, starting with a letter or digit)")
        if name is not None and name in names:
            raise UserError(f"{where}: name {name!r} is given to an earlier source too")
        names.add(name)
        if isinstance(e["weight"], str):  # strict, as every file this app reads
            raise UserError(f"{where}: weight {e['weight']!r} is not a number (a JSON number "
                            f"has no quotes)")
        out.append((path.parent / e["path"], _weight(e["weight"], where), name, where))
    return out


def _named(found: list[tuple[Path, float, str | None, dict]]) -> tuple[Source, ...]:
    """Sources with unique names: given ones first, then each directory's name (safe, unique)."""
    taken, items = {name for _, _, name, _ in found if name is not None}, []
    for path, weight, name, manifest in found:
        if name is None:
            base = re.sub(r"[^A-Za-z0-9._-]", "_", path.resolve().name).lstrip("._-")[:60] or "data"
            name, n = base, 1
            while name in taken:
                n += 1
                name = f"{base}-{n}"
            taken.add(name)
        items.append(Source(name, path, weight, manifest))
    return tuple(items)


def _check_distinct(found: list[tuple[Path, float, str | None, dict]]) -> None:
    paths: dict[Path, Path] = {}
    prints: dict[str, Path] = {}
    for path, _, _, manifest in found:
        real, fingerprint = path.resolve(), manifest["fingerprint"]
        if real in paths:
            raise UserError(f"--data: {path} is listed twice; list it once, with the sum of the "
                            f"weights")
        if fingerprint in prints:
            raise UserError(f"--data: {prints[fingerprint]} and {path} hold the same dataset "
                            f"(fingerprint {fingerprint} in both {MANIFEST}); list it once, with "
                            f"the sum of the weights")
        paths[real], prints[fingerprint] = path, path


def _check_tokenizers(items: Sequence[Source]) -> None:
    first = items[0]
    want = first.manifest["tokenizer"]["fingerprint"]
    for s in items[1:]:
        got = s.manifest["tokenizer"]["fingerprint"]
        if got != want or s.manifest["vocab_size"] != first.manifest["vocab_size"]:
            raise UserError(f"--data: {s.path / MANIFEST} was made with another tokenizer than "
                            f"{first.path / MANIFEST} (tokenizer fingerprint {got}, not {want}); "
                            f"a mixture needs one tokenizer (prepare or adopt each dataset with "
                            f"the same one)")
