"""The configurations of a benchmark sweep (`app bench --sweep world=1,2 zero=0,3 ...`): the
items parsed and checked, their cartesian product, where each configuration's ranks go, and the
`launch.sh` and `app train` flags that run it. Pure: app/sweep/command.py runs what this describes.

Resources per rank are the same in every configuration of a sweep: by default the CPU threads and
loader workers that the configuration with the most ranks per node can give each of its ranks (the
node's cores shared by its ranks, `app.data.loader.default_num_workers`). A world of one is then not
measured with the whole machine, and the scaling efficiency compares like with like: 2 ranks x 1
thread against 1 rank x 1 thread on a 2-core box. `threads=` and `workers=` override.

`rate=` runs the configurations on the simulated cluster (bench/netsim.py: network namespaces
joined by links shaped to that rate, launch.sh --no-ssh in each), one rank a node unless
`nodes=` says how many nodes the ranks spread over; the box's cores are split between the nodes.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from app.config import TrainConfig
from app.models.presets import PRESETS
from data_tools.errors import UserError
from data_tools.schema import read_regular


def _int(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not re.fullmatch(r"[0-9]+", text) or int(text) < low:
            raise ValueError(f"expected an integer >= {low}")
        return int(text)
    return parse


def _zero(text: str) -> int:
    if text not in ("0", "1", "2", "3"):
        raise ValueError("ZeRO stages are 0, 1, 2 and 3")
    return int(text)


def _rate(text: str) -> str:
    text = text.strip().lower()
    if not re.fullmatch(r"[0-9]+(\.[0-9]+)?(kbit|mbit|gbit)|none", text):
        raise ValueError("expected a link rate such as 100mbit, 2.5gbit, or none (unshaped)")
    return text


def _model(text: str) -> str:
    if text not in PRESETS:
        raise ValueError(f"unknown preset (choose from {', '.join(PRESETS)})")
    return text


# key -> how one value is read; the order is the order of the results' columns
KEYS: dict[str, Callable[[str], Any]] = {
    "world": _int(1), "zero": _zero, "model": _model, "micro_batch": _int(1),
    "seq_len": _int(1), "workers": _int(0), "threads": _int(1), "rate": _rate,
    "nodes": _int(1)}
# A micro batch of 32, twice app train's: each step's fixed data-parallel cost (the gradient
# all-reduce, waiting for the slower rank; ~20 ms for bert-tiny on 2 CPU ranks) is then ~5% of a
# bert-tiny step, not ~13%, so the sweep measures scaling where compute dominates, as the paper's
# Figure 1 does (docs/benchmarks.md, "bench": 2 ranks x 1 thread gave 1.91x at 32, 1.76x at 16).
DEFAULTS = {"world": [1], "zero": [0], "model": ["bert-tiny"],
            "micro_batch": [2 * TrainConfig.micro_batch], "seq_len": [TrainConfig.seq_len]}


def parse(items: list[str]) -> dict[str, list[Any]]:
    """`["world=1,2", "zero=0,3"]` -> `{"world": [1, 2], "zero": [0, 3]}`, values in the given
    order; a bad item is one line naming it."""
    out: dict[str, list[Any]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise UserError(f"--sweep {item!r}: expected KEY=V1,V2,... (keys: {', '.join(KEYS)})")
        if key not in KEYS:
            raise UserError(f"--sweep {item!r}: unknown key {key!r} (keys: {', '.join(KEYS)})")
        if key in out:
            raise UserError(f"--sweep {item!r}: {key} is given twice")
        values = []
        for word in text.split(","):
            try:
                value = KEYS[key](word.strip())
            except ValueError as e:
                raise UserError(f"--sweep {item!r}: {key}={word.strip()!r}: {e}") from None
            if value in values:
                raise UserError(f"--sweep {item!r}: {key}={value} is listed twice")
            values.append(value)
        out[key] = values
    return out


@dataclass(frozen=True)
class Config:
    """One configuration of the sweep: one short `app train` run."""

    world: int
    zero: int
    model: str
    micro_batch: int
    seq_len: int
    workers: int
    threads: int
    nodes: int
    """Nodes the ranks span (1 without a hostfile)."""
    procs_per_node: int
    rate: str | None = None
    """The simulated cluster's link rate (bench/netsim.py); None: this box or the hostfile's."""

    @property
    def id(self) -> str:
        """A name for its files, stable across runs of the same sweep."""
        sim = f"-nodes{self.nodes}-rate{self.rate}" if self.rate else ""
        return (f"{self.model}-zero{self.zero}-world{self.world}-mb{self.micro_batch}-"
                f"seq{self.seq_len}-workers{self.workers}-threads{self.threads}{sim}")

    @property
    def group(self) -> tuple:
        """Everything but the world size: the configurations whose scaling is compared."""
        return (self.model, self.zero, self.micro_batch, self.seq_len, self.workers,
                self.threads, self.rate)

    def label(self, varying: frozenset[str] = frozenset(KEYS)) -> str:
        return " ".join(f"{k}={getattr(self, k)}" for k in KEYS if k in varying)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def launch_flags(self, hostfile: Path | None, port: int) -> list[str]:
        """launch.sh's own flags: where the ranks go."""
        flags = ["--procs-per-node", str(self.procs_per_node), "--master-port", str(port)]
        if hostfile is not None:
            flags = ["--hostfile", str(hostfile), "--nodes", str(self.nodes), *flags]
        return flags

    def train_flags(self) -> list[str]:
        """`app train` flags this configuration sets (bench adds the run's own)."""
        return ["--model", self.model, "--zero", str(self.zero), "--micro-batch",
                str(self.micro_batch), "--seq-len", str(self.seq_len), "--num-workers",
                str(self.workers)]


def placement(world: int, slots: list[int] | None) -> tuple[int, int]:
    """(nodes, ranks per node) for `world` ranks: this box without a hostfile; with one, the
    first hosts, filled to their slots (the hosts' slots must be equal beyond one node)."""
    if not slots:
        return 1, world
    if world <= slots[0]:
        return 1, world
    per_node = slots[0]
    nodes = -(-world // per_node)
    if world % per_node or nodes > len(slots) or any(s < per_node for s in slots[:nodes]):
        raise UserError(f"--sweep world={world}: does not fill whole nodes of the hostfile "
                        f"({len(slots)} host(s), slots {', '.join(map(str, slots))}); use "
                        f"multiples of {per_node} up to {per_node * len(slots)}")
    return nodes, per_node


def simulated_placement(world: int, nodes: int | None) -> tuple[int, int]:
    """(nodes, ranks per node) on the simulated cluster: one rank a node, or the ranks spread
    evenly over `nodes` nodes (fewer for a smaller world)."""
    n = min(nodes or world, world)
    if world % n:
        raise UserError(f"--sweep world={world} nodes={nodes}: {world} ranks do not spread "
                        f"evenly over {n} nodes")
    return n, world // n


def _places(v: dict[str, list[Any]], slots: list[int] | None) -> dict[tuple, tuple[int, int]]:
    """(world, nodes key) -> (nodes, ranks per node)."""
    if "nodes" in v and "rate" not in v:
        raise UserError("--sweep nodes=...: is the simulated cluster's, with rate=... (real "
                        "nodes come from --hostfile)")
    if "rate" in v:
        if slots:
            raise UserError("--sweep rate=...: runs on the simulated cluster of this box "
                            "(bench/netsim.py); leave --hostfile out")
        return {(w, n): simulated_placement(w, n) for w in v["world"]
                for n in v.get("nodes", [None])}
    return {(w, None): placement(w, slots) for w in v["world"]}


def expand(values: dict[str, list[Any]], *, slots: list[int] | None, cores: int,
           env_threads: int | None, default_workers: Callable[[int], int]) -> list[Config]:
    """The cartesian product, each group's world sizes in a row, smallest first (runs compared
    with each other run close in time, under the same load). On the simulated cluster the
    nodes share the box's cores, so every rank of a world shares them as on one node."""
    v = {**DEFAULTS, **values}
    places = _places(v, slots)
    most_local = max(n * ppn if "rate" in v else ppn for n, ppn in places.values())
    threads = v.get("threads") or [env_threads or max(1, cores // most_local)]
    workers = v.get("workers") or [default_workers(most_local)]
    out = []
    for model, zero, mb, seq, wk, th, rate, node_key in itertools.product(
            v["model"], v["zero"], v["micro_batch"], v["seq_len"], workers, threads,
            v.get("rate", [None]), v.get("nodes", [None])):
        for world in sorted(v["world"]):
            nodes, ppn = places[(world, node_key)]
            out.append(Config(world=world, zero=zero, model=model, micro_batch=mb, seq_len=seq,
                              workers=wk, threads=th, nodes=nodes, procs_per_node=ppn,
                              rate=rate))
    return out


def varying(configs: list[Config]) -> frozenset[str]:
    """The keys that take more than one value (what names a configuration in a legend)."""
    return frozenset(k for k in KEYS if len({getattr(c, k) for c in configs}) > 1)


def hostfile_slots(path: Path) -> list[int]:
    """Each host's slots, in order (launch.sh checks the file fully before anything starts)."""
    text = read_regular(path, f"--hostfile {path}: no such file").decode("utf-8", "replace")
    slots = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"\S+\s+slots=([1-9][0-9]*)", line)
        if not m:
            raise UserError(f"{path}:{lineno}: expected 'hostname slots=N', got {line!r}")
        slots.append(int(m.group(1)))
    if not slots:
        raise UserError(f"{path}: no hosts in the hostfile")
    return slots
