"""Benchmark: the app's trainer against a plain PyTorch loop on one device, MFU and host syncs.

The first GPU hour should say in one command whether the app is as fast as the hardware lets a
plain loop be, and if not, why. Per model (bert-120m, bert-350m, gpt-125m at seq 512; --cpu:
bert-tiny and gpt-tiny at seq 128), in one process so outside load hits both sides alike:

- the app side is the app's own Trainer (app.build's `build`: the real DeepSpeed engine, its
  default ZeRO stage, precision and optimizer for the device, its loader, guards and telemetry,
  and its log step every --block steps as `fit` runs it);
- the plain side is the same model (the app's settled config, same seed) on the same loader's
  batches: on a GPU bf16 autocast over fp32 weights (GPT's chunked loss too: its weight
  gradient's in-place product follows autocast, app/models/losses.py `autocast_dtype`), torch's
  fused AdamW, a foreach clip, the loss kept on the device and read at the log step only; on CPU
  fp32 and torch's AdamW;
- they take turns in blocks (bench/bench_step.py's `alternate`), each block between two device
  syncs; the medians of the blocks' ms/step are compared.

It reports tokens/s and MFU (app/telemetry/flops.py over the peak of app/telemetry/hardware.py),
the app / plain ratio, device busy % (the device work a step in a torch.profiler trace of a few
steps, the union of their kernel and copy intervals over the number of steps, over the unprofiled
ms/step of the timed blocks; on CPU the main thread's ops; beside it, as information, the same
union over the profiled span's wall time, which the profiler's own host cost stretches), every
host-sync call site of the app's steps (split into ordinary and log steps), and the app's data
wait over the timed blocks beside the app's own log of the same steps. Verdicts: the ratio and
busy % against the figures recorded for this device, model and setup (`BASELINES`, within `SLACK`;
where none is recorded, SKIP: not judged), data wait <= 1 %, no host sync in an ordinary step.
On a GPU a FAIL makes the exit status 1; on CPU (--cpu) they are informative (exit 0 unless
something crashed) unless --strict. With 2+ GPUs: an NCCL all-reduce bus bandwidth line and the
transport NCCL chose.

    python bench/gpu_mfu.py [--quick] [--out DIR]        # on a GPU node; ~8 min, --quick ~2 min
    python bench/gpu_mfu.py --cpu --quick                # CI: tiny models on CPU, a few minutes
    python bench/gpu_mfu.py --probe                      # flash-attn and FusedAdam lines only
    python bench/gpu_mfu.py --attn flex --packing doc-packed   # FlexAttention on packed documents

Everything lands in DIR/gpu_mfu.json (default runs/gpu_mfu) with the profiler traces; the last
line printed is the app / plain ratio. `--json FILE` also writes the figures in short,
`{"models": {NAME: {"mfu", "app_ms", "plain_ms", ...}}}` (MFU a fraction of the device's dense
peak, the app side's; null where no peak is known, as on CPU).
"""
from __future__ import annotations

import os
import sys

if "--cpu" in sys.argv[1:]:  # before torch and DeepSpeed pick their accelerator
    os.environ.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterable  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from app import child_pythonpath  # noqa: E402
from bench._forking import fork_call, wait_exit  # noqa: E402

# bench.bench_compile_attn (torch.compile's modules), bench_loader and bench_step (the app's build,
# transformers) are imported where used: `--probe` (bench/gpu_check.sh's first check, a fresh
# process) needs only torch and DeepSpeed

VOCABS = {"bert": 30522, "gpt": 50257}  # bert-base-uncased's and GPT-2's
THRESHOLDS = {"data_wait_pct": 1.0, "syncs_per_step": 0}

# The ratio and busy % are judged against what this benchmark measured before on the same device,
# model and setup (docs/benchmarks.md, "GPU: first runs on one H100", "GPU: second runs on one
# H200" and "GPU: third runs on one H200"; torch 2.11, DeepSpeed 0.19.8), not against fixed
# limits: a limit of 1.03 x against the measured 0.85-0.88 x let a 17 % regression of the app
# pass, and busy >= 95 % against the measured 95.8 % would flap (review gpu-path-2 m-6). Keys:
# (device as torch names it, model, seq, micro batch, precision, ZeRO stage, --compile). Values:
# each run's figure; the gate is the worst of them with SLACK.
#
# busy_pct is the figure in its current form (`busy_from_trace`: the trace's device work a step
# over the unprofiled ms/step). Its H200 ZeRO-1 values: the two runs of 2026-11-29 (gpu_check's
# and a second --quick minutes later), computed the new way from their traces: 59.64 and 59.57 ms
# of device work a step over 61.95 and 61.96 ms unprofiled (their plain loops 97.3 and 97.3 %);
# and the first run of this code, a --quick on a fresh H200 the same day: 60.79 ms over 63.49 ms
# (plain 96.6 %; both sides ~2.5 % slower on that machine).
# The figure recorded before (95.8 % on 2026-11-27) was the span form, the union over the
# profiled steps' wall time: the same traces gave 65.3 and 55.6 % (plain 96.8 and 87.0 %), as the
# profiler slowed the host (autograd's thread in BF16_Optimizer's per-weight grad hook) to 93-107
# ms a step while the device's work stayed ~60 ms. Busy is left out where it has no recorded run
# in the current form: the H100, ZeRO-2 (72.8 and 44.6 % in the span form, the profiler's; the
# unprofiled step is 90 % device work) and --compile (97.9 % on 2026-11-27 and 97.8 % on
# 2026-11-29 in the span form; no trace of it was kept to compute the current form from). A
# device, model or setup not listed (another GPU, an H200 NVL, a halved micro batch, CPU) gets no
# ratio or busy verdict.
BASELINES: dict[tuple, dict[str, list[float]]] = {
    ("NVIDIA H100 80GB HBM3", "bert-120m", 512, 64, "bf16", 1, False): {
        "ratio": [0.854, 0.861]},  # 2026-11-26, two fresh machines; busy then in an old form
    ("NVIDIA H200", "bert-120m", 512, 64, "bf16", 1, False): {
        "ratio": [0.879],  # 2026-11-27, call 1 (0.876, 0.875 and 0.880 on 2026-11-29)
        "busy_pct": [96.3, 96.1, 95.7]},  # 2026-11-29: two from the traces, one measured (above)
    ("NVIDIA H200", "bert-120m", 512, 64, "bf16", 2, False): {
        "ratio": [0.938, 0.968]},  # --zero 2, calls 1 and 2 (before patches.relink_only_moved)
    ("NVIDIA H200", "bert-120m", 512, 64, "bf16", 1, True): {
        "ratio": [1.655, 1.660]},  # --compile, calls 2 and 4: slower, known
}
SLACK = {"ratio": 0.05, "busy_pct": 3.0}
"""ratio: at most the worst recorded x 1.05. The largest spread between two fresh machines' runs
of one setup is 3.2 % (ZeRO-2 on the H200, 0.938 and 0.968; ZeRO-1 on the H100 0.8 %), so 5 %
passes that spread and fails a regression of more than ~5 %. busy_pct: at least the lowest
recorded minus 3 points: the current form spread 0.6 points over the app's three H200 runs
(96.3, 96.1, 95.7 %) and 0.7 over their plain loops' (97.3, 97.3, 96.6 %), where the span form
moved 9.8 points between two plain loops minutes apart (96.8, 87.0 %); 3 points of a 62 ms step
are ~1.9 ms, so a device that waits longer a step in unprofiled training (a host sync each step,
a host that falls behind) fails (below 92.7 %)."""
OOM_EXIT = 3  # a child's exit status when the model did not fit: the parent halves the batch


# -- what runs: models, geometry, steps ----------------------------------------------------------

def models_for(args) -> list[str]:
    if args.models:
        return args.models
    full = ["bert-tiny", "gpt-tiny"] if args.cpu else ["bert-120m", "bert-350m", "gpt-125m"]
    if args.packing == "doc-packed":  # the app packs documents side by side for encoders only
        full = [m for m in full if family(m) != "gpt"]
    return full[:1] if args.quick else full


def geometry(args) -> dict[str, int]:
    """Sequence length, first micro batch, steps a block, rounds, warm-up, profiled steps."""
    if args.cpu:
        g = dict(seq_len=128, micro_batch=16, block=5, rounds=6 if args.quick else 8,
                 warmup=5, profile_steps=2)
    else:
        g = dict(seq_len=512, micro_batch=64, block=20, rounds=2 if args.quick else 4,
                 warmup=20, profile_steps=5)
    for key in g:
        if getattr(args, key, None):
            g[key] = getattr(args, key)
    return g


def family(model: str) -> str:
    return "gpt" if model.startswith("gpt") else "bert"


# -- host syncs -----------------------------------------------------------------------------------

# torch by its own folder: a path such as /opt/torch/.venv/... holds every package's frames
SKIP_FRAMES = (os.path.dirname(torch.__file__) + os.sep,
               f"{os.sep}deepspeed{os.sep}accelerator{os.sep}", "contextlib.py",
               f"{os.sep}warnings.py", __file__)


def call_site() -> str:
    """The first frame outside torch, DeepSpeed's accelerator shim and this file: who asked.
    Where there is none (a thread that runs only torch's code, such as autograd's device
    threads: the second H100 run's one sync in an ordinary step), the thread's name and its
    innermost frame other than this file's and warnings'."""
    stack = traceback.extract_stack()[:-2]
    for f in reversed(stack):
        if not any(s in f.filename for s in SKIP_FRAMES):
            return f"{short_path(f.filename)}:{f.lineno}"
    inner = [f for f in stack if f.filename != __file__ and not f.filename.endswith("warnings.py")]
    where = f"{short_path(inner[-1].filename)}:{inner[-1].lineno}" if inner else "no frame"
    return f"? (thread {threading.current_thread().name}, innermost {where})"


def short_path(path: str) -> str:
    path = path.replace(str(REPO) + os.sep, "")
    return re.sub(r"^.*[/\\](site|dist)-packages[/\\]", "", path)


class Syncs:
    """Host<-device waits by call site while active, under the label `phase` ("step" or "log";
    "switch" inside its own sync-debug mode changes).

    On a GPU: torch.cuda's device, event and stream `synchronize` (DeepSpeed's accelerator calls
    the first) and what `torch.cuda.set_sync_debug_mode("warn")` reports (`item`, nonzero, a
    boolean mask's indexing, a copy to the host...). On CPU, where these are no-ops or never
    warn, the calls that would stall a GPU: DeepSpeed's accelerator `synchronize()` and host
    reads of tensors (`item`, `tolist`, float/int/bool) from outside torch, as the acceptance
    check's probe counts them."""

    READS = ("item", "tolist", "__float__", "__int__", "__bool__")

    def __init__(self, gpu: bool):
        self.gpu, self.phase = gpu, "step"
        self.sites: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._saved: list[tuple[Any, str, Any]] = []

    def _mark(self, kind: str) -> None:
        self.sites[self.phase][f"{kind} {call_site()}"] += 1

    def _wrap(self, owner, name: str, kind: str, when: Callable[..., bool] = lambda *a: True):
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            if when(*a):
                self._mark(kind)
            return fn(*a, **k)

        self._saved.append((owner, name, fn))
        setattr(owner, name, wrapper)

    def __enter__(self) -> "Syncs":
        if not self.gpu:
            self._enter_cpu()
        else:  # DeepSpeed's accelerator and a tensor read reach these: each wait counted once
            self._wrap(torch.cuda, "synchronize", "cuda.synchronize")
            self._wrap(torch.cuda.Event, "synchronize", "event.synchronize")
            self._wrap(torch.cuda.Stream, "synchronize", "stream.synchronize")
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.simplefilter("always")
            self._show, warnings.showwarning = warnings.showwarning, self._on_warning
            self._switch("warn")
        return self

    def _switch(self, mode: str) -> None:
        """Set torch's sync-debug mode, under the phase "switch": on the H200 runs each window
        counted one sync-debug warning raised inside this call itself (innermost frame
        torch/cuda/__init__.py's set_sync_debug_mode, before the first step), which is the
        switch's, not a step's."""
        phase, self.phase = self.phase, "switch"
        try:
            torch.cuda.set_sync_debug_mode(mode)
        finally:
            self.phase = phase

    def _enter_cpu(self) -> None:
        from deepspeed.accelerator import get_accelerator

        self._wrap(type(get_accelerator()), "synchronize", "synchronize")
        own = os.path.dirname(torch.__file__) + os.sep
        for name in self.READS:  # torch's own reads (an optimizer's step count...) not counted
            self._wrap(torch.Tensor, name, "read",
                       lambda *a: not sys._getframe(2).f_code.co_filename.startswith(own))

    def _on_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        """A sync-debug warning, counted where it is raised: its own filename:lineno is the
        innermost Python frame, often inside torch (torch/cuda/__init__.py's synchronize on the
        first H100 run), so the site is the first frame outside torch, as for the wrappers."""
        if "synchroniz" in str(message):
            self._mark("sync-debug")
        else:
            self._show(message, category, filename, lineno, file, line)

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def __exit__(self, *exc) -> None:
        if self.gpu:
            self._switch("default")
            self._warnings.__exit__(*exc)
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)


# -- device busy % from a profiler trace ---------------------------------------------------------

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
SPAN = "gpu_mfu.steps"


def union_length(intervals: Iterable[tuple[float, float]], lo: float | None = None,
                 hi: float | None = None) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once, clipped to
    [lo, hi] when given."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        start = start if lo is None else max(start, lo)
        end = end if hi is None else min(end, hi)
        if end <= start:
            continue
        if cur_end is None or start > cur_end:
            total += 0.0 if cur_end is None else cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (0.0 if cur_end is None else cur_end - cur_start)


def busy_from_trace(trace: dict[str, Any], steps: int, step_ms: float) -> dict[str, Any]:
    """Device busy % of `steps` steps profiled inside the annotated span `SPAN`, against
    `step_ms`, the same side's unprofiled ms/step (the timed blocks' median).

    The device work is the union of device activity (kernels, copies, memsets) over the span's
    device side (its `gpu_user_annotation`: from the first to the last device work launched
    inside it; the host span where the trace has none), or on a CPU-only trace the union of the
    ops of the span's thread over the span. busy_pct, the judged figure: that work a step
    (`work_ms` / `steps`) over `step_ms`, at most 100: the share of a real step the device
    works, which a device that waits in training (a host sync, a host behind it) lowers and the
    profiler's own host cost does not. span_pct, information only: the same work over the span's
    wall time, which the profiler's host cost stretches (the H200 runs of 2026-11-29: the app's
    profiled steps ran 93-107 ms against 62 ms unprofiled, 65.3 and 55.6 % for the same ~60 ms of
    device work a step). Also the host's synchronize calls inside the host span with their total
    duration (ms)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    spans = [e for e in events if e.get("name") == SPAN and e.get("cat") == "user_annotation"]
    if not spans:
        raise ValueError(f"no '{SPAN}' annotation in the trace")
    span = spans[0]
    lo, hi = float(span["ts"]), float(span["ts"]) + float(span["dur"])
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    gpu_spans = [e for e in events
                 if e.get("name") == SPAN and e.get("cat") == "gpu_user_annotation"]
    d_lo, d_hi = lo, hi
    if device and gpu_spans:
        d_lo = float(gpu_spans[0]["ts"])
        d_hi = d_lo + float(gpu_spans[0]["dur"])
    busy_on = device or [e for e in events if e.get("cat") == "cpu_op"
                         and e.get("tid") == span.get("tid") and e.get("pid") == span.get("pid")]
    busy = union_length(((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in busy_on),
                        d_lo, d_hi)
    syncs: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        if e.get("name") in SYNC_CALLS and lo <= float(e["ts"]) <= hi:
            syncs[e["name"]].append(float(e["dur"]) / 1000)
    work_step = busy / 1000 / max(steps, 1)
    return {"busy_pct": min(100.0, 100.0 * work_step / max(step_ms, 1e-9)),
            "span_pct": 100.0 * busy / max(d_hi - d_lo, 1e-9), "of": "device" if device else "cpu",
            "work_ms": busy / 1000, "work_ms_per_step": work_step, "steps": steps,
            "step_ms": step_ms, "span_ms": (d_hi - d_lo) / 1000, "wall_ms": (hi - lo) / 1000,
            "sync_calls": {k: {"count": len(v), "ms": round(sum(v), 3)} for k, v in syncs.items()}}


PROFILE_LEAD = 2  # the profiler's warm-up steps, just before the recorded ones, no sync between


def steps_a_side(g: dict[str, int]) -> int:
    """The most steps one side runs: warm-up, the timed blocks, the sync count's two blocks and
    a spare, the profiler's warm-up and the profiled steps."""
    return g["warmup"] + g["block"] * (g["rounds"] + 3) + PROFILE_LEAD + g["profile_steps"]


def profile_steps(step: Callable[[], None], steps: int, sync: Callable[[], None],
                  path: Path, step_ms: float) -> dict[str, Any]:
    """`steps` steps under torch.profiler (CPU, and CUDA when there is one) inside the `SPAN`
    annotation (a device sync closes it, so the span holds all their device work); the Chrome
    trace goes to `path`, its busy figures against `step_ms` (the side's unprofiled ms/step) are
    returned.

    The profiler warms up over `PROFILE_LEAD` steps first (started, nothing kept) with no sync
    before the recorded ones, so these open on a device queue as full as in training and with
    the profiler's start-up cost behind them (docs/benchmarks.md, "GPU: first runs"): opened on
    an idle device, the first H100 run's span counted the host's first launches as idle (92 %
    busy; 96 % from its second step on); started cold after unprofiled steps, the second run's
    first recorded steps ran at half the host speed (68 %)."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    plan = schedule(wait=0, warmup=PROFILE_LEAD, active=steps, repeat=1)
    with profile(activities=acts, schedule=plan) as prof:
        for _ in range(PROFILE_LEAD):
            step()
            prof.step()
        with record_function(SPAN):
            for _ in range(steps):
                step()
            sync()
    prof.export_chrome_trace(str(path))
    with open(path) as f:
        return {**busy_from_trace(json.load(f), steps, step_ms), "trace": str(path)}


# -- NCCL ------------------------------------------------------------------------------------------

def nccl_transports(lines: Iterable[str]) -> dict[str, list[str]]:
    """What NCCL_DEBUG=INFO says it used: the channels' transports ("P2P/CUMEM", "SHM", "NET/IB"
    ... from 'Channel 00/0 : 0[0] -> 1[1] via P2P/IPC' lines) and the network plugin it loaded
    ("IB", "Socket" from 'NET/IB : Using ...')."""
    via, net = set(), set()
    for line in lines:
        m = re.search(r"\bvia (\S+)", line)
        if m and ("Channel" in line or "->" in line):
            via.add(transport_name(m.group(1)))
        m = re.search(r"\bNET/(\w+)\s*:\s*Using\b|\bUsing network (\w+)", line)
        if m:
            net.add(m.group(1) or m.group(2))
    return {"via": sorted(via), "net": sorted(net)}


def transport_name(via: str) -> str:
    """'P2P/CUMEM/read' -> 'P2P/CUMEM', 'NET/IB/0/GDRDMA' -> 'NET/IB/GDRDMA', 'SHM/direct/direct'
    -> 'SHM': the kind and path, without device numbers or read/write modes."""
    parts = via.split("/")
    if parts[0] == "SHM":
        return "SHM"
    keep = parts[:2] + (["GDRDMA"] if "GDRDMA" in parts[2:] else [])
    return "/".join(keep)


def _allreduce_rank(rank: int, world: int, port: int, mb: int, backend: str, out: str) -> None:
    """One rank of the bus-bandwidth run: all_reduce `mb` MB in bf16 and fp32, times to `out`."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=world)
    figures = {}
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.ones(mb * 2**20 // torch.finfo(dtype).bits * 8, dtype=dtype, device=dev)
        for _ in range(3):
            dist.all_reduce(x)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        n, t0 = 10, time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / n
        algbw = x.numel() * x.element_size() / seconds / 1e9
        figures[str(dtype).split(".")[-1]] = {"ms": 1000 * seconds, "alg_gbs": algbw,
                                              "bus_gbs": algbw * 2 * (world - 1) / world}
    if rank == 0:
        Path(out).write_text(json.dumps(figures))
    dist.destroy_process_group()


def bus_bandwidth(world: int, out_dir: Path, mb: int = 256, backend: str = "nccl",
                  start_method: str = "spawn") -> dict:
    """all_reduce bus bandwidth over `world` local processes (torch.multiprocessing, fresh
    interpreters: `start_method` "fork" only where this process has no CUDA state, as a test's
    gloo run) and, with NCCL, the transport from its INFO log (NCCL_DEBUG_FILE, one file a
    process)."""
    import socket

    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    if backend == "nccl":
        os.environ.setdefault("NCCL_DEBUG", "INFO")
        os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,P2P,SHM,NET,NVLS")
        os.environ.setdefault("NCCL_DEBUG_FILE", str(out_dir / "nccl.%h.%p.log"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = out_dir / "allreduce.json"
    mp.start_processes(_allreduce_rank, args=(world, port, mb, backend, str(result)),
                       nprocs=world, start_method=start_method)
    lines = [line for f in sorted(out_dir.glob("nccl.*.log")) for line in open(f, errors="replace")]
    return {"world": world, "mb": mb, "backend": backend, **json.loads(result.read_text()),
            "transport": nccl_transports(lines) if backend == "nccl" else None}


# -- op probes (C1, C2) ---------------------------------------------------------------------------

def probe_flash_attn() -> str:
    """flash-attention 2: not installed, installed but broken (built for another torch), or
    imports and runs a tiny bf16 attention."""
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        return "not installed (SDPA is used)"
    try:
        import flash_attn
        from flash_attn import flash_attn_func

        if not torch.cuda.is_available():
            return f"{flash_attn.__version__} imports; no GPU to run it on"
        q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
        flash_attn_func(q, q, q, causal=True)
        torch.cuda.synchronize()
        return f"{flash_attn.__version__} imports and runs"
    except Exception as e:  # an ABI mismatch is an ImportError/OSError/RuntimeError: all one line
        return f"installed but fails: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def probe_fused_adam() -> str:
    """DeepSpeed's FusedAdam op: prebuilt into the install, JIT-buildable (a toolkit and ninja
    here; the first use builds it), or impossible here."""
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops

        builder = get_accelerator().create_op_builder("FusedAdamBuilder")
        if builder is None:
            return f"impossible: no FusedAdam for the {get_accelerator().device_name()} accelerator"
        if installed_ops.get(builder.NAME):
            return "prebuilt (DS_BUILD_FUSED_ADAM=1 install)"
        if not builder.is_compatible(verbose=False):
            return "impossible: DeepSpeed says the op is not compatible here"
        from torch.utils.cpp_extension import CUDA_HOME, verify_ninja_availability

        verify_ninja_availability()
        if torch.cuda.is_available() and not CUDA_HOME:
            return "impossible: no CUDA toolkit (nvcc) to JIT-build it"
        return "JIT possible (built on first use; the app defaults to torch's fused AdamW)"
    except Exception as e:
        return f"impossible: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


# -- one model, in a process of its own (a fresh process group and device memory) ---------------

def build_app(spec: dict[str, Any]):
    """The app's run, as `app train` builds it, on the synthetic dataset."""
    from app import settle
    from app.build import build
    from app.config import TrainConfig

    # the synthetic manifest names no real tokenizer copy (bench_loader.make_dataset): the check
    # of that copy is the one part of the start-up that cannot pass on it
    settle.check_tokenizer_copy = lambda data, manifest: None
    cfg = TrainConfig(data=Path(spec["data"]), out=Path(spec["run"]), model=spec["model"],
                      objective="clm" if family(spec["model"]) == "gpt" else "mlm",
                      seq_len=spec["seq_len"], micro_batch=spec["micro_batch"],
                      max_steps=spec["max_steps"], log_every=spec["block"], eval_every=0,
                      save_every=0, wandb="disabled", hang_timeout=3600, overwrite=True,
                      zero=spec.get("zero"), compile=bool(spec.get("compile")),
                      packing=spec.get("packing", "concat"), attn=spec.get("attn", "auto"))
    return build(cfg)


def app_side(trainer, log_every: int, wait: dict[str, float]) -> Callable[[], None]:
    """One step of the app's loop as `Trainer.fit` runs it, less eval and save: the step, and at
    a log step the gather, the anomaly check and the log. The timing window restarts at a
    window's first step, so the plain side's blocks in between are not counted in it."""
    def step():
        if trainer.state.step % log_every == 0:
            trainer.window.restart(trainer.state.step)
        before = trainer.window.data_wait
        trainer.train_step()
        wait["seconds"] += trainer.window.data_wait - before
        if trainer.state.step % log_every == 0:
            rows = trainer.gather(figures=True)
            if trainer.guards.recovery.check(rows, trainer.rewind):
                raise RuntimeError("the app rolled back during the benchmark (an anomaly)")
            trainer.log(rows)
    return step


def plain_side(built, device: torch.device, log_every: int) -> Callable[[], None]:
    """The plain loop on the app's model config and seed and on its loader's batches: on a GPU
    in bf16 autocast over fp32 weights with torch's fused AdamW, the loss kept on the device."""
    from app.models.build import build_model
    from app.runtime.param_groups import optimizer_groups

    plan, gpu = built.plan, device.type == "cuda"
    model = build_model(plan.model_config, seed=plan.cfg.seed, for_training=True).to(device)
    model.train()
    groups = optimizer_groups(model, plan.cfg.weight_decay)
    params = [p for g in groups for p in g["params"]]
    hyper = plan.ds_config["optimizer"]["params"]
    opt = torch.optim.AdamW(groups, lr=hyper["lr"], betas=tuple(hyper["betas"]), eps=hyper["eps"],
                            **({"fused": True} if gpu else {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, plan.lr_lambda)
    batches = iter(built.trainer.train_batches(0, frozenset()))
    bf16 = gpu and plan.precision == "bf16"
    total, done = torch.zeros((), device=device), [0]

    def step():
        batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True if gpu else None)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        total.add_(loss.detach().float())
        done[0] += 1
        if done[0] % log_every == 0:
            total.item()  # the log step's one read, as the app's
    return step


def sync_sites(step: Callable[[], None], trainer, steps: int, log_every: int,
               gpu: bool) -> dict[str, Any]:
    """Host syncs of `steps` app steps by call site, split into ordinary and log steps."""
    syncs = Syncs(gpu)
    ordinary = 0
    with syncs:
        for _ in range(steps):
            log = (trainer.state.step + 1) % log_every == 0
            ordinary += not log
            syncs.set_phase("log" if log else "step")
            step()
    per_step = sum(syncs.sites["step"].values()) / max(ordinary, 1)
    return {"steps": steps, "ordinary_steps": ordinary, "per_ordinary_step": per_step,
            "step_sites": dict(syncs.sites["step"].most_common()),
            "log_sites": dict(syncs.sites["log"].most_common()),
            "switch_sites": dict(syncs.sites["switch"].most_common())}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Both sides of one model: timed blocks, then the app's syncs, then profiles of each."""
    from app.runtime.device import synchronize
    from bench.bench_compile_attn import GraphOps
    from bench.bench_step import alternate

    # with --compile, the attention the app's compiled graph holds (the H200 run: SDPA's math
    # path where eager runs cuDNN's; bench/bench_compile_attn.py varies what differs)
    graph_ops = GraphOps().install() if spec.get("compile") else None
    built = build_app(spec)
    trainer, gpu = built.trainer, torch.cuda.is_available()
    device = trainer.device
    block, wait = spec["block"], {"seconds": 0.0}
    sides = {"app": app_side(trainer, block, wait), "plain": plain_side(built, device, block)}
    for step in sides.values():
        for _ in range(spec["warmup"]):
            step()
    wait["seconds"], first = 0.0, trainer.state.step
    blocks = alternate(sides, block, spec["rounds"], sync=synchronize)
    # the timed blocks' waits, read before the sync count and the profiles run more app steps:
    # taken after them, the waits of 87 steps were divided by the time of 40 (--quick; review
    # gpu-path-2 M-4), 2.2x too high, and the H100/H200 runs failed the 1 % verdict for it
    timed_wait, last = wait["seconds"], trainer.state.step
    app_seconds = sum(blocks["app"]) * block / 1000
    syncs = sync_sites(sides["app"], trainer, 2 * block, block, gpu)
    out = Path(spec["out"])
    result = figures(spec, blocks, trainer.shape)
    busy = {name: profile_steps(step, spec["profile_steps"], synchronize,
                                out / f"trace-{spec['model']}-{name}.json",
                                result[name]["ms_per_step"])
            for name, step in sides.items()}
    result.update(data_wait_pct=100 * timed_wait / app_seconds, data_wait_steps=[first + 1, last],
                  logged_data_wait_pct=logged_wait(spec["run"], first, last, block),
                  compile=bool(spec.get("compile")), syncs=syncs, busy=busy,
                  setup=setup(built, gpu))
    if graph_ops is not None:
        result["setup"].update(compiled_attention=graph_ops.summary(), compiled_ops=graph_ops.ops)
    trainer.close()
    return result


def figures(spec: dict[str, Any], blocks: dict[str, list[float]], shape) -> dict[str, Any]:
    """ms/step (median of the blocks), tokens/s and MFU a side, and the app / plain ratio."""
    tokens = spec["micro_batch"] * spec["seq_len"]
    out: dict[str, Any] = {"model": spec["model"], "seq_len": spec["seq_len"],
                           "micro_batch": spec["micro_batch"], "blocks_ms": blocks,
                           "flops_per_token": shape.flops_per_token,
                           "peak_tflops": shape.peak_tflops}
    for name, ms in blocks.items():
        med = statistics.median(ms)
        tok_s = tokens * 1000 / med
        out[name] = {"ms_per_step": med, "tokens_per_sec": tok_s,
                     "mfu": (shape.flops_per_token * tok_s / (shape.peak_tflops * 1e12)
                             if shape.peak_tflops else None)}
    out["ratio"] = out["app"]["ms_per_step"] / out["plain"]["ms_per_step"]
    return out


def logged_wait(run: str, first: int, last: int, window: int) -> float | None:
    """The app's own `perf/data_wait_pct` over steps first+1..last (the timed blocks): its logged
    windows of `window` steps that lie inside them, each weighted by its step time, which is the
    app's figure for the whole span (waits over wall time, as it takes one window's). The same
    steps as data_wait_pct, which should then read the same but for where a window's clock and
    a block's stop (the block's closing sync and the log step's tail): 0.1453 % against 0.1454 %
    in a --cpu --quick run on the loaded 2-core box (tests/test_gpu_mfu.py checks 1.3x). None
    when no window lies inside."""
    key, rows = "perf/data_wait_pct", (Path(run) / "metrics.jsonl").read_text().splitlines()
    inside = [r for r in map(json.loads, rows)
              if key in r and r["step"] - window >= first and r["step"] <= last]
    if not inside:
        return None
    ms = [r["perf/step_time_ms"] for r in inside]
    return sum(r[key] * t for r, t in zip(inside, ms)) / sum(ms)


def setup(built, gpu: bool) -> dict[str, Any]:
    """What the app chose: precision, ZeRO stage, optimizer, attention, loader workers."""
    from app.runtime.ds_config import zero_stage

    engine, plan = built.engine, built.plan
    opt = getattr(engine, "basic_optimizer", None) or engine.optimizer
    return {"device": torch.cuda.get_device_name() if gpu else "cpu",
            "precision": plan.precision, "zero": zero_stage(plan.ds_config),
            "optimizer": f"{type(opt).__module__}.{type(opt).__name__}",
            "fused": bool(getattr(opt, "defaults", {}).get("fused")),
            "attention": getattr(plan.model_config, "_attn_implementation", None),
            "packing": plan.cfg.packing,
            "threads": torch.get_num_threads(),
            "max_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if gpu else None}


def child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("WANDB_MODE", "disabled")
    try:
        result = measure(spec)
    except Exception as e:  # noqa: BLE001 - an OOM is a signal to the parent, anything else not
        if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e):
            print(f"out of memory at micro batch {spec['micro_batch']}", file=sys.stderr)
            sys.exit(OOM_EXIT)
        raise
    Path(spec["result"]).write_text(json.dumps(result, indent=1))
    from app.runtime.dist import shutdown

    shutdown()  # the app's trainer joined a process group (NCCL warns of one left at exit)


def forked_child(spec_path: Path, log) -> int:
    """`--child SPEC` on CPU as a fork of this process, which has imported torch, DeepSpeed and
    the app already (a fresh interpreter would import them again, no part of what it measures);
    its exit status as the interpreter's would be. A CPU run has no device state a fork would
    share, and this process has joined no process group; on a GPU the child stays a fresh
    interpreter (CUDA does not survive a fork)."""
    def run() -> None:
        os.environ["PYTHONPATH"] = child_pythonpath()  # for any process it starts
        child(str(spec_path))

    return wait_exit(fork_call(run, output=log.fileno()))


# -- the parent: datasets, one child a model (halving the batch on OOM), verdicts ---------------

def run_model(args, model: str, data: Path, g: dict[str, int], out: Path) -> dict[str, Any]:
    """One model in a child process; on out-of-memory again at half the micro batch (down to 8)."""
    micro = g["micro_batch"]
    while True:
        tag = f"{model}-mb{micro}"
        steps = steps_a_side(g)
        spec = {**g, "model": model, "micro_batch": micro, "data": str(data),
                "zero": args.zero, "compile": args.compile, "packing": args.packing,
                "attn": args.attn,
                "run": str(out / "runs" / tag), "out": str(out), "max_steps": steps,
                "result": str(out / f"{tag}.json")}
        spec_path = out / f"{tag}.spec.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, __file__, "--child", str(spec_path),
               *(["--cpu"] if args.cpu else [])]
        with open(out / f"{tag}.log", "w") as log:
            if args.cpu and threading.active_count() == 1:
                rc = forked_child(spec_path, log)
            else:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONPATH": child_pythonpath()}
                                    ).returncode
        if rc == OOM_EXIT and micro > 8:
            print(f"{model}: out of memory at micro batch {micro}; trying {micro // 2}")
            micro //= 2
            continue
        if rc != 0:
            tail = (out / f"{tag}.log").read_text().strip().splitlines()[-15:]
            raise SystemExit(f"{model} failed (rc={rc}, log {out / f'{tag}.log'}):\n"
                             + "\n".join(tail))
        return json.loads(Path(spec["result"]).read_text())


def baseline_key(r: dict[str, Any]) -> tuple:
    """BASELINES' key of a result; a run of another packing or attention than the recorded
    (concat, SDPA) carries them at its end, so it matches no recorded run (not judged)."""
    s = r["setup"]
    key = (s["device"], r["model"], r["seq_len"], r["micro_batch"], s["precision"], s["zero"],
           bool(r.get("compile")))
    other = (s.get("packing", "concat"), s.get("attention", "sdpa"))
    return key if other == ("concat", "sdpa") else key + other


def verdicts(r: dict[str, Any]) -> list[tuple[bool | None, str, str]]:
    """(passed, name, detail) of each check for one model's result; passed None: not judged (no
    recorded baseline for this device, model and setup)."""
    t, busy, syncs = THRESHOLDS, r["busy"]["app"], r["syncs"]
    key = baseline_key(r)
    base = BASELINES.get(key, {})
    unknown = (f"no recorded baseline for {key[0]}, {key[1]} seq {key[2]} x micro {key[3]} "
               f"{key[4]} ZeRO-{key[5]}{' compiled' if key[6] else ''}: not judged")
    ratio = f"app / plain = {r['ratio']:.3f} x"
    plain = r["busy"]["plain"]
    busy_now = (f"{busy['of']} busy {busy['busy_pct']:.1f} % of the app's unprofiled step "
                f"({busy['work_ms_per_step']:.2f} ms of work a profiled step / "
                f"{busy['step_ms']:.2f}; {busy['span_pct']:.1f} % of the profiled span) (plain "
                f"{plain['busy_pct']:.1f} %, span {plain['span_pct']:.1f} %")
    if base.get("ratio"):
        most = max(base["ratio"]) * (1 + SLACK["ratio"])
        ratio_v = (r["ratio"] <= most, "ratio", f"{ratio} (<= {most:.3f}: recorded "
                   f"{', '.join(map(str, base['ratio']))} + {100 * SLACK['ratio']:g} %)")
    else:
        ratio_v = (None, "ratio", f"{ratio} ({unknown})")
    if base.get("busy_pct"):
        least = min(base["busy_pct"]) - SLACK["busy_pct"]
        busy_v = (busy["busy_pct"] >= least, "busy", f"{busy_now}; >= {least:.1f} %: recorded "
                  f"{', '.join(map(str, base['busy_pct']))} - {SLACK['busy_pct']:g})")
    else:
        busy_v = (None, "busy", f"{busy_now}; {unknown})")
    return [
        ratio_v,
        busy_v,
        (r["data_wait_pct"] <= t["data_wait_pct"], "data wait",
         f"{r['data_wait_pct']:.2f} % of the app's time in the timed blocks (its own log of "
         f"the same steps: {fmt(r['logged_data_wait_pct'], '.2f')} %; "
         f"<= {t['data_wait_pct']:g} %)"),
        (syncs["per_ordinary_step"] <= t["syncs_per_step"], "host syncs",
         f"{syncs['per_ordinary_step']:g} a step outside log steps; "
         f"{sum(syncs['log_sites'].values())} at a log step"),
    ]


VERDICT = {True: "PASS", False: "FAIL", None: "SKIP"}


def fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def report(r: dict[str, Any]) -> list[str]:
    """The lines of one model: setup, both sides' figures, verdicts, sync sites."""
    s = r["setup"]
    lines = [f"{r['model']}: seq {r['seq_len']} x micro {r['micro_batch']}, {s['device']}, "
             f"{s['precision']}, ZeRO-{s['zero']}, {s['optimizer'].rsplit('.', 1)[-1]}"
             f"{' (fused)' if s['fused'] else ''}, attention {s['attention']}"
             + (f" (compiled: {s['compiled_attention']})" if "compiled_attention" in s else "")]
    for name in ("app", "plain"):
        side = r[name]
        mfu = ("n/a (no peak for this device)" if side["mfu"] is None
               else f"{100 * side['mfu']:.1f} %")
        lines.append(f"  {name:<5} {side['ms_per_step']:8.2f} ms/step "
                     f"{side['tokens_per_sec']:12,.0f} tokens/s  MFU {mfu}")
    for ok, name, detail in verdicts(r):
        lines.append(f"  {VERDICT[ok]} {name:<10} {detail}")
    for phase in ("step_sites", "log_sites", "switch_sites"):
        for site, n in r["syncs"].get(phase, {}).items():
            lines.append(f"    sync {phase[:-6]:<4} {n:3d} x {site}")
    for call, c in r["busy"]["app"]["sync_calls"].items():
        lines.append(f"    trace {call}: {c['count']} calls, {c['ms']:.2f} ms in "
                     f"{r['busy']['app']['wall_ms']:.0f} ms")
    return lines


def nccl_line(b: dict[str, Any]) -> str:
    t = b["transport"] or {}
    via = ", ".join(t.get("via") or []) or "not in the log"
    net = f"; network plugin {', '.join(t['net'])}" if t.get("net") else ""
    return (f"NCCL all_reduce {b['mb']} MB over {b['world']} GPUs: bus "
            f"{b['bfloat16']['bus_gbs']:.0f} GB/s bf16, {b['float32']['bus_gbs']:.0f} GB/s fp32; "
            f"transport {via}{net}")


def short_json(results: list[dict[str, Any]]) -> dict[str, Any]:
    """--json: per model the app side's MFU (a fraction; None where the device's peak is not
    known, as on CPU), both sides' ms a step, and what they ran."""
    return {"models": {r["model"]: {
        "mfu": r["app"]["mfu"], "app_ms": r["app"]["ms_per_step"],
        "plain_ms": r["plain"]["ms_per_step"], "plain_mfu": r["plain"]["mfu"],
        "ratio": r["ratio"], "tokens_per_sec": r["app"]["tokens_per_sec"],
        "seq_len": r["seq_len"], "micro_batch": r["micro_batch"],
        "device": r["setup"]["device"], "precision": r["setup"]["precision"],
        "zero": r["setup"]["zero"], "attention": r["setup"]["attention"],
        "packing": r["setup"].get("packing", "concat"), "compile": bool(r.get("compile"))}
        for r in results}}


def ratio_line(results: list[dict[str, Any]]) -> str:
    return "app / plain = " + "; ".join(
        f"{r['ratio']:.3f} x ({r['model']}, seq {r['seq_len']} x micro {r['micro_batch']}, "
        f"{r['setup']['device']} {r['setup']['precision']})" for r in results)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from app.config import ATTENTION

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true",
                   help="tiny models on CPU (CI); verdicts informative")
    p.add_argument("--quick", action="store_true", help="the first model only, fewer rounds")
    p.add_argument("--out", type=Path, default=Path("runs/gpu_mfu"),
                   help="where the JSON, logs and traces go (default runs/gpu_mfu)")
    p.add_argument("--models", nargs="+", help="presets instead of the default three (two on CPU)")
    p.add_argument("--micro-batch", type=int, help="first try (halved on out-of-memory)")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--block", type=int, help="steps a turn (and the app's log interval)")
    p.add_argument("--rounds", type=int)
    p.add_argument("--tokens", type=int,
                   help="synthetic dataset size (default: enough to not repeat)")
    p.add_argument("--zero", type=int, choices=range(4), help="the app's ZeRO stage (default: "
                   "the app's own choice); the plain loop is the same either way")
    p.add_argument("--compile", action="store_true", help="the app with --compile")
    p.add_argument("--packing", default="concat", choices=("concat", "doc", "doc-packed"),
                   help="the app's --packing, which both sides train on (default concat; "
                   "doc-packed: encoder models only)")
    p.add_argument("--attn", default="auto", choices=ATTENTION, help="the app's --attn, which "
                   "both sides build the model with (default auto: SDPA)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the figures in short: "
                   '{"models": {NAME: {"mfu", "app_ms", "plain_ms", ...}}}')
    p.add_argument("--strict", action="store_true", help="exit 1 on a FAIL on CPU too")
    p.add_argument("--probe", action="store_true",
                   help="print the flash-attn and FusedAdam lines only")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.child:
        child(args.child)
        return 0
    print(f"flash-attn: {probe_flash_attn()}")
    print(f"FusedAdam:  {probe_fused_adam()}")
    if args.probe:
        return 0
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("gpu_mfu.py: error: no GPU visible to torch; --cpu runs tiny models "
                         "on CPU")
    g = geometry(args)
    gpt = [m for m in models_for(args) if family(m) == "gpt"]
    if args.packing == "doc-packed" and gpt:
        print(f"gpu_mfu.py: error: --packing doc-packed: encoder models only ({', '.join(gpt)} "
              f"given)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results, doc = [], {"mode": "cpu" if args.cpu else "gpu", "quick": args.quick,
                        "thresholds": THRESHOLDS, "slack": SLACK, "geometry": g, "models": []}
    with tempfile.TemporaryDirectory(prefix="gpu_mfu_") as tmp:
        for model in models_for(args):
            data = dataset(Path(tmp), family(model), args, g)
            r = run_model(args, model, data, g, args.out)
            r["verdicts"] = [{"pass": ok, "name": n, "detail": d} for ok, n, d in verdicts(r)]
            r["baseline"] = BASELINES.get(baseline_key(r))
            results.append(r)
            doc["models"].append(r)
            print("\n".join(report(r)), flush=True)
    if not args.cpu and torch.cuda.device_count() >= 2:
        doc["nccl"] = bus_bandwidth(torch.cuda.device_count(), args.out / "nccl")
        print(nccl_line(doc["nccl"]))
    failed = any(v["pass"] is False for r in results for v in r["verdicts"])
    skipped = sum(v["pass"] is None for r in results for v in r["verdicts"])
    doc["failed"] = failed
    (args.out / "gpu_mfu.json").write_text(json.dumps(doc, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(short_json(results), indent=1) + "\n")
    print(f"{'FAIL' if failed else 'PASS'}: all judged verdicts"
          + (f" ({skipped} not judged: no recorded baseline)" if skipped else "")
          + (" (informative on CPU)" if args.cpu else "") + f"; details in {args.out}/gpu_mfu.json")
    print(ratio_line(results))
    return 1 if failed and (args.strict or not args.cpu) else 0


def dataset(tmp: Path, fam: str, args, g: dict[str, int]) -> Path:
    """The family's synthetic token shards (once per family): enough tokens that the run does
    not repeat them (the loader's epoch boundary is no part of a step's cost)."""
    from bench.bench_loader import make_dataset

    root = tmp / fam
    if not (root / "dataset.json").exists():
        steps = steps_a_side(g)
        tokens = args.tokens or 2 * steps * g["micro_batch"] * g["seq_len"] + 200_000
        root.mkdir()
        make_dataset(root, tokens, shards=2, vocab=VOCABS[fam])
    return root


if __name__ == "__main__":
    sys.exit(main())
