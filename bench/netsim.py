"""A simulated cluster on one box: N "nodes" as network namespaces, each joined to a switch by
its own link shaped with `tc` (rate and delay, both directions), and `launch.sh --no-ssh` started
in every one of them, so the ranks talk gloo over a real, slow network instead of loopback.

    python bench/netsim.py run --nodes 2 --rate 200mbit --delay 0.1ms -- --data D --out R ...
    python bench/netsim.py ddp --nodes 2 --rate 200mbit -- --data D --model bert-tiny ...
    python bench/netsim.py calibrate --data D -- --model bert-tiny --model-arg ...
    python bench/netsim.py collectives --out OUT --rates none,570mbit
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
with SIGKILL leaves its namespaces and its directory in the system's temp directory (the nodes'
TMPDIR: launch.sh's job directories, torchrun's log directories); the next run (or `clean`)
removes those whose tool is gone.
Needs root, `ip` and `tc` (iproute2), and `taskset` (util-linux) to pin each node to its cores.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app import child_pythonpath  # noqa: E402
from data_tools.errors import UserError  # noqa: E402

PREFIX = "nsim"
IFACE = "sim0"
BRIDGE = "br0"
NAME = re.compile(rf"^{PREFIX}(\d+)-(sw|n\d+)$")
SCRATCH = re.compile(r"^netsim-(\d+)-")  # a cluster's directory in the system's temp directory
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


def remove_leftovers(everything: bool = False) -> tuple[list[str], list[str]]:
    """Namespaces of netsim runs that are gone (killed with SIGKILL), or all of netsim's, and
    those runs' directories (`Cluster.scratch`): the namespaces and directories removed."""
    def left(m: re.Match | None) -> bool:
        return bool(m) and int(m.group(1)) != os.getpid() and (
            everything or not tool_alive(int(m.group(1))))

    spaces = [ns for ns in namespaces() if left(NAME.match(ns))]
    for ns in spaces:
        remove_namespace(ns)  # first: nothing runs in a directory removed below
    dirs = [str(p) for p in sorted(Path(tempfile.gettempdir()).glob("netsim-*"))
            if p.is_dir() and left(SCRATCH.match(p.name))]
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)
    return spaces, dirs


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
        # The rendezvous port. Each cluster has its own network stack, but DeepSpeed's CPU
        # all-reduce buffers of a one-node cluster are named by address and port in the shared
        # /dev/shm: a port of this run's own keeps concurrent runs apart.
        self.port = 20000 + os.getpid() % 40000
        self.scratch = Path()  # made by __enter__

    def addr(self, k: int) -> str:
        return f"10.213.{self.subnet}.{k + 1}"

    def __enter__(self) -> "Cluster":
        remove_leftovers()
        self.subnet = free_subnet()
        # The nodes' TMPDIR (run_nodes), named by this tool's pid: what the processes in them
        # make there (launch.sh's job directory, torchrun's log directories, which it never
        # removes) goes with the cluster, or with `clean` after a SIGKILL.
        self.scratch = Path(tempfile.mkdtemp(prefix=f"netsim-{os.getpid()}-"))
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
            for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{self.addr(0)}_"
                                              f"{self.port}_*"):
                path.unlink(missing_ok=True)  # DeepSpeed never unlinks them
            if self.scratch.name.startswith("netsim-"):
                shutil.rmtree(self.scratch, ignore_errors=True)

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
                "PYTHONPATH": child_pythonpath(),
                "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled",
                "CUDA_VISIBLE_DEVICES": ""})
    env.update(extra or {})
    return env


def start(ns: str, cores: str, cmd: list[str], env: dict[str, str], log=None
          ) -> subprocess.Popen:
    """`cmd` in namespace `ns`, pinned to `cores`, in a session of its own (stopped as one);
    its output to `log` (an open file) or this process's."""
    return subprocess.Popen(["ip", "netns", "exec", ns, "taskset", "-c", cores, *cmd],
                            env=env, cwd=REPO, start_new_session=True, stdout=log,
                            stderr=subprocess.STDOUT if log else None)


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
              cores_per_node: int, timeout: float | None, log: Path | None = None) -> int:
    """Start one command a node (TMPDIR: the cluster's directory), wait for all; stop them on
    any exit path."""
    procs: list[subprocess.Popen] = []
    sink = open(log, "ab") if log else None
    try:
        for k, (ns, cmd, env) in enumerate(zip(cluster.nodes, commands, envs)):
            env = {**env, "TMPDIR": str(cluster.scratch)}
            procs.append(start(ns, node_cores(k, cores_per_node), cmd, env, sink))
        return wait_all(procs, timeout)
    finally:
        stop_all(procs)
        if sink:
            sink.close()


# -- subcommands ---------------------------------------------------------------------------------

def launch_commands(cluster: Cluster, ppn: int, train_args: list[str], hostfile: Path
                    ) -> list[list[str]]:
    """`launch.sh --no-ssh` on every node, node 0's address as the master."""
    hostfile.write_text("".join(f"{cluster.addr(k)} slots={ppn}\n"
                                for k in range(len(cluster.nodes))))
    return [["bash", str(REPO / "launch.sh"), "--hostfile", str(hostfile), "--no-ssh",
             "--node-rank", str(k), "--master-addr", cluster.addr(0), "--master-port",
             str(cluster.port), "--", *train_args] for k in range(len(cluster.nodes))]


def run_app(nodes: int, ppn: int, rate: int | None, delay_ms: float, train_args: list[str],
            cores_per_node: int, threads: int | None, timeout: float | None,
            show_qdiscs: bool = False, log: Path | None = None) -> int:
    """`app train` over launch.sh --no-ssh on a fresh cluster; launch.sh's exit status."""
    threads = threads or max(1, cores_per_node // ppn)
    with stop_signals(), Cluster(nodes, rate, delay_ms) as cluster:
        say(f"{nodes} node(s) x {ppn} rank(s), links {rate_text(rate)} / {delay_ms:g} ms, "
            f"{cores_per_node} core(s) a node, {threads} thread(s) a rank")
        if show_qdiscs:
            print(cluster.qdiscs(), end="", flush=True)
        commands = launch_commands(cluster, ppn, train_args, cluster.scratch / "hostfile")
        envs = [node_env(threads) for _ in commands]
        return run_nodes(cluster, commands, envs, cores_per_node, timeout, log)


def ddp_commands(cluster: Cluster, ppn: int, args: list[str]) -> tuple[list, list]:
    """bench/ddp_reference.py under torchrun's plain env:// variables, one launcher a node:
    torch.distributed.run with the node's rank (no DeepSpeed, no launch.sh)."""
    n = len(cluster.nodes)
    commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n),
                 "--nproc-per-node", str(ppn), "--node-rank", str(k), "--master-addr",
                 cluster.addr(0), "--master-port", str(cluster.port),
                 str(REPO / "bench" / "ddp_reference.py"), *args] for k in range(n)]
    return commands, [node_env(1) for _ in commands]


def run_ddp(nodes: int, ppn: int, rate: int | None, delay_ms: float, args: list[str],
            cores_per_node: int, threads: int | None, timeout: float | None,
            log: Path | None = None) -> int:
    threads = threads or max(1, cores_per_node // ppn)
    with stop_signals(), Cluster(nodes, rate, delay_ms) as cluster:
        say(f"DDP reference: {nodes} node(s) x {ppn} rank(s), links {rate_text(rate)} / "
            f"{delay_ms:g} ms")
        commands, envs = ddp_commands(cluster, ppn, args)
        for env in envs:
            env["OMP_NUM_THREADS"] = str(threads)
        return run_nodes(cluster, commands, envs, cores_per_node, timeout, log)


# -- scale: the app's data parallelism against plain DDP on shaped links ---------------------------

SYSTEMS = ("ddp", "zero0", "zero1", "zero2", "diloco")
"""`diloco`: the app's low-communication mode (--dp-mode diloco at ZeRO-1, an island a node,
--outer-every from `--outer-every`); its 1-node reference is the synchronous ZeRO-1 run (one
island alone is refused), the same compute a step."""
TCP_PAYLOAD_SHARE = 1448 / 1514
"""The share of an htb-shaped rate that carries data: htb counts each frame's 1,514 bytes
(Ethernet header, IP and TCP headers with timestamps) for 1,448 bytes of payload (measured: an
all-reduce at 570 Mbit/s moves its bytes at 0.95 of the rate; docs/plan.md)."""


def model_flags(args: argparse.Namespace) -> list[str]:
    """The model and batch flags app train and ddp_reference.py share."""
    flags = ["--model", args.model, "--seq-len", str(args.seq_len), "--micro-batch",
             str(args.micro_batch)]
    for item in args.model_arg:
        flags += ["--model-arg", item]
    return flags


def measure(system: str, nodes: int, rate: int | None, args: argparse.Namespace,
            out: Path, tag: str) -> dict:
    """One run, `nodes` x 1 rank, 1 core a node: its tokens/s and step time."""
    run_dir = out / "runs" / tag
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    if system == "ddp":
        result_file = run_dir.with_suffix(".json")
        rc = run_ddp(nodes, 1, rate, args.delay_ms,
                     ["--data", str(args.data), *model_flags(args), "--steps", str(args.steps),
                      "--buckets", str(args.buckets), "--out", str(result_file)],
                     1, 1, args.timeout, log=run_dir.with_suffix(".log"))
        if rc != 0:
            return {"error": f"exit {rc} (log: {run_dir.with_suffix('.log')})"}
        got = json.loads(result_file.read_text())
        return {"tokens_per_sec": got["tokens_per_sec"], "step_time_ms": got["step_time_ms"]}
    from app.sweep.results import run_figures

    # logged 4 times a run, as a user logs (every 10-100 steps), not every step: a log step's
    # telemetry collectives cross the shaped link, which the DDP reference has none of
    stage = "1" if system == "diloco" else system[-1]
    mode = ["--dp-mode", "diloco", "--outer-every", str(args.outer_every)] \
        if system == "diloco" and nodes > 1 else []
    train = ["--data", str(args.data), "--out", str(run_dir), *model_flags(args), "--zero",
             stage, *mode, "--max-steps", str(args.steps), "--log-every",
             str(max(1, args.steps // 4)), "--eval-samples", "1", "--save-every", "0",
             "--wandb", "disabled", "--resume", "never", "--num-workers", "0", "--overwrite",
             *args.train_args]
    rc = run_app(nodes, 1, rate, args.delay_ms, train, 1, 1, args.timeout,
                 log=run_dir.with_suffix(".log"))
    if rc != 0:
        return {"error": f"exit {rc} (log: {run_dir.with_suffix('.log')})"}
    figures = run_figures(run_dir, nodes)
    return {k: figures.get(k) for k in ("tokens_per_sec", "step_time_ms", "optimizer_ms",
                                        "forward_ms")}


def allreduce_ms(rate: int | None, args: argparse.Namespace, out: Path) -> float:
    """One raw all-reduce of the fp32 gradients between 2 nodes at `rate` (median, ms)."""
    result_file = out / f"allreduce-{rate_text(rate)}.json"
    rc = run_ddp(2, 1, rate, args.delay_ms,
                 ["--data", str(args.data), *model_flags(args), "--steps", "8",
                  "--allreduce-only", "--out", str(result_file)], 1, 1, args.timeout,
                 log=result_file.with_suffix(".log"))
    if rc != 0:
        raise UserError(f"the all-reduce probe at {rate_text(rate)} failed (exit {rc})")
    return json.loads(result_file.read_text())["allreduce_ms"]


COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")


def collective_worker(argv: list[str]) -> int:
    """One rank of `netsim.py collectives` (started in a node with env:// variables): times
    each collective at each size (fp32, the whole tensor's bytes) with wall and process CPU
    clocks (the process's CPU: gloo's threads' copies, sums and socket calls), rank 0 writes
    the medians as JSON."""
    import torch
    import torch.distributed as dist

    out, repeats, sizes = Path(argv[0]), int(argv[1]), [int(x) for x in argv[2:]]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank, rows = dist.get_world_size(), dist.get_rank(), []
    for nbytes in sizes:
        full = torch.ones(max(world, nbytes // 4 // world * world))
        part = torch.ones(full.numel() // world)
        calls = {"all-reduce": lambda full=full: dist.all_reduce(full),
                 "reduce-scatter": lambda full=full, part=part: dist.reduce_scatter_tensor(
                     part, full),
                 "all-gather": lambda full=full, part=part: dist.all_gather_into_tensor(
                     full, part)}
        for kind in COLLECTIVES:
            wall, cpu = [], []
            for _ in range(repeats + 1):  # the first call sets up the pairs' buffers
                dist.barrier()
                w0, c0 = time.perf_counter(), time.process_time()
                calls[kind]()
                wall.append(time.perf_counter() - w0)
                cpu.append(time.process_time() - c0)
            rows.append({"kind": kind, "bytes": full.numel() * 4,
                         "wall_ms": 1000 * statistics.median(wall[1:]),
                         "cpu_ms": 1000 * statistics.median(cpu[1:])})
    dist.barrier()
    if rank == 0:
        write_json(out, {"world": world, "rows": rows})
    from ddp_reference import leave_without_teardown  # this script's folder: bench/

    leave_without_teardown()


def time_collectives(nodes: int, rate: int | None, sizes: list[int], repeats: int,
                     out: Path, timeout: float | None = 600) -> dict:
    """Each collective at each size between `nodes` nodes (1 rank, 1 core a node) at `rate`:
    {"world", "rows": [{"kind", "bytes", "wall_ms", "cpu_ms"}]}."""
    result = out / f"collectives-{nodes}node-{rate_text(rate)}.json"
    with stop_signals(), Cluster(nodes, rate, 0.0) as cluster:
        # One rank a node needs no torch.distributed.run: the rank itself, with the env://
        # variables the launcher would give it (the launcher's imports are ~2.5 CPU-s a node)
        commands = [[sys.executable, str(Path(__file__)), "_collective-worker", str(result),
                     str(repeats), *map(str, sizes)] for _ in range(nodes)]
        envs = [node_env(1, {"RANK": str(k), "LOCAL_RANK": "0", "WORLD_SIZE": str(nodes),
                             "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": cluster.addr(0),
                             "MASTER_PORT": str(cluster.port)}) for k in range(nodes)]
        rc = run_nodes(cluster, commands, envs, 1, timeout, result.with_suffix(".log"))
    if rc != 0:
        raise UserError(f"the collectives probe at {rate_text(rate)} failed (exit {rc}; log: "
                        f"{result.with_suffix('.log')})")
    return json.loads(result.read_text())


def calibrate(args: argparse.Namespace, out: Path) -> tuple[int, dict]:
    """The rate at which one all-reduce of the fp32 gradients takes one 1-node step: the 1-node
    step of the DDP reference and the all-reduce at a probe rate, both measured; gloo's
    all-reduce time between 2 nodes is its bytes over the rate (plus a latency that is small
    at these sizes), so the rate scales by their ratio."""
    step = measure("ddp", 1, None, args, out, "calibrate-ddp-1node")
    if "error" in step:
        raise UserError(f"calibration: the 1-node DDP run failed ({step['error']})")
    probe = parse_rate(args.probe_rate)
    ar = allreduce_ms(probe, args, out)
    rate = int(probe * ar / step["step_time_ms"])
    facts = {"step_ms_1node": step["step_time_ms"], "probe_rate": rate_text(probe),
             "allreduce_ms_at_probe": ar, "rate_comm_equals_compute": rate_text(rate)}
    say(f"calibration: 1-node step {step['step_time_ms']:.0f} ms, all-reduce "
        f"{ar:.0f} ms at {rate_text(probe)} -> comm = compute at {rate_text(rate)}")
    return rate, facts


def scale_rates(args: argparse.Namespace, out: Path) -> tuple[list[int | None], dict]:
    if args.rates:
        return [parse_rate(r) for r in args.rates.split(",")], {}
    base, facts = calibrate(args, out)
    ratios = [float(r) for r in args.ratios.split(",")]
    # comm / compute = r  ->  rate = base / r (rounded to whole Mbit/s)
    rates: list[int | None] = [max(10**6, round(base / r / 1e6) * 10**6) for r in ratios]
    return rates + [None] * args.unshaped, facts


def one_repeat(rep: int, rates: list[int | None], args: argparse.Namespace, out: Path,
               runs: list[dict]) -> None:
    """Each system's 1-node run, then its 2-node runs at every rate, back to back (compared
    runs close in time); the systems' order reversed on every other repeat."""
    systems = args.systems if rep % 2 == 0 else args.systems[::-1]
    for system in systems:
        for nodes, rate in [(1, None), *[(2, r) for r in rates]]:
            tag = f"r{rep}-{system}-{nodes}node-{rate_text(rate) if nodes > 1 else 'local'}"
            say(f"repeat {rep + 1}/{args.repeats}: {system}, {nodes} node(s)"
                f"{', ' + rate_text(rate) if nodes > 1 else ''}")
            got = measure(system, nodes, rate, args, out, tag)
            runs.append({"repeat": rep, "system": system, "nodes": nodes,
                         "rate": rate_text(rate) if nodes > 1 else None, **got})
            write_json(out / "scale.json", {"runs": runs})


def efficiencies(runs: list[dict], systems: list[str], rates: list[int | None]) -> dict:
    """{system: {rate: [efficiency of each repeat]}}: 2-node tokens/s / (2 x the same repeat's
    1-node tokens/s)."""
    one = {(r["repeat"], r["system"]): r.get("tokens_per_sec") for r in runs if r["nodes"] == 1}
    out: dict = {s: {rate_text(x): [] for x in rates} for s in systems}
    for r in runs:
        base = one.get((r["repeat"], r["system"]))
        if r["nodes"] == 2 and base and r.get("tokens_per_sec"):
            out[r["system"]][r["rate"]].append(r["tokens_per_sec"] / (2 * base))
    return out


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def plan_scaling(args: argparse.Namespace, compute: tuple[float, ...], rate: int | None,
                 help_text: str, extra: tuple[str, ...] = ()) -> dict[str, float] | None:
    """The planner's predicted 2-node efficiency per ZeRO stage at `rate` (`app plan
    --compute-ms M --net-gbps G --nodes 2 --json`), or None when it says nothing usable.
    `compute`: the measured 1-node step, and where the run logged them its optimizer step and
    forward pass (--step-ms, --forward-ms). The run's own facts go with it where the planner
    takes them: fp32, the CPU accelerator's overlap, the dataset's vocabulary."""
    from data_tools.manifest import load_manifest

    compute_ms, step_ms, forward_ms = (*compute, None, None)[:3]
    cmd = [*model_flags(args), "--gpus", "2",
           "--gpus-per-node", "1", "--nodes", "2", "--compute-ms", f"{compute_ms:.1f}",
           "--net-gbps", f"{(rate or 100e9) * TCP_PAYLOAD_SHARE / 1e9:g}", "--json", *extra]
    for flag, value in (("--precision", "fp32"), ("--device-kind", "cpu"),
                        ("--vocab-size", str(load_manifest(args.data)["vocab_size"])),
                        ("--step-ms", step_ms and f"{step_ms:.1f}"),
                        ("--forward-ms", forward_ms and f"{forward_ms:.1f}")):
        if flag in help_text and value:
            cmd += [flag, value]
    code, stdout = app_plan(cmd)
    if code != 0:
        return None
    try:
        plan = json.loads(stdout)
    except ValueError:
        return None
    return {"efficiency": stage_efficiency(plan), "step_ms": stage_efficiency(plan, "step_ms")}


def app_plan(argv: list[str]) -> tuple[int, str]:
    """`python -m app plan ARGV` run in this process: its exit status and what it printed. The
    planner is arithmetic on its flags (no device, no environment, no state kept), so this is
    the command's output without a process of its own, whose imports cost ~6 s a call."""
    import contextlib
    import io

    from app.__main__ import main as app_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = app_main(["plan", *argv])
        except SystemExit as e:  # argparse: --help, a usage error
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return int(code or 0), out.getvalue()


def stage_efficiency(plan, key: str = "efficiency") -> dict[str, float]:
    """{"zero0": efficiency (or `key`) at 2 nodes, ...} from wherever the plan's JSON puts
    per-stage `scaling` lists (a dict keyed by stage, or entries carrying `zero`/`stage`)."""
    found: dict[str, float] = {}

    def walk(node, stage):
        if isinstance(node, dict):
            if node.get("offload"):
                return
            named = next((node[k] for k in ("zero_stage", "stage", "zero") if k in node), None)
            digit = re.search(r"[0-3]", str(named)) if named is not None else None
            stage = digit.group(0) if digit else stage
            for name, value in node.items():
                sub = name[-1] if re.fullmatch(r"(zero|stage)[-_ ]?[0-3]", str(name)) else stage
                if name == "scaling" and isinstance(value, list) and stage is not None:
                    for row in value:
                        if isinstance(row, dict) and row.get("nodes") == 2 and key in row:
                            found[f"zero{stage}"] = float(row[key])
                else:
                    walk(value, sub)
        elif isinstance(node, list):
            for value in node:
                walk(value, stage)
    walk(plan, None)
    return found


def planned(args: argparse.Namespace, runs: list[dict], rates: list[int | None]
            ) -> tuple[dict, dict]:
    """({rate: {stage: predicted efficiency}}, {rate: {stage: predicted 2-node step ms}}) with
    each stage's own measured 1-node step, optimizer step and forward pass (medians over the
    repeats) as its compute (ZeRO-0's for a stage not measured, where ZeRO-0 was; else the
    measured stages only); empty (and a note) when the planner has no network model."""
    if not args.plan:
        return {}, {}
    help_text = app_plan(["--help"])[1]
    if "--compute-ms" not in help_text or "--net-gbps" not in help_text:
        say("--plan: this app's `app plan` has no --compute-ms/--net-gbps; no planned curve")
        return {}, {}
    ones: dict[str, list[dict]] = {}
    for r in runs:
        if r["nodes"] == 1 and r["system"] != "ddp" and r.get("step_time_ms"):
            ones.setdefault(r["system"], []).append(r)
    own = {s: one_node_compute(v) for s, v in ones.items()}
    diloco_compute = own.get("diloco") or own.get("zero1")  # its 1-node run: sync ZeRO-1
    if "zero0" in own:
        own = {s: own.get(s, own["zero0"]) for s in ("zero0", "zero1", "zero2")}
    eff: dict = {}
    step: dict = {}
    for rate in rates:
        for compute in sorted(set(own.values())):  # one plan per distinct compute
            got = plan_scaling(args, compute, rate, help_text) or {}
            for stage in (s for s, c in own.items() if c == compute):
                for key, into in (("efficiency", eff), ("step_ms", step)):
                    value = got.get(key, {}).get(stage)
                    if value is not None:
                        into.setdefault(rate_text(rate), {})[stage] = value
        if "diloco" in args.systems and "--dp-mode" in help_text and diloco_compute:
            # the low-communication mode at ZeRO-1, its compute its 1-node run's (sync ZeRO-1)
            got = plan_scaling(args, diloco_compute, rate, help_text,
                               ("--dp-mode", "diloco", "--outer-every", str(args.outer_every))
                               ) or {}
            for key, into in (("efficiency", eff), ("step_ms", step)):
                value = got.get(key, {}).get("zero1")
                if value is not None:
                    into.setdefault(rate_text(rate), {})["diloco"] = value
    return eff, step


def one_node_compute(runs: list[dict]) -> tuple[float, ...]:
    """(step ms, optimizer ms, forward ms), medians of a system's 1-node runs; the step alone
    where the runs logged no optimizer or forward time."""
    out = []
    for key in ("step_time_ms", "optimizer_ms", "forward_ms"):
        values = [r[key] for r in runs if r.get(key) is not None]
        if len(values) < len(runs):
            break
        out.append(statistics.median(values))
    return tuple(out)


def measured_steps(runs: list[dict]) -> dict:
    """{rate: {system: median 2-node step ms}} over the repeats."""
    out: dict = {}
    for r in runs:
        if r["nodes"] == 2 and r.get("step_time_ms"):
            out.setdefault(r["rate"], {}).setdefault(r["system"], []).append(r["step_time_ms"])
    return {rate: {s: statistics.median(v) for s, v in by.items()} for rate, by in out.items()}


def table(eff: dict, plan: dict, rates: list[int | None], comm: dict,
          steps: tuple[dict, dict] = ({}, {})) -> str:
    """Markdown: one row a rate, the median efficiency (and each repeat's) per system; the
    plan's efficiency and 2-node step against the measured median step."""
    systems = list(eff)
    head = ["rate", "all-reduce / 1-node step", *[LABEL.get(s, s) for s in systems]]
    if plan:
        head += [f"plan {LABEL[s]}" for s in PLANNED if s in systems or s != "diloco"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rate in map(rate_text, rates):
        cells = [rate, f"{comm[rate]:.2f}" if rate in comm else "-"]
        for s in systems:
            v = eff[s][rate]
            cells.append(f"{statistics.median(v):.2f} ({', '.join(f'{x:.2f}' for x in v)})"
                         if v else "failed")
        if plan:
            cells += [plan_cell(rate, s, plan, *steps) for s in PLANNED
                      if s in systems or s != "diloco"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plan_cell(rate: str, system: str, plan: dict, plan_steps: dict, measured: dict) -> str:
    if system not in plan.get(rate, {}):
        return "-"
    cell = f"{plan[rate][system]:.2f}"
    step, real = plan_steps.get(rate, {}).get(system), measured.get(rate, {}).get(system)
    if step and real:
        cell += f" ({step:,.0f} ms; measured {real:,.0f}, {step / real - 1:+.0%})"
    return cell


PLANNED = ("zero0", "zero1", "zero2", "diloco")  # the systems the plan predicts
LABEL = {"ddp": "DDP", "zero0": "app ZeRO-0", "zero1": "app ZeRO-1", "zero2": "app ZeRO-2",
         "diloco": "app diloco"}


def plot(path: Path, eff: dict, plan: dict, rates: list[int | None]) -> None:
    """Efficiency against the link rate: measured (median, repeats as points), planned dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted(rates, key=lambda r: r or 100e9)  # left to right, unshaped last
    xs = [(r or 100e9) / 1e6 for r in rates]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (system, by_rate) in enumerate(eff.items()):
        color = f"C{i}"
        meds = [statistics.median(by_rate[rate_text(r)]) if by_rate[rate_text(r)] else None
                for r in rates]
        ax.plot([x for x, m in zip(xs, meds) if m is not None], [m for m in meds if m is not None],
                "o-", color=color, label=LABEL.get(system, system))
        for x, r in zip(xs, rates):
            ax.plot([x] * len(by_rate[rate_text(r)]), by_rate[rate_text(r)], ".", color=color,
                    alpha=0.4)
        pred = [plan.get(rate_text(r), {}).get(system) for r in rates]
        if any(p is not None for p in pred):
            ax.plot([x for x, p in zip(xs, pred) if p is not None],
                    [p for p in pred if p is not None], "--", color=color,
                    label=f"{LABEL.get(system, system)} (plan)")
    ax.set_xscale("log")
    ax.set_xlabel("link rate, Mbit/s each way")
    ax.set_ylabel("scaling efficiency, 2 nodes x 1 rank")
    ax.set_ylim(0, 1.05)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.legend(fontsize=8)
    ax.set_title("Simulated cluster (bench/netsim.py scale)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_scale(args: argparse.Namespace) -> int:
    check_scale_args(args)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with stop_signals():
        rates, facts = scale_rates(args, out)
        comm = {}
        for r in rates:  # the regime each rate is in, measured
            comm[rate_text(r)] = allreduce_ms(r, args, out) / facts["step_ms_1node"] \
                if facts else None
        comm = {k: v for k, v in comm.items() if v is not None}
        runs: list[dict] = []
        for rep in range(args.repeats):
            one_repeat(rep, rates, args, out, runs)
    eff = efficiencies(runs, args.systems, rates)
    plan, plan_steps = planned(args, runs, rates)
    steps = measured_steps(runs)
    text = table(eff, plan, rates, comm, (plan_steps, steps))
    result = {"command": shlex.join(sys.argv), "calibration": facts, "comm_over_compute": comm,
              "rates": [rate_text(r) for r in rates], "efficiency": eff, "plan": plan,
              "plan_step_ms": plan_steps, "step_ms_2node": steps,
              "runs": runs, "model": model_flags(args), "steps": args.steps,
              "repeats": args.repeats}
    write_json(out / "scale.json", result)
    (out / "scale.md").write_text(text)
    plot(out / "scale.png", eff, plan, rates)
    print(text, end="", flush=True)
    say(f"results in {out}/scale.json, scale.md, scale.png")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    check_scale_args(args)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with stop_signals():
        rate, facts = calibrate(args, out)
    print(json.dumps(facts), flush=True)
    return 0


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x: (a, b)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - b * mx, b


def collective_fits(rows: list[dict]) -> dict:
    """Per collective, wall and CPU time as a latency plus a cost per MB of the whole tensor:
    {kind: {"latency_ms", "ms_per_mb", "cpu_latency_ms", "cpu_ms_per_mb"}}."""
    out = {}
    for kind in COLLECTIVES:
        mine = [r for r in rows if r["kind"] == kind]
        if len(mine) < 2:
            continue
        mb = [r["bytes"] / 1e6 for r in mine]
        a, b = fit_line(mb, [r["wall_ms"] for r in mine])
        ca, cb = fit_line(mb, [r["cpu_ms"] for r in mine])
        out[kind] = {"latency_ms": a, "ms_per_mb": b, "cpu_latency_ms": ca, "cpu_ms_per_mb": cb}
    return out


def cmd_collectives(args: argparse.Namespace) -> int:
    """Time the primitives the planner's network model uses, per rate (module `collectives`
    subcommand): JSON with every timing and the fitted latency and cost per MB."""
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(float(x) * 1e6) for x in args.sizes_mb.split(",")]
    if not sizes or min(sizes) < 4 * args.nodes or args.repeats < 1:
        raise UserError("--sizes-mb: sizes above 0; --repeats at least 1")
    got = {}
    for rate in [parse_rate(r) for r in args.rates.split(",")]:
        timed = time_collectives(args.nodes, rate, sizes, args.repeats, out)
        got[rate_text(rate)] = {**timed, "fit": collective_fits(timed["rows"])}
        for r in timed["rows"]:
            say(f"{rate_text(rate)}: {r['kind']} {r['bytes'] / 1e6:.2f} MB: "
                f"{r['wall_ms']:.1f} ms wall, {r['cpu_ms']:.1f} ms CPU")
    write_json(out / "collectives.json", got)
    print(json.dumps({k: v["fit"] for k, v in got.items()}, indent=1), flush=True)
    return 0


def check_scale_args(args: argparse.Namespace) -> None:
    args.delay_ms = parse_delay(args.delay)
    args.train_args = rest(args.train_args)
    args.systems = [s.strip() for s in args.systems.split(",")]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad:
        raise UserError(f"--systems {bad[0]!r}: choose from {', '.join(SYSTEMS)}")
    if not args.data.is_dir():
        raise UserError(f"--data {args.data}: no such dataset directory")
    if args.steps < 4 or getattr(args, "repeats", 1) < 1:
        raise UserError("--steps at least 4 and --repeats at least 1")


def add_scale_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", type=Path, required=True, help="dataset (data_tools prepare, MLM)")
    p.add_argument("--out", type=Path, required=True, help="where results and runs go")
    p.add_argument("--model", default="bert-tiny")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="steps a run (default 20)")
    p.add_argument("--buckets", type=int, default=8, help="DDP's gradient buckets (default 8)")
    p.add_argument("--outer-every", type=int, default=20,
                   help="the diloco system's steps between syncs, H (default 20)")
    p.add_argument("--systems", default=",".join(SYSTEMS[:4]),
                   help=f"what to measure, of {','.join(SYSTEMS)} (default "
                        f"{','.join(SYSTEMS[:4])})")
    p.add_argument("--delay", default="0", help="each link's one-way delay (default 0)")
    p.add_argument("--probe-rate", default="200mbit",
                   help="rate the calibration's all-reduce is timed at (default 200mbit)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a run (default 1800)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- TRAIN_ARGS",
                   help="more app train flags for the app's runs")


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
    spaces, dirs = remove_leftovers(everything=args.all)
    say(f"removed {len(spaces)} namespace(s){': ' + ', '.join(spaces) if spaces else ''}"
        f" and {len(dirs)} director{'y' if len(dirs) == 1 else 'ies'}"
        f"{': ' + ', '.join(dirs) if dirs else ''}")
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
    s = sub.add_parser("scale", help="2-node scaling efficiency: app ZeRO 0/1/2 vs plain DDP, "
                                     "per link rate; table, JSON, PNG")
    add_scale_flags(s)
    s.add_argument("--rates", help="link rates, e.g. 100mbit,400mbit,none (else --calibrate)")
    s.add_argument("--calibrate", action="store_true",
                   help="pick the rates by measuring: comm/compute = each of --ratios")
    s.add_argument("--ratios", default="0.5,1,2",
                   help="with --calibrate: one all-reduce of the fp32 gradients over one 1-node "
                        "step, one rate each (default 0.5,1,2)")
    s.add_argument("--unshaped", action="store_true",
                   help="with --calibrate: the unshaped link too, after the calibrated rates")
    s.add_argument("--repeats", type=int, default=2, help="rounds, interleaved (default 2)")
    s.add_argument("--plan", action="store_true",
                   help="draw app plan's predicted efficiency too (needs app plan --compute-ms "
                        "and --net-gbps; skipped with a note otherwise)")
    cal = sub.add_parser("calibrate", help="the rate where one all-reduce of the fp32 gradients "
                                           "takes one 1-node step")
    add_scale_flags(cal)
    k = sub.add_parser("collectives", help="time all-reduce, reduce-scatter and all-gather "
                                           "between nodes per rate: the planner's primitives")
    k.add_argument("--out", type=Path, required=True, help="where collectives.json goes")
    k.add_argument("--nodes", type=int, default=2, help="nodes, 1 rank and 1 core each")
    k.add_argument("--rates", default="none", help="link rates, e.g. none,570mbit")
    k.add_argument("--sizes-mb", default="0.25,1.15,4.6,9.2",
                   help="whole-tensor sizes, MB (default 0.25,1.15,4.6,9.2)")
    k.add_argument("--repeats", type=int, default=5, help="timed calls a size (default 5)")
    c = sub.add_parser("clean", help="remove the namespaces and directories of netsim runs that "
                                      "were killed")
    c.add_argument("--all", action="store_true",
                   help="also those of runs still going (stops them)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_collective-worker"]:  # a rank inside a node (time_collectives)
        return collective_worker(argv[1:])
    args = parser().parse_args(argv)
    try:
        check_host()
        return {"run": cmd_run, "ddp": cmd_ddp, "clean": cmd_clean, "scale": cmd_scale,
                "calibrate": cmd_calibrate, "collectives": cmd_collectives}[args.command](args)
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
