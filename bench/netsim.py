"""A simulated cluster on one box: N "nodes" as network namespaces, each joined to a switch by
its own link shaped with `tc` (rate and delay, both directions), and `launch.sh --no-ssh` started
in every one of them, so the ranks talk gloo over a real, slow network instead of loopback.

    python bench/netsim.py run --nodes 2 --rate 200mbit --delay 0.1ms -- --data D --out R ...
    python bench/netsim.py ddp --nodes 2 --rate 200mbit -- --data D --model bert-tiny ...
    python bench/netsim.py calibrate --data D -- --model bert-tiny --model-arg ...
    python bench/netsim.py scale --data D --calibrate --out OUT -- --model-arg ...
    python bench/netsim.py clean

Layout: a namespace `nsim<PID>-sw` holds a bridge; node k is namespace `nsim<PID>-n<k>` with
interface `sim0` (address 10.213.X.k+1/24) whose veth peer `p<k>` sits on the bridge. Nothing is
added to the host's own network: the addresses exist only inside the namespaces made here, and
the subnet is one the host does not route. Each link is shaped on both of its ends' egress (the
node's `sim0`, the switch's `p<k>`): htb at the rate, netem below it for the delay; a node to node
packet crosses two links, so its one-way delay is twice `--delay` (netem, where the kernel
has it; without it only --delay 0 works).

Everything made is removed on exit: normal end, failure, Ctrl-C, SIGTERM, SIGHUP. A run killed
with SIGKILL leaves its namespaces; the next run (or `clean`) removes those whose tool is gone.
Needs root, `ip` and `tc` (iproute2), and `taskset` (util-linux) to pin each node to its cores.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from data_tools.errors import UserError  # noqa: E402

PREFIX = "nsim"
IFACE = "sim0"
BRIDGE = "br0"
PORT = 29500  # every cluster has its own network stack: a fixed port never clashes
NAME = re.compile(rf"^{PREFIX}(\d+)-(sw|n\d+)$")
STOP_GRACE_S = 45  # launch.sh's own stop: TERM to its ranks, KILL 30 s later


class Stopped(Exception):
    """A stop signal (SIGTERM, SIGHUP) arrived: unwind through the cleanup like Ctrl-C."""


# -- units ---------------------------------------------------------------------------------------

def parse_rate(text: str) -> int | None:
    """'200mbit' -> 200_000_000 bits/s; 'none' -> None (unshaped)."""
    if text.lower() in ("none", "0", "unshaped"):
        return None
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*(kbit|mbit|gbit)", text.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"rate {text!r}: expected e.g. 500kbit, 200mbit, 2.5gbit, or none")
    scale = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]
    return int(float(m.group(1)) * scale)


def parse_delay(text: str) -> float:
    """'1ms' -> 1.0, '200us' -> 0.2, '0' -> 0.0 (milliseconds)."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*(us|ms)?", text.strip().lower())
    if not m:
        raise UserError(f"delay {text!r}: expected e.g. 0.1ms, 200us or 0")
    value = float(m.group(1))
    return value / 1000 if m.group(2) == "us" else value


def rate_text(bits: int | None) -> str:
    if bits is None:
        return "none"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits}bit"


# -- iproute2 ------------------------------------------------------------------------------------

def ip(*args: str, ns: str | None = None, check: bool = True) -> str:
    return _tool("ip", args, ns, check)


def tc(*args: str, ns: str, check: bool = True) -> str:
    return _tool("tc", args, ns, check)


def _tool(name: str, args: tuple[str, ...], ns: str | None, check: bool) -> str:
    cmd = [name, *(["-n", ns] if ns else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise UserError(f"`{shlex.join(cmd)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def check_host() -> None:
    """Root and iproute2, else one line saying which is missing."""
    if os.geteuid() != 0:
        raise UserError("netsim needs root (it creates network namespaces and shapes links)")
    for tool in ("ip", "tc", "taskset"):
        if not any(Path(d, tool).is_file() for d in os.environ.get("PATH", "").split(":") + [
                "/usr/sbin", "/sbin"]):
            raise UserError(f"netsim needs `{tool}` (apt-get install iproute2 util-linux)")


def namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def pids_in(ns: str) -> list[int]:
    return [int(p) for p in ip("netns", "pids", ns, check=False).split() if p.isdigit()]


def remove_namespace(ns: str) -> None:
    """Kill what runs in it (a namespace outlives `ip netns del` while a process holds it), then
    delete it: its veth ends, the peers in other namespaces and its bridge go with it."""
    for _ in range(50):
        pids = pids_in(ns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    ip("netns", "del", ns, check=False)


def tool_alive(pid: int) -> bool:
    """Whether netsim process `pid` still runs (a reused pid running something else is not)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"netsim" in cmdline


def remove_leftovers(everything: bool = False) -> list[str]:
    """Namespaces of netsim runs that are gone (killed with SIGKILL), or all of netsim's."""
    gone = []
    for ns in namespaces():
        m = NAME.match(ns)
        if m and (everything or not tool_alive(int(m.group(1)))) and int(m.group(1)) != os.getpid():
            remove_namespace(ns)
            gone.append(ns)
    return gone


# -- the cluster ---------------------------------------------------------------------------------

def free_subnet() -> int:
    """X of a 10.213.X.0/24 the host neither has nor routes (the namespaces have their own
    stacks, but a clash would confuse anyone reading addresses)."""
    used = ip("-4", "addr", "show") + ip("-4", "route", "show", "table", "all")
    for x in range(0, 256):
        if f"10.213.{x}." not in used:
            return x
    raise UserError("no free 10.213.X.0/24 subnet on this host")


class Cluster:
    """N nodes on one switch; `with Cluster(...) as c:` builds it and always removes it."""

    def __init__(self, nodes: int, rate: int | None, delay_ms: float):
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.nodes = [f"{self.tag}-n{k}" for k in range(nodes)]
        self.rate, self.delay_ms = rate, delay_ms
        self.subnet = 0

    def addr(self, k: int) -> str:
        return f"10.213.{self.subnet}.{k + 1}"

    def __enter__(self) -> "Cluster":
        remove_leftovers()
        self.subnet = free_subnet()
        try:
            self.build()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def build(self) -> None:
        ip("netns", "add", self.switch)
        ip("link", "set", "lo", "up", ns=self.switch)
        ip("link", "add", BRIDGE, "type", "bridge", ns=self.switch)
        ip("link", "set", BRIDGE, "up", ns=self.switch)
        if self.delay_ms > 0:
            check_netem(self.switch)
        for k, ns in enumerate(self.nodes):
            ip("netns", "add", ns)
            ip("link", "set", "lo", "up", ns=ns)
            ip("link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", f"p{k}",
               "netns", self.switch)
            ip("link", "set", f"p{k}", "master", BRIDGE, "up", ns=self.switch)
            ip("addr", "add", f"{self.addr(k)}/24", "dev", IFACE, ns=ns)
            ip("link", "set", IFACE, "up", ns=ns)
            shape(ns, IFACE, self.rate, self.delay_ms)
            shape(self.switch, f"p{k}", self.rate, self.delay_ms)

    def remove(self) -> None:
        """Every namespace of this cluster, whatever state building or running left it in."""
        with signals_held():
            mine = set(namespaces())
            for ns in [*self.nodes, self.switch]:
                if ns in mine:
                    remove_namespace(ns)

    def qdiscs(self) -> str:
        """`tc qdisc show` of every shaped interface (what the run was shaped with)."""
        out = [tc("qdisc", "show", "dev", IFACE, ns=ns) for ns in self.nodes]
        out += [tc("qdisc", "show", "dev", f"p{k}", ns=self.switch)
                for k in range(len(self.nodes))]
        return "".join(out)


def check_netem(ns: str) -> None:
    """A kernel built without sch_netem (some VMs) cannot delay: one line saying so."""
    probe = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem",
                            "delay", "1ms"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise UserError(f"--delay: this kernel cannot delay packets (tc netem: "
                        f"{probe.stderr.strip() or probe.returncode}); use --delay 0")
    tc("qdisc", "del", "dev", "lo", "root", ns=ns)


def shape(ns: str, dev: str, rate: int | None, delay_ms: float) -> None:
    """Egress of `dev`: htb at `rate` (one class, all traffic), netem for the delay under it.
    The burst is at least 1 ms of the rate: veth hands over up to 64 KiB GSO packets."""
    netem = ["netem", "delay", f"{delay_ms}ms", "limit", "100000"] if delay_ms > 0 else []
    if rate is None:
        if netem:
            tc("qdisc", "add", "dev", dev, "root", "handle", "1:", *netem, ns=ns)
        return
    burst = max(131072, rate // 8 // 1000)
    tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1", ns=ns)
    tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", str(rate),
       "ceil", str(rate), "burst", str(burst), "cburst", str(burst), "quantum", "65536", ns=ns)
    if netem:
        tc("qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *netem, ns=ns)


# -- processes in the nodes ----------------------------------------------------------------------

STOPS = {signal.SIGTERM, signal.SIGHUP, signal.SIGINT}


@contextmanager
def stop_signals():
    """SIGTERM and SIGHUP raise Stopped (SIGINT raises KeyboardInterrupt) so the cleanup in
    `finally` runs."""
    def stop(signum, frame):
        raise Stopped(signal.Signals(signum).name)
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@contextmanager
def signals_held():
    """A cleanup is not cut short by a second Ctrl-C or SIGTERM: they wait until it is done."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)


def node_cores(k: int, per_node: int) -> str:
    """Node k's CPUs for taskset: consecutive blocks of `per_node`, wrapping around the box."""
    cpus = sorted(os.sched_getaffinity(0))
    return ",".join(str(cpus[(k * per_node + i) % len(cpus)]) for i in range(per_node))


def node_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"GLOO_SOCKET_IFNAME": IFACE, "OMP_NUM_THREADS": str(threads),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")])),
                "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled",
                "CUDA_VISIBLE_DEVICES": ""})
    env.update(extra or {})
    return env


def start(ns: str, cores: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """`cmd` in namespace `ns`, pinned to `cores`, in a session of its own (stopped as one)."""
    return subprocess.Popen(["ip", "netns", "exec", ns, "taskset", "-c", cores, *cmd],
                            env=env, cwd=REPO, start_new_session=True)


def wait_all(procs: list[subprocess.Popen], timeout: float | None) -> int:
    """The first non-zero exit status (then the others are stopped: they would wait for the
    failed node's collectives until gloo's timeout), else 0 once all ended."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            stop_all(procs)
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            stop_all(procs)
            print(f"netsim: timed out after {timeout:.0f} s", file=sys.stderr, flush=True)
            return 124
        time.sleep(0.2)


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to each node's launcher (it stops its own ranks), SIGKILL to its session after
    STOP_GRACE_S; Cluster.remove kills anything left in the namespaces."""
    with signals_held():
        _stop_all(procs)


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            _signal_session(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_session(p.pid, signal.SIGKILL)
            p.wait()


def _signal_session(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_nodes(cluster: Cluster, commands: list[list[str]], envs: list[dict[str, str]],
              cores_per_node: int, timeout: float | None) -> int:
    """Start one command a node, wait for all; stop them on any exit path."""
    procs: list[subprocess.Popen] = []
    try:
        for k, (ns, cmd, env) in enumerate(zip(cluster.nodes, commands, envs)):
            procs.append(start(ns, node_cores(k, cores_per_node), cmd, env))
        return wait_all(procs, timeout)
    finally:
        stop_all(procs)


# -- subcommands ---------------------------------------------------------------------------------

def launch_commands(cluster: Cluster, ppn: int, train_args: list[str], hostfile: Path
                    ) -> list[list[str]]:
    """`launch.sh --no-ssh` on every node, node 0's address as the master."""
    hostfile.write_text("".join(f"{cluster.addr(k)} slots={ppn}\n"
                                for k in range(len(cluster.nodes))))
    return [["bash", str(REPO / "launch.sh"), "--hostfile", str(hostfile), "--no-ssh",
             "--node-rank", str(k), "--master-addr", cluster.addr(0), "--master-port", str(PORT),
             "--", *train_args] for k in range(len(cluster.nodes))]


def run_app(nodes: int, ppn: int, rate: int | None, delay_ms: float, train_args: list[str],
            cores_per_node: int, threads: int | None, timeout: float | None,
            show_qdiscs: bool = False) -> int:
    """`app train` over launch.sh --no-ssh on a fresh cluster; launch.sh's exit status."""
    threads = threads or max(1, cores_per_node // ppn)
    with stop_signals(), Cluster(nodes, rate, delay_ms) as cluster, \
            tempfile.TemporaryDirectory(prefix="netsim-") as tmp:
        say(f"{nodes} node(s) x {ppn} rank(s), links {rate_text(rate)} / {delay_ms:g} ms, "
            f"{cores_per_node} core(s) a node, {threads} thread(s) a rank")
        if show_qdiscs:
            print(cluster.qdiscs(), end="", flush=True)
        commands = launch_commands(cluster, ppn, train_args, Path(tmp) / "hostfile")
        envs = [node_env(threads) for _ in commands]
        return run_nodes(cluster, commands, envs, cores_per_node, timeout)


def ddp_commands(cluster: Cluster, ppn: int, args: list[str]) -> tuple[list, list]:
    """bench/ddp_reference.py under torchrun's plain env:// variables, one launcher a node:
    torch.distributed.run with the node's rank (no DeepSpeed, no launch.sh)."""
    n = len(cluster.nodes)
    commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n),
                 "--nproc-per-node", str(ppn), "--node-rank", str(k), "--master-addr",
                 cluster.addr(0), "--master-port", str(PORT),
                 str(REPO / "bench" / "ddp_reference.py"), *args] for k in range(n)]
    return commands, [node_env(1) for _ in commands]


def run_ddp(nodes: int, ppn: int, rate: int | None, delay_ms: float, args: list[str],
            cores_per_node: int, threads: int | None, timeout: float | None) -> int:
    threads = threads or max(1, cores_per_node // ppn)
    with stop_signals(), Cluster(nodes, rate, delay_ms) as cluster:
        say(f"DDP reference: {nodes} node(s) x {ppn} rank(s), links {rate_text(rate)} / "
            f"{delay_ms:g} ms")
        commands, envs = ddp_commands(cluster, ppn, args)
        for env in envs:
            env["OMP_NUM_THREADS"] = str(threads)
        return run_nodes(cluster, commands, envs, cores_per_node, timeout)


def say(text: str) -> None:
    print(f"netsim: {text}", file=sys.stderr, flush=True)


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=2, help="namespaces, one a node (default 2)")
    p.add_argument("--procs-per-node", type=int, default=1, metavar="P",
                   help="ranks in each node (default 1)")
    p.add_argument("--rate", default="1gbit",
                   help="each link's rate, each way: e.g. 200mbit, 2.5gbit, none (default 1gbit)")
    p.add_argument("--delay", default="0",
                   help="each link's one-way delay (netem: a kernel without sch_netem refuses "
                        "any but 0); node to node crosses two links (default 0)")
    p.add_argument("--cores-per-node", type=int, default=None, metavar="C",
                   help="CPUs each node is pinned to (default: the box's cores shared by the "
                        "nodes, at least 1; nodes wrap around when there are more than cores)")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS a rank (default: its node's cores / ranks, at least 1)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="stop everything after S seconds (exit status 124)")


def cores_for(args: argparse.Namespace) -> int:
    if args.cores_per_node is not None:
        if args.cores_per_node < 1:
            raise UserError(f"--cores-per-node {args.cores_per_node}: at least 1")
        return args.cores_per_node
    return max(1, len(os.sched_getaffinity(0)) // args.nodes)


def check_cluster_args(args: argparse.Namespace) -> None:
    if not 1 <= args.nodes <= 64:
        raise UserError(f"--nodes {args.nodes}: between 1 and 64")
    if args.procs_per_node < 1:
        raise UserError(f"--procs-per-node {args.procs_per_node}: at least 1")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads {args.threads}: at least 1")


def rest(args: list[str]) -> list[str]:
    return args[1:] if args[:1] == ["--"] else args


def cmd_run(args: argparse.Namespace) -> int:
    check_cluster_args(args)
    train = rest(args.train_args)
    if not train:
        raise UserError("run: no app train arguments (netsim.py run [options] -- --data D "
                        "--out R ...)")
    return run_app(args.nodes, args.procs_per_node, parse_rate(args.rate),
                   parse_delay(args.delay), train, cores_for(args), args.threads, args.timeout,
                   show_qdiscs=args.show_qdiscs)


def cmd_ddp(args: argparse.Namespace) -> int:
    check_cluster_args(args)
    return run_ddp(args.nodes, args.procs_per_node, parse_rate(args.rate),
                   parse_delay(args.delay), rest(args.ddp_args), cores_for(args), args.threads,
                   args.timeout)


def cmd_clean(args: argparse.Namespace) -> int:
    gone = remove_leftovers(everything=args.all)
    say(f"removed {len(gone)} namespace(s){': ' + ', '.join(gone) if gone else ''}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/netsim.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="app train through launch.sh --no-ssh in every node")
    add_cluster_flags(r)
    r.add_argument("--show-qdiscs", action="store_true",
                   help="print the links' tc qdiscs before starting")
    r.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- TRAIN_ARGS")
    d = sub.add_parser("ddp", help="the plain PyTorch DDP reference (bench/ddp_reference.py)")
    add_cluster_flags(d)
    d.add_argument("ddp_args", nargs=argparse.REMAINDER, metavar="-- DDP_ARGS")
    c = sub.add_parser("clean", help="remove namespaces of netsim runs that were killed")
    c.add_argument("--all", action="store_true",
                   help="also those of runs still going (stops them)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        check_host()
        return {"run": cmd_run, "ddp": cmd_ddp, "clean": cmd_clean}[args.command](args)
    except UserError as e:
        print(f"netsim: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        say("interrupted; the cluster is removed")
        return 130
    except Stopped as e:
        say(f"stopped by {e}; the cluster is removed")
        return 143


if __name__ == "__main__":
    sys.exit(main())
