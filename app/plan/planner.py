"""`python -m app plan`: memory and throughput per ZeRO stage before a run.

For ZeRO 0, 1, 2, 3 and 3 + offload: bytes per device by term (app.plan.memory), the largest micro
batch that fits, the global batch, tokens/s and step time at an assumed MFU (app.telemetry.flops,
app.telemetry.hardware), days and cost to train the token budget, and which stage to pick; then
the network (app.plan.network): communication per step, the part compute does not hide, step time
and scaling efficiency from 1 to N nodes, synchronous or in the low-communication mode
(`--dp-mode diloco`: islands, an outer sync every H steps), each mode's best within a global batch
bound (tokens per optimizer step), and the mode, H, stage, micro batch and gradient accumulation
to run. Formulas: docs/plan.md. Nothing is downloaded or allocated: the model is
built on PyTorch's meta device to count its parameters.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from app.plan import network
from app.plan.inputs import ModelInfo, describe_model, dropout_flags, setup_ds, zero_setups
from app.plan.memory import (
    GPU,
    OPTIMIZER_STATE_BYTES,
    DeviceProfile,
    GiB,
    MemoryPlan,
    Workload,
    ZeroSetup,
    max_micro_batch,
    plan_memory,
)
from app.telemetry import hardware
from app.telemetry.flops import flops_per_token, head_fraction
from data_tools import output
from data_tools.errors import UserError

MiB = 2 ** 20
CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022: compute-optimal tokens per parameter
DEFAULT_GPU = "H100-SXM"
MAX_GLOBAL_BATCH_TOKENS = {"mlm": 8192 * 512, "clm": 4 * 2 ** 20}
"""Tokens per optimizer step the network recommendation never exceeds, by objective, unless
--max-global-batch-tokens says otherwise: the largest global batches published models of each
kind trained well with AdamW, a ceiling rather than a target. MLM: RoBERTa's 8K sequences of
512 tokens, 4.2 M tokens (Liu et al. 2019, arXiv:1907.11692: its Table 3 has 2K and 8K
sequences both ahead of BERT's 256 at equal compute, and it trained at 8K); past that, BERT
needed LAMB (You et al. 2019, arXiv:1904.00962: 32K-64K sequences). CLM: Llama's and Llama
2's 4 M tokens at every size (Touvron et al. 2023, arXiv:2302.13971 and arXiv:2307.09288),
above GPT-3's 0.5 M (125M-760M) to 3.2 M (175B) (Brown et al. 2020, arXiv:2005.14165, Table
2.1): a small model's critical batch is below it. Without the bound the plan hid a slow link
by growing the batch (bert-350m on 128 nodes at 25 Gb/s: 200 M tokens a step), which no
optimizer settings make train well."""
DEFAULT_MAX_GLOBAL_BATCH_TOKENS = 4 * 2 ** 20
"""An objective not in MAX_GLOBAL_BATCH_TOKENS."""
OUTER_STATE_BYTES = 8
"""The low-communication mode's outer state a parameter of a rank's slice (app.runtime.outer:
the fp32 global weights and the outer Nesterov momentum)."""


@dataclass(frozen=True)
class PlanRequest:
    """`python -m app plan` settings (the flags, checked)."""

    model: str
    """Preset name (app.model.PRESETS)."""
    model_args: tuple[str, ...] = ()
    """Config overrides KEY=VALUE, as `app train --model-arg`."""
    vocab_size: int | None = None
    """Vocabulary (default: the config class's, e.g. BERT's 30,522)."""
    seq_len: int = 128
    micro_batch: int | None = None
    """Samples per device per pass; None: the largest that fits, per stage."""
    grad_accum: int = 1
    precision: str = "bf16"
    checkpointing: bool = False
    """Activation checkpointing (`app train --gradient-checkpointing`)."""
    gpus: int = 1
    """Devices in the whole job (data-parallel size)."""
    gpus_per_node: int | None = None
    """Devices per node (default: min(gpus, 8))."""
    gpu: str | None = None
    """Accelerator name from app.telemetry.hardware (memory and peak TFLOP/s)."""
    gpu_mem_gb: float | None = None
    """Memory per device in GB (2^30 bytes); overrides the accelerator's."""
    peak_tflops: float | None = None
    """Dense peak TFLOP/s per device in this precision; overrides the accelerator's."""
    optimizer: str = "adamw"
    tokens: float | None = None
    """Tokens to train on (default: 20 per parameter, Chinchilla)."""
    mfu: float = 0.35
    """Assumed model FLOPs utilisation."""
    price_per_gpu_hour: float | None = None
    mask_prob: float = 0.15
    """MLM: fraction of positions the head runs on."""
    attn: str = "sdpa"
    """sdpa/flash_attention_2/flex (fused: no S x S scores) or eager."""
    runtime_gb: float | None = None
    """Per-device runtime memory (CUDA context, NCCL); default app.plan.memory.GPU's."""
    fragmentation: float | None = None
    """Allowance on activations (default app.plan.memory.GPU's)."""
    nodes: int | None = None
    """Nodes the network section scales to (default: gpus / gpus_per_node)."""
    interconnect: str | None = None
    """A network preset (app.plan.network.INTERCONNECTS); default 25gbe unless --net-gbps."""
    net_gbps: float | None = None
    """Inter-node bandwidth per node, Gb/s (default: the preset's)."""
    net_latency_us: float | None = None
    """Latency of one ring step between nodes (default: the preset's, or the preset nearest
    --net-gbps)."""
    intra_gbps: float | None = None
    """Bandwidth between the devices of a node, per device (default: the accelerator's)."""
    comm_dtype: str | None = None
    """Gradient reduction dtype (default: what the app's ds_config gives DeepSpeed)."""
    compute_ms: float | None = None
    """A measured one-node optimizer step (at --micro-batch and --grad-accum), replacing the
    FLOPs/MFU estimate of compute."""
    step_ms: float | None = None
    """The optimizer step's part of --compute-ms (a run's perf/optimizer_ms): once per
    optimizer step whatever the batch, and no communication hides behind it."""
    forward_ms: float | None = None
    """The forward passes' part of --compute-ms per micro step (a run's perf/forward_ms): the
    window the weight gathers hide behind; the rest less the step is backward's."""
    overlap_fraction: float = network.BACKWARD_FRACTION
    """The share of a micro step a gradient reduction can hide behind (backward)."""
    device_kind: str = "gpu"
    """Which rows of network.OVERLAPPED apply: "cpu" for DeepSpeed's CPU accelerator."""
    net_cpu_ms_per_mb: float | None = None
    """CPU ms a rank's core spends per MB its node sends (default: network.GLOO_CPU_MS_PER_MB
    with --device-kind cpu, else 0)."""
    dp_mode: str = "sync"
    """The data parallelism the per-stage tables show: "sync" (one DeepSpeed group over the
    world) or "diloco" (islands, an outer sync every --outer-every steps: network.LowComm)."""
    outer_every: int | None = None
    """H, optimizer steps between outer syncs (--dp-mode diloco; default: the recommended)."""
    island_ranks: int | None = None
    """Ranks an island (default: --gpus-per-node, one node's)."""
    outer_dtype: str = "fp32"
    """The outer sync's exchange dtype."""
    min_outer_every: int = network.MIN_OUTER_EVERY
    """The smallest H the recommendation may take."""
    max_outer_every: int = network.MAX_OUTER_EVERY
    """The largest H the recommendation may take (quality: network.MAX_OUTER_EVERY)."""
    max_global_batch_tokens: float | None = None
    """Tokens per optimizer step no recommendation exceeds (default: MAX_GLOBAL_BATCH_TOKENS
    for the model's objective)."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():  # inf passes `> 0` and breaks the arithmetic
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"--{_flag(name)} {value}: must be a finite number")
        self._check_network()
        for name in ("seq_len", "grad_accum", "gpus"):
            _positive(name, getattr(self, name))
        for name in ("micro_batch", "gpus_per_node", "vocab_size"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in ("gpu_mem_gb", "peak_tflops", "tokens"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UserError(f"--{_flag(name)} {value}: must be positive")
        for name in ("price_per_gpu_hour", "runtime_gb", "fragmentation"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise UserError(f"--{_flag(name)} {value}: must be 0 or more")
        if not 0 < self.mfu <= 1:
            raise UserError(f"--mfu {self.mfu}: must be in (0, 1]")
        if not 0 < self.mask_prob <= 1:
            raise UserError(f"--mask-prob {self.mask_prob}: must be in (0, 1]")
        if self.gpus_per_node and self.gpus % min(self.gpus_per_node, self.gpus):
            raise UserError(f"--gpus {self.gpus}: not a multiple of --gpus-per-node "
                            f"{self.gpus_per_node}")
        self._check_low_comm()

    def _check_network(self) -> None:
        if self.nodes is not None:
            _positive("nodes", self.nodes)
        for name in ("net_gbps", "intra_gbps", "compute_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UserError(f"--{_flag(name)} {value}: must be positive")
        for name in ("net_latency_us", "net_cpu_ms_per_mb"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise UserError(f"--{_flag(name)} {value}: must be 0 or more")
        if not 0 <= self.overlap_fraction <= 1:
            raise UserError(f"--overlap-fraction {self.overlap_fraction}: must be in [0, 1]")
        if self.interconnect is not None and self.interconnect not in network.INTERCONNECTS:
            raise UserError(f"--interconnect {self.interconnect!r}: unknown (known: "
                            f"{', '.join(network.INTERCONNECTS)})")
        if self.compute_ms is not None and self.micro_batch is None:
            raise UserError(f"--compute-ms {self.compute_ms}: give the --micro-batch it was "
                            f"measured at")
        for name in ("step_ms", "forward_ms"):
            value = getattr(self, name)
            if value is not None and self.compute_ms is None:
                raise UserError(f"--{_flag(name)} {value:g}: a part of a measured step; give "
                                f"--compute-ms too")
            if value is not None and not value >= 0:
                raise UserError(f"--{_flag(name)} {value:g}: must be 0 or more")
        parts = (self.step_ms or 0) + (self.forward_ms or 0) * self.grad_accum
        if self.compute_ms is not None and parts >= self.compute_ms:
            raise UserError(f"--step-ms {self.step_ms or 0:g} + --forward-ms "
                            f"{self.forward_ms or 0:g} x {self.grad_accum} micro steps: leaves "
                            f"no backward in --compute-ms {self.compute_ms:g}")

    def _check_low_comm(self) -> None:
        if self.dp_mode not in network.DP_MODES:
            raise UserError(f"--dp-mode {self.dp_mode!r}: expected "
                            f"{' or '.join(network.DP_MODES)}")
        if self.outer_dtype not in network.OUTER_DTYPES:
            raise UserError(f"--outer-dtype {self.outer_dtype!r}: expected "
                            f"{' or '.join(network.OUTER_DTYPES)}")
        for name in ("outer_every", "island_ranks"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        _positive("min_outer_every", self.min_outer_every)
        _positive("max_outer_every", self.max_outer_every)
        if self.max_outer_every < self.min_outer_every:
            raise UserError(f"--min-outer-every {self.min_outer_every}: above --max-outer-every "
                            f"{self.max_outer_every} (the largest H the plan recommends: "
                            f"docs/benchmarks.md); give both")
        if self.outer_every is not None and self.dp_mode != "diloco":
            raise UserError(f"--outer-every {self.outer_every}: the low-communication mode's; "
                            f"give --dp-mode diloco too")
        if self.island_ranks is not None:
            n, g, world = self.island_ranks, self.per_node, self.network_nodes * self.per_node
            if g % n if n <= g else n % g:
                raise UserError(f"--island-ranks {n}: the plan models an island as a divisor "
                                f"of a node's {g} device(s) (--gpus-per-node) or whole nodes "
                                f"(a multiple of it)")
            for what, ranks in (("--gpus", self.gpus), ("--nodes x --gpus-per-node", world)):
                if ranks % n:
                    raise UserError(f"--island-ranks {n}: {what} {ranks} is not a whole number "
                                    f"of islands")
        tokens = self.max_global_batch_tokens
        if tokens is not None:
            least = self.network_nodes * self.per_node * self.seq_len
            if not tokens > 0:
                raise UserError(f"--max-global-batch-tokens {tokens:g}: must be positive")
            if tokens < least:
                raise UserError(f"--max-global-batch-tokens {tokens:g}: below one sample a "
                                f"device ({self.network_nodes * self.per_node:,} devices x "
                                f"seq-len {self.seq_len} = {least:,} tokens)")

    @property
    def per_node(self) -> int:
        return min(self.gpus_per_node or 8, self.gpus)

    @property
    def network_nodes(self) -> int:
        return self.nodes or math.ceil(self.gpus / self.per_node)

    @property
    def island(self) -> int:
        """Ranks an island of the low-communication mode."""
        return self.island_ranks or self.per_node

    @property
    def memory_world(self) -> int:
        """The ranks ZeRO partitions over: the world, or an island in the low-communication
        mode (DeepSpeed's data-parallel group there)."""
        return self.island if self.dp_mode == "diloco" else self.gpus


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise UserError(f"--{_flag(name)} {value}: must be at least 1")


@dataclass(frozen=True)
class StagePlan:
    """One column of the plan: a ZeRO setup at the micro batch it is planned for."""

    memory: MemoryPlan
    """Bytes per device at `micro_batch`."""
    max_micro_batch: int
    """Largest micro batch that fits (0: none)."""
    micro_batch: int
    """The requested micro batch, else the largest that fits (at least 1)."""
    fits: bool
    global_batch: int
    tokens_per_sec: float | None
    """Whole job, at the assumed MFU (None without a peak TFLOP/s figure)."""
    step_time_s: float | None
    days: float | None
    cost: float | None


def throughput(flops_token: float, peak_tflops: float | None, mfu: float, gpus: int,
               global_batch_tokens: int, tokens: float) -> tuple[float | None, ...]:
    """(tokens/s of the job, seconds per step, days for `tokens`, GPU-hours) at `mfu`."""
    if peak_tflops is None:
        return None, None, None, None
    tokens_per_sec = mfu * peak_tflops * 1e12 * gpus / flops_token
    seconds = tokens / tokens_per_sec
    return tokens_per_sec, global_batch_tokens / tokens_per_sec, seconds / 86400, \
        seconds / 3600 * gpus


def plan_stage(info: ModelInfo, setup: ZeroSetup, work: Workload, device: DeviceProfile,
               budget: int, req: PlanRequest, peak: float | None, tokens: float) -> StagePlan:
    """Memory at the micro batch in use, the largest that fits, and the time and cost."""
    largest = max_micro_batch(info.shape, info.size, setup, work, device, budget)
    micro = req.micro_batch or max(largest, 1)
    memory = plan_memory(info.shape, info.size, setup, replace(work, micro_batch=micro), device)
    global_batch = micro * req.grad_accum * req.gpus
    head = head_fraction(info.objective, req.mask_prob)
    fpt = flops_per_token(info.shape, req.seq_len, head)
    tps, step, days, gpu_hours = throughput(fpt, peak, req.mfu, req.gpus,
                                            global_batch * req.seq_len, tokens)
    cost = (gpu_hours * req.price_per_gpu_hour
            if gpu_hours is not None and req.price_per_gpu_hour is not None else None)
    return StagePlan(memory, largest, micro, memory.total <= budget, global_batch, tps, step,
                     days, cost)


def recommend(stages: list[StagePlan], requested: int | None) -> tuple[int | None, str]:
    """(index of the stage to pick, the reason in one sentence)."""
    fitting = [i for i, s in enumerate(stages) if s.fits]
    if not fitting:
        best = max(range(len(stages)), key=lambda i: stages[i].max_micro_batch)
        return None, (f"micro batch {requested} fits no stage; the largest that fits is "
                      f"{stages[best].max_micro_batch} with {stages[best].memory.setup.label}")
    if requested:
        i = fitting[0]
        s = stages[i]
        return i, (f"{s.memory.setup.label} is the lowest stage where micro batch {requested} "
                   f"fits ({_gb(s.memory.total)} GB); higher stages only add communication")
    low = [i for i in fitting if stages[i].memory.setup.stage <= 2]
    if not low:
        i = fitting[0]
        label = stages[i].memory.setup.label
        why = ("the model states fit only when also the parameters are partitioned"
               if not stages[i].memory.setup.offload
               else "the model states fit only in host memory (expect a slower, PCIe-bound step)")
        return i, f"{label}: {why}, at micro batch {stages[i].max_micro_batch}"
    best = max(stages[i].max_micro_batch for i in low)
    i = next(i for i in low if stages[i].max_micro_batch >= 0.9 * best)
    s, z3 = stages[i], stages[3]
    extra = (f"; ZeRO-3 would fit {z3.max_micro_batch} for 1.5x the traffic"
             if z3.fits and z3.max_micro_batch > s.max_micro_batch else "")
    if s.memory.setup.stage == 0:
        return i, (f"ZeRO-0: micro batch {s.max_micro_batch} fits without partitioning, "
                   f"within 10% of what ZeRO-1/2 allow{extra}")
    return i, (f"{s.memory.setup.label}: fits micro batch {s.max_micro_batch} (ZeRO-0: "
               f"{stages[0].max_micro_batch}) with the same traffic as plain data "
               f"parallelism{extra}")


@dataclass(frozen=True)
class NetworkSetup:
    """The network the plan is for: the flags resolved against the presets."""

    link: network.Link
    nodes: int
    """The network section's largest node count (the scaling goes 1, 2, 4 ... nodes)."""
    interconnect: str | None
    """The preset the bandwidth or latency came from (None: both given by flags)."""
    assumed: bool
    """No --interconnect nor --net-gbps: the default preset."""


def network_setup(req: PlanRequest, accelerator: str | None) -> NetworkSetup:
    """Bandwidth and latency from --interconnect, --net-gbps, --net-latency-us; a bare --net-gbps
    takes the latency of the preset nearest in bandwidth; intra-node from the accelerator."""
    preset = network.INTERCONNECTS[req.interconnect or network.DEFAULT_INTERCONNECT]
    if req.net_gbps is not None and req.interconnect is None:
        preset = network.nearest_interconnect(req.net_gbps)
    intra_gbps, intra_us = network.intra_default(accelerator)
    link = network.Link(inter_gbps=req.net_gbps or preset.gbps,
                        inter_latency_us=(preset.latency_us if req.net_latency_us is None
                                          else req.net_latency_us),
                        intra_gbps=req.intra_gbps or intra_gbps, intra_latency_us=intra_us)
    named = (req.interconnect is not None or req.net_gbps is None
             or req.net_latency_us is None)
    return NetworkSetup(link, req.network_nodes, preset.name if named else None,
                        req.interconnect is None and req.net_gbps is None)


def app_comm_dtype(stage: int, precision: str) -> str:
    """The gradient reduction dtype `app train` gives DeepSpeed at `stage`: the train flag's
    default where it has one, else `communication_data_type` of the filled ds_config, else
    DeepSpeed's default (the run's precision)."""
    from app.config import add_arguments as train_arguments
    from app.runtime.ds_config import load_ds_config, zero_config_path

    parser = argparse.ArgumentParser(add_help=False)
    train_arguments(parser)
    flag = parser.get_default("grad_comm_dtype")
    if precision != "fp32" and flag in network.DTYPE_BYTES:
        return flag
    ds = setup_ds(load_ds_config(zero_config_path(stage)), precision, zero_config_path(stage))
    given = str(ds.get("communication_data_type") or precision).lower()
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp": "fp32"}.get(
        given, given if given in network.DTYPE_BYTES else precision)


@dataclass(frozen=True)
class StageNetwork:
    """One stage's communication on the planned network, at the largest node count."""

    job: network.Job
    comm_dtype: str
    at_nodes: network.StepTime
    timed: bool
    """False without a compute time (no peak TFLOP/s, no --compute-ms): only comm_ms holds."""
    scaling: list[dict[str, Any]]
    node_bytes: int
    """Bytes a node sends over its inter-node link per optimizer step (on average)."""
    mode: network.LowComm | None = None
    """The low-communication mode the figures are for (None: synchronous)."""


def compute_ms(req: PlanRequest, micro: int, grad_accum: int, peak: float | None,
               fpt: float) -> float | None:
    """One optimizer step's compute on one device: --compute-ms scaled by samples per device
    from the micro batch and accumulation it was measured at (its --step-ms part as it is: once
    a step), else FLOPs at the assumed MFU."""
    if req.compute_ms is not None:
        step = req.step_ms or 0.0
        return step + (req.compute_ms - step) * samples_ratio(req, micro, grad_accum)
    if peak is None:
        return None
    return 1000 * micro * grad_accum * req.seq_len * fpt / (req.mfu * peak * 1e12)


def samples_ratio(req: PlanRequest, micro: int, grad_accum: int) -> float:
    """Samples per device per step against those --compute-ms was measured at."""
    return (micro * grad_accum) / (req.micro_batch * req.grad_accum)


def forward_ms(req: PlanRequest, micro: int, grad_accum: int) -> float | None:
    """All micro steps' forward passes at a micro batch and accumulation, from --forward-ms
    (per micro step at --micro-batch); None where not measured."""
    if req.forward_ms is None:
        return None
    return req.forward_ms * req.grad_accum * samples_ratio(req, micro, grad_accum)


def cpu_ms_per_mb(req: PlanRequest) -> float:
    """--net-cpu-ms-per-mb, else gloo's measured cost on one core (CPU runs), else 0 (GPUs)."""
    if req.net_cpu_ms_per_mb is not None:
        return req.net_cpu_ms_per_mb
    return network.GLOO_CPU_MS_PER_MB if req.device_kind == "cpu" else 0.0


def network_job(req: PlanRequest, info: ModelInfo, setup: ZeroSetup, net: NetworkSetup,
                micro: int, grad_accum: int, compute: float | None,
                comm_dtype: str) -> network.Job:
    """The stage's collectives at a micro batch and accumulation (compute 1 ms when unknown:
    the communication itself does not depend on it)."""
    p = info.size.parameters
    return network.Job(
        stage=setup.stage, params=p, per_node=req.per_node,
        link=replace(net.link, cpu_ms_per_mb=cpu_ms_per_mb(req)),
        layout=backward_layout(info, req.mask_prob),
        compute_ms=compute or 1.0, grad_accum=grad_accum, precision=req.precision,
        comm_dtype=comm_dtype, backward_fraction=req.overlap_fraction, device=req.device_kind,
        step_ms=(req.step_ms or 0.0) if compute else 0.0,
        forward_ms=forward_ms(req, micro, grad_accum) if compute else None,
        buckets={"reduce_bucket": setup.reduce_bucket, "allgather_bucket": setup.allgather_bucket,
                 "prefetch_bucket": setup.prefetch_bucket,
                 "allreduce_bucket": setup.allreduce_bucket},
        zero3_gathers=1 if p <= setup.max_live_parameters else 2)


def plan_network(req: PlanRequest, info: ModelInfo, setup: ZeroSetup, stage: StagePlan,
                 net: NetworkSetup, peak: float | None, fpt: float,
                 outer_every: int | None = None, comm_dtype: str | None = None
                 ) -> StageNetwork:
    """A stage's figures at the table's micro batch, synchronous or, given `outer_every`, in
    the low-communication mode."""
    dtype = comm_dtype or req.comm_dtype or app_comm_dtype(setup.stage, req.precision)
    compute = compute_ms(req, stage.micro_batch, req.grad_accum, peak, fpt)
    job = network_job(req, info, setup, net, stage.micro_batch, req.grad_accum, compute, dtype)
    mode = (network.LowComm(job, req.island, outer_every, req.outer_dtype)
            if outer_every is not None else None)
    what = mode or job
    rows = (what.scaling(net.nodes, stage.micro_batch * req.grad_accum * req.seq_len)
            if compute is not None else [])
    return StageNetwork(job, dtype, what.at(net.nodes), compute is not None, rows,
                        what.node_bytes(net.nodes), mode)


_LAYOUTS: dict[tuple[str, float], tuple[network.Grad, ...]] = {}


def backward_layout(info: ModelInfo, mask_prob: float) -> tuple[network.Grad, ...]:
    """The trainable parameters in backward order (the reducer's), each with the share of
    backward's work done when its gradient is final and the share of forward's done before its
    first use. Work: a matrix's elements where a matmul uses it (an embedding lookup: none), the
    tied MLM decoder on the masked share of tokens only (the sparse head); a weight used twice
    (tied) is final after its last use in backward, the input embedding, at the very end."""
    # by the config's content: an id() is reused once a config is collected (a tune search
    # describes many models in one process)
    key = (info.config.to_json_string(use_diff=False), mask_prob)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = _layout(info, mask_prob)
    return _LAYOUTS[key]


def _layout(info: ModelInfo, mask_prob: float) -> tuple[network.Grad, ...]:
    import torch

    from app.models.build import build_model

    with torch.device("meta"):
        model = build_model(info.config)
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    uses = []  # (param, work) in forward order, a tied weight once per module using it
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.requires_grad and p.numel() > 0:
                matmul = p.dim() >= 2 and not isinstance(module, torch.nn.Embedding)
                share = mask_prob if id(p) in lookups and info.objective == "mlm" else 1.0
                uses.append((p, p.numel() * share if matmul else 0.0))
    total = sum(w for _, w in uses) or 1.0
    needed, ready, done = {}, {}, 0.0
    for p, w in uses:
        needed.setdefault(id(p), done / total)
        done += w
    done = 0.0
    for p, w in reversed(uses):
        done += w
        ready[id(p)] = done / total  # the last use in backward wins
    params = [p for p in model.parameters() if p.requires_grad and p.numel() > 0]
    return tuple(network.Grad(p.numel(), ready[id(p)], needed[id(p)]) for p in reversed(params))


MAX_GRAD_ACCUM = 64


def max_global_batch_tokens(req: PlanRequest, info: ModelInfo) -> int:
    """--max-global-batch-tokens, else the objective's default (MAX_GLOBAL_BATCH_TOKENS)."""
    if req.max_global_batch_tokens is not None:
        return int(req.max_global_batch_tokens)
    return MAX_GLOBAL_BATCH_TOKENS.get(info.objective, DEFAULT_MAX_GLOBAL_BATCH_TOKENS)


def _candidates(largest: int, also: int | None = None) -> list[int]:
    """Micro batches to try: powers of two within memory, the largest that fits, and `also`
    (the requested micro batch) where it fits."""
    extra = {also} if also and also <= largest else set()
    return sorted({m for m in (2 ** i for i in range(20)) if m <= largest} | {largest} | extra)


@dataclass(frozen=True)
class Option:
    """One way to run the job on the planned network: a mode, a stage and a batch, with its
    predicted optimizer step at the planned node count."""

    dp_mode: str
    outer_every: int | None
    setup: ZeroSetup
    micro_batch: int
    grad_accum: int
    global_batch: int
    """Samples per optimizer step, all devices."""
    global_batch_tokens: int
    t: network.StepTime
    scaling_efficiency: float
    """Tokens/s per device against one synchronous node's at the same batch, as the per-stage
    tables (network.scaling_rows)."""
    tokens_per_sec: float
    node_bytes: int
    """Bytes a node sends over its inter-node link per optimizer step, on average."""

    @property
    def efficiency(self) -> float:
        """The share of the step the devices compute: tokens/s per device against a node that
        communicates nothing. At most `scaling_efficiency` (a real node's step communicates
        too), and not raised by a batch that slows one node as well (ZeRO-2 at micro batch 1
        reduces over the node's devices every micro step)."""
        return self.t.compute_ms / self.t.step_ms

    def to_json(self, req: PlanRequest) -> dict[str, Any]:
        low = self.dp_mode == "diloco"
        outer_lr, outer_momentum = outer_defaults() if low else (None, None)
        return {"dp_mode": self.dp_mode, "outer_every": self.outer_every,
                "island_ranks": req.island if low else None,
                "outer_dtype": req.outer_dtype if low else None,
                "outer_lr": outer_lr, "outer_momentum": outer_momentum,
                "zero": self.setup.label, "zero_stage": self.setup.stage,
                "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                "global_batch": self.global_batch,
                "global_batch_tokens": self.global_batch_tokens, "step_ms": self.t.step_ms,
                "comm_ms": self.t.comm_ms, "exposed_comm_ms": self.t.exposed_comm_ms,
                "outer_sync_ms": self.t.outer_ms if low else None,
                "efficiency": self.efficiency,
                "scaling_efficiency": self.scaling_efficiency,
                "tokens_per_sec": self.tokens_per_sec,
                "node_bytes_per_step": self.node_bytes,
                "reaches_target": self.efficiency >= network.TARGET_EFFICIENCY}


@dataclass(frozen=True)
class NetworkChoice:
    """The network recommendation: the pick, why, and each mode's best within the bound."""

    pick: Option | None
    lines: tuple[str, ...]
    """Why, a line or two."""
    modes: list[Option]
    """Synchronous at each stage, then the low-communication mode at each H: each at its
    fastest stage and batch within memory and the bound (`modes_of`)."""
    bound: int
    """The global batch bound, tokens per optimizer step."""
    outer_every: int | None = None
    """The H for a --dp-mode diloco table without --outer-every: the pick's, else the smallest
    that reaches the target, else the largest tried."""

    @property
    def reason(self) -> str:
        return " ".join(self.lines)


def outer_every_candidates(req: PlanRequest) -> list[int]:
    """The H the plan predicts: network.OUTER_EVERY_CANDIDATES, the user's --outer-every and
    the bounds --min-outer-every and --max-outer-every (so that one at least may be
    recommended)."""
    extra = {req.outer_every} if req.outer_every else set()
    return sorted(set(network.OUTER_EVERY_CANDIDATES) | extra
                  | {req.min_outer_every, req.max_outer_every})


def search_options(req: PlanRequest, info: ModelInfo, setups: list[ZeroSetup],
                   largest: dict[str, list[int]], net: NetworkSetup, peak: float | None,
                   fpt: float, dtypes: list[str], bound: int) -> list[Option]:
    """Every mode, stage (not offload), micro batch (powers of two, the largest that fits and
    the requested) and accumulation (1, 2, 4 ... 64) within memory (`largest`: per mode, the
    largest micro batch per stage, ZeRO partitioning over the world or over an island) and the
    global batch bound, with its step at `net.nodes` nodes. The low-communication mode where
    `app train` runs it (two islands or more, ZeRO 0-2, not fp16: LowComm.runs); at each H it
    shares the batch's island step, only the outer sync's share changes with H."""
    world = net.nodes * req.per_node
    cap = bound // (world * req.seq_len)  # samples a device per optimizer step
    every = outer_every_candidates(req) if world // req.island > 1 else []  # one island: sync
    out = []
    for i, setup in enumerate(setups):
        top = min(max(largest["sync"][i], largest["diloco"][i]), cap)
        if setup.offload or top < 1:
            continue
        for micro in _candidates(top, req.micro_batch):
            gas = 1
            while gas <= MAX_GRAD_ACCUM and micro * gas <= cap:
                job = network_job(req, info, setup, net, micro, gas,
                                  compute_ms(req, micro, gas, peak, fpt), dtypes[i])
                one = job.at(1)
                tokens = micro * gas * req.seq_len  # a device's, per optimizer step

                def option(mode: str, h: int | None, t: network.StepTime, sent: int,
                           setup: ZeroSetup = setup, micro: int = micro, gas: int = gas,
                           tokens: int = tokens, one: network.StepTime = one) -> Option:
                    return Option(mode, h, setup, micro, gas, micro * gas * world,
                                  tokens * world, t, one.step_ms / t.step_ms,
                                  world * tokens / t.step_ms * 1000, sent)

                if micro <= largest["sync"][i]:
                    out.append(option("sync", None, job.at(net.nodes), job.node_bytes(net.nodes)))
                low = network.LowComm(job, req.island, 1, req.outer_dtype)
                if every and low.runs and micro <= largest["diloco"][i]:
                    island, island_nodes = low.inner(net.nodes)
                    inner = (one if island.per_node == job.per_node and island_nodes == 1
                             else island.at(island_nodes))
                    for h in every:
                        mode = replace(low, outer_every=h)
                        out.append(option("diloco", h, mode.at(net.nodes, inner),
                                          mode.node_bytes(net.nodes)))
                gas *= 2
    return out


def recommend_network(req: PlanRequest, info: ModelInfo, setups: list[ZeroSetup],
                      largest: dict[str, list[int]], net: NetworkSetup, peak: float | None,
                      fpt: float, dtypes: list[str]) -> NetworkChoice:
    """Mode, H, stage and batch within the global batch bound (efficiency: `Option.efficiency`,
    compute over the step). Synchronous data parallelism where some stage and batch reaches
    network.TARGET_EFFICIENCY at `net.nodes` nodes (the smallest batch per device that does,
    then `best_of`); else the low-communication mode at the smallest H within --min-outer-every
    and --max-outer-every that reaches it (quality falls as H grows: network.MIN_OUTER_EVERY,
    network.MAX_OUTER_EVERY), at its smallest batch there; else the fastest of either within
    those bounds, said so, with the smallest H above the bound that would reach it."""
    bound = max_global_batch_tokens(req, info)
    world = net.nodes * req.per_node
    where = (f"{net.link.inter_gbps:g} Gb/s per node, {net.nodes} node(s), global batch at "
             f"most {bound:,} tokens")
    if compute_ms(req, 1, 1, peak, fpt) is None:
        return NetworkChoice(None, ("no compute time to hide behind (give --gpu NAME, "
                                    "--peak-tflops or --compute-ms)",), [], bound)
    if bound < world * req.seq_len:
        return NetworkChoice(None, (f"{where}: the bound is below one sample a device "
                                    f"({world:,} x seq-len {req.seq_len}); raise "
                                    f"--max-global-batch-tokens",), [], bound)
    options = search_options(req, info, setups, largest, net, peak, fpt, dtypes, bound)
    if not options:
        return NetworkChoice(None, (f"{where}: no stage but ZeRO-3 + offload fits (its PCIe "
                                    f"traffic is not modelled)",), [], bound)
    target = network.TARGET_EFFICIENCY
    sync = [o for o in options if o.dp_mode == "sync"]
    low = [o for o in options if o.dp_mode == "diloco" and o.outer_every is not None
           and req.min_outer_every <= o.outer_every <= req.max_outer_every]
    sync_ok = [o for o in sync if o.efficiency >= target]
    low_ok = [o for o in low if o.efficiency >= target]
    if sync_ok:
        pick = smallest_batch(sync_ok)
    elif low_ok:
        h = min(o.outer_every or 0 for o in low_ok)
        pick = smallest_batch([o for o in low_ok if o.outer_every == h])
    else:
        pick = best_of(sync + low) or options[0]
    every = (pick.outer_every if pick.dp_mode == "diloco" else
             min((o.outer_every or 0 for o in low_ok),
                 default=max((o.outer_every or 0 for o in low), default=0)) or None)
    lines = _choice_reason(req, where, pick, best_of(sync))
    if pick.efficiency < target and low:
        lines += _what_would_reach(req, options, target, lambda: search_options(
            replace(req, outer_dtype="bf16"), info, setups, largest, net, peak, fpt, dtypes,
            bound))
    return NetworkChoice(pick, lines, modes_of(options, setups, outer_every_candidates(req)),
                         bound, every)


def _what_would_reach(req: PlanRequest, options: list[Option], target: float,
                      bf16: Callable[[], list[Option]]) -> tuple[str, ...]:
    """Where no H within the bounds reaches the target: a line for each way out that does, the
    bf16 outer exchange (half the bytes; `bf16`: the options with it) within the bounds, and
    the smallest H above --max-outer-every."""
    out = []

    def first_reaching(opts: list[Option], lo: int, hi: float) -> Option | None:
        ok = [o for o in opts if o.dp_mode == "diloco" and lo <= (o.outer_every or 0) <= hi
              and o.efficiency >= target]
        if not ok:
            return None
        h = min(o.outer_every or 0 for o in ok)
        return smallest_batch([o for o in ok if o.outer_every == h])

    half = (first_reaching(bf16(), req.min_outer_every, req.max_outer_every)
            if req.outer_dtype == "fp32" else None)
    if half is not None:
        out.append(f"With --outer-dtype bf16 (half the outer sync's bytes; the global weights and "
                   f"the outer step stay fp32) diloco at H={half.outer_every} would reach "
                   f"{half.efficiency:.2f}.")
    above = first_reaching(options, req.max_outer_every + 1, float("inf"))
    if above is not None:
        out.append(f"Diloco at H={above.outer_every} would reach {above.efficiency:.2f}: above "
                   f"--max-outer-every {req.max_outer_every}, the largest H measured to hold "
                   f"quality (docs/benchmarks.md); raise it once a quality run of your own holds "
                   f"there.")
    return tuple(out)


NEAR = 0.01
"""Options within this share of the fastest's tokens/s count as equally fast (the model is not
finer than that)."""


def best_of(options: list[Option]) -> Option | None:
    """The fastest (tokens/s); among those within NEAR of it, the lowest stage (the least
    traffic and memory copied), then the fewest micro steps."""
    if not options:
        return None
    top = max(o.tokens_per_sec for o in options)
    return min((o for o in options if o.tokens_per_sec >= (1 - NEAR) * top),
               key=lambda o: (o.setup.stage, o.grad_accum, o.micro_batch))


def smallest_batch(options: list[Option]) -> Option:
    """The smallest batch per device (micro batch x accumulation), then `best_of`."""
    least = min(o.micro_batch * o.grad_accum for o in options)
    return best_of([o for o in options if o.micro_batch * o.grad_accum == least]) or options[0]


def modes_of(options: list[Option], setups: list[ZeroSetup], every: list[int]) -> list[Option]:
    """Synchronous at each stage, then the low-communication mode at each H (its best stage),
    each at its fastest batch within the bound."""
    rows = [best_of([o for o in options if o.dp_mode == "sync" and o.setup == s])
            for s in setups]
    rows += [best_of([o for o in options if o.dp_mode == "diloco" and o.outer_every == h])
             for h in every]
    return [r for r in rows if r is not None]


def _choice_reason(req: PlanRequest, where: str, pick: Option,
                   sync: Option | None) -> tuple[str, ...]:
    """The pick in a line; where it is the low-communication mode, a second: what synchronous
    data parallelism reaches at best, and that quality depends on H."""
    target = network.TARGET_EFFICIENCY
    mode = ("synchronous" if pick.dp_mode == "sync" else
            f"diloco, an outer sync every {pick.outer_every} steps (islands of {req.island}, "
            f"{req.outer_dtype})")
    first = (f"{where}: " + ("" if pick.efficiency >= target else
                             f"nothing reaches efficiency {target:g}; closest: ")
             + f"{mode}, {pick.setup.label} at micro batch {pick.micro_batch} x grad accum "
             f"{pick.grad_accum}: efficiency {pick.efficiency:.2f}, {pick.t.step_ms:,.0f} ms a "
             f"step, {pick.tokens_per_sec:,.0f} tokens/s, {pick.node_bytes / MiB:,.1f} MB per "
             f"node per step, global batch {pick.global_batch_tokens:,} tokens.")
    if pick.dp_mode == "sync" or sync is None:
        return (first,)
    outer_lr, outer_momentum = outer_defaults()
    return first, (f"Synchronous at best: {sync.efficiency:.2f} ({sync.setup.label} at micro "
                   f"batch {sync.micro_batch} x grad accum {sync.grad_accum}, "
                   f"{sync.node_bytes / MiB:,.1f} MB per node per step). Quality depends on H "
                   f"({req.min_outer_every} to {req.max_outer_every} here): docs/benchmarks.md. "
                   f"Start "
                   f"synchronously: train the first steps with --dp-mode sync, then resume with "
                   f"--dp-mode diloco (outer lr {outer_lr:g}, Nesterov momentum "
                   f"{outer_momentum:g}; docs/recipes.md).")


def outer_defaults() -> tuple[float, float]:
    """`app train`'s outer learning rate and Nesterov momentum (--outer-lr, --outer-momentum):
    what a --dp-mode diloco pick runs with."""
    from app.config import TrainConfig

    return TrainConfig.outer_lr, TrainConfig.outer_momentum


def _gb(n: float) -> str:
    return f"{n / GiB:,.2f}"


def _duration(days: float) -> str:
    if days >= 1:
        return f"{days:,.1f} d"
    hours = days * 24
    return f"{hours:.1f} h" if hours >= 1 else f"{hours * 60:.1f} min"


@dataclass(frozen=True)
class Plan:
    """Everything `app plan` reports."""

    request: PlanRequest
    info: ModelInfo
    device: DeviceProfile
    accelerator: str | None
    budget: int
    """Memory per device in bytes."""
    peak_tflops: float | None
    tokens: float
    flops_per_token: float
    stages: list[StagePlan]
    pick: int | None
    reason: str
    net: NetworkSetup
    networks: list[StageNetwork]
    """Per stage, in the order of `stages`."""
    net_reason: str
    """The mode, H, stage, micro batch and accumulation recommended (a sentence or two)."""
    choice: NetworkChoice | None = None


def workload_for(req: PlanRequest, info: ModelInfo, seq_len: int | None = None,
                 gpus: int | None = None, outer_state: int | None = None) -> Workload:
    """One device's workload; ZeRO partitions over `gpus` (default: `req.memory_world`, the
    world or, in the low-communication mode, an island), and `outer_state` bytes a parameter of
    the rank's slice are the outer step's (default: --dp-mode's)."""
    hidden, attn = dropout_flags(info.config)
    return Workload(seq_len=seq_len or req.seq_len, micro_batch=1, precision=req.precision,
                    world=gpus or req.memory_world, devices_per_node=req.per_node,
                    checkpointing=req.checkpointing,
                    head_fraction=head_fraction(info.objective, req.mask_prob),
                    hidden_dropout=hidden, attention_dropout=attn,
                    eager_attention=req.attn == "eager", optimizer=req.optimizer,
                    outer_state=(OUTER_STATE_BYTES if req.dp_mode == "diloco" else 0)
                    if outer_state is None else outer_state)


def make_plan(req: PlanRequest, info: ModelInfo | None = None,
              setups: list[ZeroSetup] | None = None) -> Plan:
    """The whole plan; UserError when no stage fits even one sample (saying what would)."""
    from app.models.presets import parse_overrides

    info = info or describe_model(req.model, vocab_size=req.vocab_size,
                                  overrides=parse_overrides(list(req.model_args)))
    if info.shape.positions and req.seq_len > info.shape.positions:
        raise UserError(f"--seq-len {req.seq_len}: above the {info.shape.positions} positions "
                        f"of {req.model} (raise it with --model-arg)")
    acc = hardware.lookup(req.gpu) if req.gpu else None
    if acc is None and req.gpu_mem_gb is None:
        acc = hardware.lookup(DEFAULT_GPU)
    budget = int((req.gpu_mem_gb or acc.memory_gb) * GiB)
    peak = req.peak_tflops or (acc.peak_tflops(req.precision) if acc else None)
    device = replace(GPU, **{k: v for k, v in (
        ("runtime_bytes", None if req.runtime_gb is None else int(req.runtime_gb * GiB)),
        ("fragmentation", req.fragmentation)) if v is not None})
    tokens = req.tokens or CHINCHILLA_TOKENS_PER_PARAM * info.size.parameters
    setups = setups or zero_setups(info.shape.hidden)
    work = workload_for(req, info)
    stages = [plan_stage(info, s, work, device, budget, req, peak, tokens) for s in setups]
    if all(s.max_micro_batch == 0 for s in stages):
        raise UserError(nothing_fits(req, info, setups, device, budget))
    pick, reason = recommend(stages, req.micro_batch)
    fpt = flops_per_token(info.shape, req.seq_len, head_fraction(info.objective, req.mask_prob))
    net = network_setup(req, acc.name if acc else None)
    largest = {mode: [s.max_micro_batch for s in stages] if mode == req.dp_mode else
               [max_micro_batch(info.shape, info.size, su,
                                workload_for(req, info, gpus=world, outer_state=outer), device,
                                budget) for su in setups]
               for mode, world, outer in (("sync", req.gpus, 0),
                                          ("diloco", req.island, OUTER_STATE_BYTES))}
    dtypes = [req.comm_dtype or app_comm_dtype(su.stage, req.precision) for su in setups]
    choice = recommend_network(req, info, setups, largest, net, peak, fpt, dtypes)
    every = ((req.outer_every or choice.outer_every or req.min_outer_every)
             if req.dp_mode == "diloco" else None)
    nets = [plan_network(req, info, su, st, net, peak, fpt, every, dtype)
            for su, st, dtype in zip(setups, stages, dtypes)]
    return Plan(req, info, device, acc.name if acc else None, budget, peak, tokens, fpt, stages,
                pick, reason, net, nets, choice.reason, choice)


def nothing_fits(req: PlanRequest, info: ModelInfo, setups: list[ZeroSetup],
                 device: DeviceProfile, budget: int) -> str:
    """One line: what the model needs at least, and what would fit instead."""
    one = workload_for(req, info)
    least = min((plan_memory(info.shape, info.size, s, one, device) for s in setups),
                key=lambda m: m.total)
    head = (f"{_gb(budget)} GB per device fits no ZeRO stage for {req.model} at seq-len "
            f"{req.seq_len} (it needs at least {_gb(least.total)} GB, with "
            f"{least.setup.label} at micro batch 1)")
    if device.runtime_bytes >= budget:
        return (f"{head}: the per-device runtime alone (CUDA context, NCCL buffers) is assumed "
                f"to take {_gb(device.runtime_bytes)} GB (--runtime-gb)")
    fixes = [flag for flag, changed in (
        ("--gradient-checkpointing", replace(req, checkpointing=True)),
        ("--precision bf16", replace(req, precision="bf16")),
    ) if changed != req and _fits(changed, info, setups, device, budget)]
    seq = req.seq_len // 2
    while seq >= 8 and not _fits(replace(req, seq_len=seq), info, setups, device, budget):
        seq //= 2
    if seq >= 8:
        fixes.append(f"--seq-len {seq}")
    gpus = req.gpus * 2
    while gpus <= 2 ** 16 and not _fits(replace(req, gpus=gpus), info, setups[3:4], device,
                                        budget):
        gpus *= 2
    if gpus <= 2 ** 16:
        fixes.append(f"ZeRO-3 over --gpus {gpus}")
    return f"{head}; what would fit: {' or '.join(fixes) if fixes else 'a smaller model'}"


def _fits(req: PlanRequest, info: ModelInfo, setups: list[ZeroSetup], device: DeviceProfile,
          budget: int) -> bool:
    work = workload_for(req, info)
    return any(max_micro_batch(info.shape, info.size, s, work, device, budget) for s in setups)


def to_json(plan: Plan) -> dict[str, Any]:
    """The plan as JSON-able data (bytes as integers, per device unless named otherwise)."""
    req, info, choice = plan.request, plan.info, plan.choice
    stages = []
    for i, s in enumerate(plan.stages):
        m = s.memory
        stages.append({
            "zero": m.setup.label, "zero_stage": m.setup.stage, "offload": m.setup.offload,
            "parameters_bytes": m.parameters, "gradients_bytes": m.gradients,
            "optimizer_states_bytes": m.optimizer, "buffers_bytes": m.buffers,
            "activations_bytes": m.activations,
            "activations_per_sample_bytes": m.activations_per_sample,
            "activations_per_sample_checkpointed_bytes": m.activations_per_sample_ckpt,
            "transient_bytes": m.transient, "fragmentation_bytes": m.fragmentation,
            "runtime_bytes": m.runtime, "total_bytes": m.total,
            "host_per_node_bytes": m.host_per_node, "fits": s.fits,
            "max_micro_batch": s.max_micro_batch, "micro_batch": s.micro_batch,
            "global_batch": s.global_batch, "tokens_per_sec": s.tokens_per_sec,
            "step_time_s": s.step_time_s, "days": s.days, "cost": s.cost,
            "recommended": i == plan.pick, "network": _network_json(plan.networks[i])})
    pick = plan.stages[plan.pick].memory.setup.label if plan.pick is not None else None
    return {
        "model": {"preset": req.model, "objective": info.objective, "model_type":
                  info.shape.model_type, "parameters": info.size.parameters,
                  "largest_layer_parameters": info.size.largest_layer,
                  "hidden": info.shape.hidden, "layers": info.shape.layers,
                  "heads": info.shape.heads, "vocab": info.shape.vocab,
                  "flops_per_token": plan.flops_per_token},
        "inputs": {"seq_len": req.seq_len, "micro_batch": req.micro_batch,
                   "grad_accum": req.grad_accum, "precision": req.precision,
                   "gradient_checkpointing": req.checkpointing, "optimizer": req.optimizer,
                   "gpus": req.gpus, "gpus_per_node": req.per_node,
                   "accelerator": plan.accelerator, "memory_per_device_bytes": plan.budget,
                   "peak_tflops": plan.peak_tflops, "mfu": req.mfu, "tokens": plan.tokens,
                   "price_per_gpu_hour": req.price_per_gpu_hour},
        "stages": stages,
        "recommendation": {"zero": pick, "reason": plan.reason},
        "network": {"interconnect": plan.net.interconnect, "assumed": plan.net.assumed,
                    "net_gbps": plan.net.link.inter_gbps,
                    "net_latency_us": plan.net.link.inter_latency_us,
                    "intra_gbps": plan.net.link.intra_gbps,
                    "intra_latency_us": plan.net.link.intra_latency_us,
                    "nodes": plan.net.nodes, "gpus_per_node": req.per_node,
                    "compute_from": "measured" if req.compute_ms else "mfu",
                    "step_ms": req.step_ms, "forward_ms": req.forward_ms,
                    "overlap_fraction": req.overlap_fraction, "device_kind": req.device_kind,
                    "net_cpu_ms_per_mb": cpu_ms_per_mb(req),
                    "dp_mode": req.dp_mode, "outer_every": _table_every(plan),
                    "island_ranks": req.island, "outer_dtype": req.outer_dtype,
                    "min_outer_every": req.min_outer_every,
                    "max_outer_every": req.max_outer_every,
                    "max_global_batch_tokens": choice.bound if choice else None,
                    "target_efficiency": network.TARGET_EFFICIENCY,
                    "recommendation": plan.net_reason,
                    "pick": choice.pick.to_json(req) if choice and choice.pick else None,
                    "modes": [o.to_json(req) for o in choice.modes] if choice else []},
    }


def _table_every(plan: Plan) -> int | None:
    """The H the per-stage tables are for (None: synchronous)."""
    modes = [n.mode for n in plan.networks if n.mode is not None]
    return modes[0].outer_every if modes else None


def _network_json(n: StageNetwork) -> dict[str, Any]:
    """A stage's network figures at the largest node count (times in ms per optimizer step)."""
    at, last = n.at_nodes, (n.scaling[-1] if n.scaling else {})
    return {"path": network.path_of(n.job.stage, n.job.precision), "comm_dtype": n.comm_dtype,
            "comm_ms": at.comm_ms, "exposed_comm_ms": at.exposed_comm_ms if n.timed else None,
            "cpu_comm_ms": at.cpu_comm_ms,
            "step_ms": at.step_ms if n.timed else None,
            "compute_ms": at.compute_ms if n.timed else None,
            "tokens_per_sec": last.get("tokens_per_sec"), "efficiency": last.get("efficiency"),
            "node_bytes_per_step": n.node_bytes, "collectives": at.parts,
            "dp_mode": "diloco" if n.mode else "sync",
            "outer_every": n.mode.outer_every if n.mode else None,
            "outer_sync_ms": at.outer_ms if n.mode else None,
            "runs_in_train": n.mode.runs if n.mode else True,
            "scaling": n.scaling}


def render(plan: Plan) -> str:
    """The plan as a table for the terminal."""
    req, info = plan.request, plan.info
    nodes = math.ceil(req.gpus / req.per_node)
    peak = (f"MFU {req.mfu:.0%} of {plan.peak_tflops:,.1f} TFLOP/s"
            + (f" ({plan.accelerator})" if plan.accelerator else "") if plan.peak_tflops else
            "no peak TFLOP/s for time and cost (give --gpu NAME or --peak-tflops)")
    lines = [
        f"{req.model} ({info.objective}): {info.size.parameters / 1e6:,.1f}M parameters, vocab "
        f"{info.shape.vocab:,}, seq-len {req.seq_len}, {req.precision}, {req.optimizer}"
        f"{', activation checkpointing' if req.checkpointing else ''}",
        f"{req.gpus} device(s) ({nodes} node(s) x {req.per_node}), {_gb(plan.budget)} GB each; "
        f"{plan.flops_per_token / 1e9:,.2f} GFLOP per token; {plan.tokens / 1e9:,.2f}B tokens"
        f"{' (20 per parameter)' if not req.tokens else ''}; {peak}",
        "",
    ]
    lines += aligned(_rows(plan))
    lines += ["", f"pick: {plan.reason}", ""] + render_network(plan)
    return "\n".join(lines)


def aligned(rows: list[tuple[str, list[str]]], cell: int | list[int] = 13) -> list[str]:
    """Table lines: the labels left-aligned, each column right-aligned in `cell` characters (one
    figure for every column, or one a column), wider where a cell needs it, so that no two
    columns run together at any size (a thousand nodes' tokens/s)."""
    width = max(len(label) for label, _ in rows)
    count = max(len(cells) for _, cells in rows)
    least = cell if isinstance(cell, list) else [cell] * count
    widths = [max([least[min(i, len(least) - 1)]] +
                  [len(cells[i]) + 2 for _, cells in rows if i < len(cells)])
              for i in range(count)]
    return [f"{label:<{width}}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths))
            for label, cells in rows]


def render_network(plan: Plan) -> list[str]:
    """The network section: per stage at the largest node count, and efficiency by node count."""
    req, net, link = plan.request, plan.net, plan.net.link
    source = (f"{net.interconnect} preset" if net.interconnect else "flags") + (
        ", assumed: give --interconnect or --net-gbps" if net.assumed else "")
    parts = "".join(f", {name} {value:g} ms" for name, value in (
        ("optimizer step", req.step_ms), ("forward per micro step", req.forward_ms))
        if value is not None)
    compute = (f"compute: measured {req.compute_ms:g} ms per step at micro batch "
               f"{req.micro_batch} x {req.grad_accum}{parts}" if req.compute_ms else
               "compute: FLOPs at the assumed MFU" if plan.peak_tflops else
               "compute: unknown (no peak TFLOP/s), so communication only")
    lines = [f"network: {link.inter_gbps:,g} Gb/s per node, {link.inter_latency_us:g} us per "
             f"ring step ({source}); {link.intra_gbps:,g} Gb/s between a node's devices; "
             f"{net.nodes} node(s) x {req.per_node}; {compute}"]
    every = _table_every(plan)
    if every is not None:
        lines.append(f"mode: diloco, islands of {req.island} rank(s) (ZeRO partitions over an "
                     f"island), an outer sync of the {req.outer_dtype} weights every {every} "
                     f"steps, blocking" + ("" if req.outer_every else ", H as recommended")
                     + "; app train runs it at ZeRO 0-2 in fp32 or bf16")
    lines += aligned(_network_rows(plan))
    why = plan.choice.lines if plan.choice else (plan.net_reason,)
    return lines + render_modes(plan) + ["", f"network pick: {why[0]}", *why[1:]]


def render_modes(plan: Plan) -> list[str]:
    """Each mode's fastest within the bound: synchronous per stage, diloco per H."""
    choice = plan.choice
    if choice is None or not choice.modes:
        return []
    req = plan.request
    default = "" if req.max_global_batch_tokens else (
        f" (the {plan.info.objective} default; --max-global-batch-tokens sets it)")
    head = ("mode", "ZeRO", "micro x accum", "step (ms)", "efficiency", "MB/node/step")
    rows = [head] + [(
        "sync" if o.dp_mode == "sync" else f"diloco H={o.outer_every}"
        + (" (below min)" if (o.outer_every or 0) < req.min_outer_every else
           " (above max)" if (o.outer_every or 0) > req.max_outer_every else ""),
        o.setup.label, f"{o.micro_batch} x {o.grad_accum}", f"{o.t.step_ms:,.1f}",
        f"{o.efficiency:.2f}", f"{o.node_bytes / MiB:,.1f}") for o in choice.modes]
    return ["", f"modes at {plan.net.nodes} node(s), each at its fastest batch within "
            f"{choice.bound:,} tokens a step{default}:"] + aligned(
        [(r[0], list(r[1:])) for r in rows], [8, 15])


def _network_rows(plan: Plan) -> list[tuple[str, list[str]]]:
    nets, n = plan.networks, plan.net.nodes

    def row(label: str, values: list[Any], fmt) -> tuple[str, list[str]]:
        return label, [("-" if v is None else fmt(v)) for v in values]

    def ms(v: float) -> str:
        return f"{v:,.1f}"

    timed = [x.timed for x in nets]
    every = _table_every(plan)
    rows = [
        (f"per optimizer step, {n} node(s)" + (f", diloco H={every}" if every else ""),
         [s.memory.setup.label.replace(" + offload", "+off") for s in plan.stages]),
        row("gradient comm dtype", [x.comm_dtype for x in nets], str),
        row("GB sent per node" + (" (mean)" if every else ""), [x.node_bytes for x in nets],
            _gb),
        row("communication (ms)", [x.at_nodes.comm_ms for x in nets], ms),
    ] + ([row("outer sync, each (ms)", [x.at_nodes.outer_ms for x in nets], ms),
          row("app train runs it", [x.mode and x.mode.runs for x in nets],
              lambda v: "yes" if v else "no")]
         if every else []) + [
        row("exposed (ms)", [x.at_nodes.exposed_comm_ms if t else None
                             for x, t in zip(nets, timed)], ms),
        row("step time (ms)", [x.at_nodes.step_ms if t else None for x, t in zip(nets, timed)],
            ms),
        row("tokens/s", [x.scaling[-1]["tokens_per_sec"] if x.scaling else None for x in nets],
            lambda v: f"{v:,.0f}"),
    ]
    for i, count in enumerate(network.node_counts(n)):
        rows.append(row(f"efficiency, {count} node(s)",
                        [x.scaling[i]["efficiency"] if x.scaling else None for x in nets],
                        lambda v: f"{v:.2f}"))
    return rows


def _rows(plan: Plan) -> list[tuple[str, list[str]]]:
    st = plan.stages
    mem = [s.memory for s in st]

    def row(label: str, values: list[Any], fmt) -> tuple[str, list[str]]:
        return label, [("-" if v is None else fmt(v)) for v in values]

    micro = "micro batch" if plan.request.micro_batch else "largest micro batch"
    return [
        ("GB per device", [m.setup.label.replace(" + offload", "+off") for m in mem]),
        row("parameters", [m.parameters for m in mem], _gb),
        row("gradients", [m.gradients for m in mem], _gb),
        row("optimizer states", [m.optimizer for m in mem], _gb),
        row("buffers (comm, ZeRO-3 gathered)", [m.buffers for m in mem], _gb),
        row(f"activations ({micro})", [m.activations for m in mem], _gb),
        row("  per sample", [m.activations_per_sample for m in mem], _gb),
        row("  per sample, checkpointed", [m.activations_per_sample_ckpt for m in mem], _gb),
        row("backward transient (LM head)", [m.transient for m in mem], _gb),
        row("fragmentation allowance", [m.fragmentation for m in mem], _gb),
        row("runtime (context, NCCL)", [m.runtime for m in mem], _gb),
        row("total", [m.total for m in mem], _gb),
        row("host memory per node", [m.host_per_node or None for m in mem], _gb),
        row("largest micro batch", [s.max_micro_batch for s in st], lambda v: f"{v:,}"),
        row("global batch (samples)", [s.global_batch if s.fits else None for s in st],
            lambda v: f"{v:,}"),
        row("tokens/s (whole job)", [s.tokens_per_sec for s in st], lambda v: f"{v:,.0f}"),
        row("step time (s)", [s.step_time_s if s.fits else None for s in st],
            lambda v: f"{v:,.2f}"),
        row("time to train the tokens", [s.days for s in st], _duration),
        row("cost", [s.cost for s in st], lambda v: f"{v:,.0f}"),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", required=True, metavar="PRESET", help="model preset (as app train)")
    a("--model-arg", dest="model_args", action="append", default=[], metavar="KEY=VALUE",
      help="config field override (as app train)")
    a("--vocab-size", type=int, metavar="N", help="vocabulary (default: the config class's)")
    a("--seq-len", type=int, default=128, metavar="N", help="tokens per sample (default 128)")
    a("--micro-batch", type=int, metavar="N", help="samples per device per pass (default: the "
      "largest that fits, per stage)")
    a("--grad-accum", type=int, default=1, metavar="N", help="micro steps per optimizer step")
    a("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    a("--gradient-checkpointing", dest="checkpointing", action="store_true",
      help="plan with activation checkpointing")
    a("--gpus", type=int, metavar="N", help="devices in the whole job (default 1, or --nodes x "
      "--gpus-per-node)")
    a("--gpus-per-node", type=int, metavar="N", help="devices per node (default min(gpus, 8))")
    mem = parser.add_mutually_exclusive_group()
    mem.add_argument("--gpu", metavar="NAME", help=f"accelerator: {', '.join(hardware.names())} "
                     f"(default {DEFAULT_GPU})")
    mem.add_argument("--gpu-mem-gb", type=float, metavar="G", help="memory per device (GiB)")
    a("--peak-tflops", type=float, metavar="F", help="dense peak per device (default: the "
      "accelerator's for the precision)")
    a("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATE_BYTES))
    a("--tokens", type=float, metavar="N", help="tokens to train (default 20 per parameter)")
    a("--mfu", type=float, default=0.35, metavar="F", help="assumed MFU (default 0.35)")
    a("--price-per-gpu-hour", type=float, metavar="F", help="for the cost row")
    a("--mask-prob", type=float, default=0.15, metavar="F", help="MLM masked fraction")
    a("--attn", default="sdpa", choices=("sdpa", "flash_attention_2", "flex", "eager"),
      help="the attention kernel (default sdpa); flex and flash_attention_2 are fused as SDPA is "
      "(no S x S scores kept)")
    a("--runtime-gb", type=float, metavar="G", help="per-device runtime memory (default "
      f"{GPU.runtime_bytes / GiB:g})")
    a("--fragmentation", type=float, metavar="F", help="allowance on activations (default "
      f"{GPU.fragmentation:g})")
    add_network_arguments(parser)
    a("--json", action="store_true", help="print JSON instead of the table")
    a("--plot", metavar="PATH", help="write the predicted scaling efficiency against nodes, per "
      "stage, as a PNG")


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--nodes", type=int, metavar="N", help="nodes the network section scales to (default: "
      "gpus / gpus-per-node; without --gpus, --gpus is N x gpus-per-node)")
    a("--interconnect", metavar="NAME", help="network preset: " + ", ".join(
        f"{i.name} ({i.gbps:g} Gb/s, {i.latency_us:g} us)" for i in
        network.INTERCONNECTS.values()) + f" (default {network.DEFAULT_INTERCONNECT})")
    a("--net-gbps", type=float, metavar="G", help="inter-node bandwidth per node, Gb/s (shared "
      "by its devices; default: the preset's)")
    a("--net-latency-us", type=float, metavar="US", help="latency of one message between "
      "nodes (default: the preset's, or the preset's nearest --net-gbps)")
    a("--intra-gbps", type=float, metavar="G", help="bandwidth between a node's devices, per "
      "device, Gb/s (default: the accelerator's NVLink/PCIe figure)")
    a("--comm-dtype", choices=sorted(network.DTYPE_BYTES), help="gradient reduction dtype "
      "(default: what app train gives DeepSpeed)")
    a("--compute-ms", type=float, metavar="MS", help="a measured one-node optimizer step at "
      "--micro-batch and --grad-accum: replaces the FLOPs/MFU estimate")
    a("--step-ms", type=float, metavar="MS", help="the optimizer step's part of --compute-ms "
      "(a run's perf/optimizer_ms): nothing overlaps it, and it does not grow with the batch "
      "(default: counted as forward and backward)")
    a("--forward-ms", type=float, metavar="MS", help="the forward pass's part of --compute-ms "
      "per micro step (a run's perf/forward_ms): the window ZeRO-1/2's weight gathers hide "
      "behind; backward is the rest (default: --overlap-fraction)")
    a("--overlap-fraction", type=float, default=network.BACKWARD_FRACTION, metavar="F",
      help="share of a micro step that hides an overlapped gradient reduction (default 2/3: "
      "backward)")
    a("--device-kind", default="gpu", choices=("gpu", "cpu"), help="which overlap assumptions "
      "apply: cpu for DeepSpeed's CPU accelerator (a simulated cluster), whose side streams are "
      "no-ops (default gpu)")
    a("--net-cpu-ms-per-mb", type=float, metavar="MS", help="CPU ms a rank's own core spends "
      "per MB its node sends, taken from compute (default: "
      f"{network.GLOO_CPU_MS_PER_MB:g}, gloo's measured, with --device-kind cpu; else 0)")
    a("--dp-mode", default="sync", choices=network.DP_MODES, help="the data parallelism the "
      "per-stage tables show: sync (one group over the world, default) or diloco (islands "
      "synchronous inside, an outer sync every --outer-every steps); the recommendation "
      "weighs both")
    a("--outer-every", type=int, metavar="H", help="diloco: optimizer steps between outer "
      "syncs (default: the recommended)")
    a("--island-ranks", type=int, metavar="N", help="diloco: ranks an island, a divisor of "
      "--gpus-per-node or whole nodes (default: --gpus-per-node)")
    a("--outer-dtype", default="fp32", choices=network.OUTER_DTYPES, help="diloco: the outer "
      "sync's exchange dtype (default fp32)")
    a("--min-outer-every", type=int, default=network.MIN_OUTER_EVERY, metavar="H",
      help=f"the smallest H the plan recommends (default {network.MIN_OUTER_EVERY}: quality "
      "depends on H; docs/plan.md)")
    a("--max-outer-every", type=int, default=network.MAX_OUTER_EVERY, metavar="H",
      help=f"the largest H the plan recommends (default {network.MAX_OUTER_EVERY}: the largest "
      "measured to hold quality within 2 %% of synchronous; docs/benchmarks.md)")
    a("--max-global-batch-tokens", type=float, metavar="T", help="tokens per optimizer step "
      "no recommendation exceeds (default: " + ", ".join(
          f"{k} {v:,}" for k, v in MAX_GLOBAL_BATCH_TOKENS.items()) + ")")


def run(args: argparse.Namespace) -> int:
    names = set(PlanRequest.__dataclass_fields__)
    if args.gpus is None:
        args.gpus = args.nodes * (args.gpus_per_node or 8) if args.nodes else 1
    req = PlanRequest(**{k: v for k, v in vars(args).items() if k in names and k != "model_args"},
                      model_args=tuple(args.model_args))
    if args.plot:  # refused before the plan is made
        output.claim_file(Path(args.plot), "--plot", ours=plan_plot, what="plot")
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import logs to stdout
        plan = make_plan(req)
    if args.plot:
        write_plot(plan, args.plot)
    if args.json:
        json.dump(to_json(plan), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(plan))
    return 0


PLOT_SOFTWARE = "dspretrain app plan"  # the PNG's Software text: what makes a plot plan's own


def plan_plot(path: Path) -> bool:
    """True when `path` is a PNG an earlier `app plan --plot` wrote (its Software text chunk,
    which comes before the image data)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"\x89PNG\r\n\x1a\n") and PLOT_SOFTWARE.encode() in head


def write_plot(plan: Plan, path: str) -> None:
    """The predicted scaling efficiency against nodes per stage (the paper's Figure 1), through
    the file gate of data_tools/output.py: never over a file plan did not write."""
    import io

    target = Path(path)
    output.claim_file(target, "--plot", ours=plan_plot, what="plot")
    try:
        import matplotlib
    except ImportError:
        raise UserError(f"--plot {path}: matplotlib is not installed") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    if not any(n.scaling for n in plan.networks):
        raise UserError(f"--plot {path}: no compute time to plot against (give --gpu NAME, "
                        f"--peak-tflops or --compute-ms)")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (stage, n) in enumerate(zip(plan.stages, plan.networks)):
        xs = [r["nodes"] for r in n.scaling]
        ax.plot(xs, [r["efficiency"] for r in n.scaling], "o--" if stage.memory.setup.offload
                else "o-", color=f"C{i}", label=stage.memory.setup.label)
    ax.axhline(1.0, color="gray", linestyle=":", label="ideal")
    link = plan.net.link
    every = _table_every(plan)
    ax.set_title(f"{plan.request.model}: predicted scaling efficiency, "
                 f"{link.inter_gbps:g} Gb/s per node" + (f", diloco H={every}" if every else ""))
    ax.set_xlabel(f"nodes ({plan.request.per_node} device(s) each)")
    ax.set_ylabel("efficiency (tokens/s per device against one node)")
    ax.set_xscale("log", base=2)
    xs = network.node_counts(plan.net.nodes)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_ylim(0, 1.1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=100, metadata={"Software": PLOT_SOFTWARE})
    finally:
        plt.close(fig)
    output.make_dirs(target.parent, "--plot")
    output.write_bytes_atomic(target, buf.getvalue())
