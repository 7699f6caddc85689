"""`python -m app plan`: memory and throughput per ZeRO stage before a run.

For ZeRO 0, 1, 2, 3 and 3 + offload: bytes per device by term (app.plan.memory), the largest micro
batch that fits, the global batch, tokens/s and step time at an assumed MFU (app.telemetry.flops,
app.telemetry.hardware), days and cost to train the token budget, and which stage to pick; then
the network (app.plan.network): communication per step, the part compute does not hide, step time
and scaling efficiency from 1 to N nodes, and the micro batch / gradient accumulation / stage that
hides the communication. Formulas: docs/plan.md. Nothing is downloaded or allocated: the model is
built on PyTorch's meta device to count its parameters.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from dataclasses import dataclass, replace
from typing import Any

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
from data_tools.errors import UserError

CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022: compute-optimal tokens per parameter
DEFAULT_GPU = "H100-SXM"


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
    """sdpa/flash_attention_2 (fused: no S x S scores) or eager."""
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

    def __post_init__(self) -> None:
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

    @property
    def per_node(self) -> int:
        return min(self.gpus_per_node or 8, self.gpus)

    @property
    def network_nodes(self) -> int:
        return self.nodes or math.ceil(self.gpus / self.per_node)


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
    """Bytes a node sends over its inter-node link per optimizer step."""


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
                 net: NetworkSetup, peak: float | None, fpt: float) -> StageNetwork:
    dtype = req.comm_dtype or app_comm_dtype(setup.stage, req.precision)
    compute = compute_ms(req, stage.micro_batch, req.grad_accum, peak, fpt)
    job = network_job(req, info, setup, net, stage.micro_batch, req.grad_accum, compute, dtype)
    rows = (job.scaling(net.nodes, stage.micro_batch * req.grad_accum * req.seq_len)
            if compute is not None else [])
    return StageNetwork(job, dtype, job.at(net.nodes), compute is not None, rows,
                        network.node_bytes(job.collectives(net.nodes * req.per_node), net.nodes,
                                           req.grad_accum))


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

    from app.model import build_model

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


HIDDEN_SHARE = 0.10
"""Communication counts as hidden when its exposed part is at most this share of the step."""
MAX_GRAD_ACCUM = 64


def _candidates(largest: int) -> list[int]:
    """Micro batches to try: powers of two within memory, and the largest that fits."""
    return sorted({m for m in (2 ** i for i in range(20)) if m <= largest} | {largest})


def recommend_network(req: PlanRequest, info: ModelInfo, setups: list[ZeroSetup],
                      stages: list[StagePlan], net: NetworkSetup, peak: float | None,
                      fpt: float, dtypes: list[str]) -> str:
    """The smallest batch per device (micro batch x accumulation, within memory) at which a
    stage's exposed communication is at most HIDDEN_SHARE of the step at `net.nodes` nodes."""
    if compute_ms(req, 1, 1, peak, fpt) is None:
        return "no compute time to hide behind (give --gpu NAME, --peak-tflops or --compute-ms)"
    best = fallback = None  # rows: ((samples per device, -tokens/s, stage), label, micro, gas, t)
    for i, (setup, stage) in enumerate(zip(setups, stages)):
        if setup.offload or stage.max_micro_batch < 1:
            continue
        for micro in _candidates(stage.max_micro_batch):
            gas = 1
            while gas <= MAX_GRAD_ACCUM:
                job = network_job(req, info, setup, net, micro, gas,
                                  compute_ms(req, micro, gas, peak, fpt), dtypes[i])
                t = job.at(net.nodes)
                tps = net.nodes * req.per_node * micro * gas * req.seq_len / t.step_ms * 1000
                key = (micro * gas, -tps, i)
                row = (key, setup.label, micro, gas, t)
                if t.exposed_comm_ms <= HIDDEN_SHARE * t.step_ms:
                    best = min(best, row) if best else row
                    break
                fallback = min(fallback, row, key=lambda r: r[0][1]) if fallback else row
                gas *= 2
    return _network_reason(req, net, best, fallback)


def _network_reason(req: PlanRequest, net: NetworkSetup, best, fallback) -> str:
    where = f"{net.link.inter_gbps:g} Gb/s per node, {net.nodes} node(s)"
    if best is None and fallback is None:
        return f"{where}: no stage fits"
    (_, tps_neg, _), label, micro, gas, t = best or fallback
    share = t.exposed_comm_ms / t.step_ms
    what = (f"{label} at micro batch {micro} x grad accum {gas}" + (
        " hides the communication" if best else
        f" comes closest (nothing within grad accum {MAX_GRAD_ACCUM} hides it)"))
    return (f"{where}: {what}: exposed {share:.0%} of a {t.step_ms:,.0f} ms step, "
            f"{-tps_neg:,.0f} tokens/s, global batch "
            f"{micro * gas * net.nodes * req.per_node:,} samples")


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
    """The micro batch / accumulation / stage that hides the communication (one sentence)."""


def workload_for(req: PlanRequest, info: ModelInfo, seq_len: int | None = None,
                 gpus: int | None = None) -> Workload:
    hidden, attn = dropout_flags(info.config)
    return Workload(seq_len=seq_len or req.seq_len, micro_batch=1, precision=req.precision,
                    world=gpus or req.gpus, devices_per_node=req.per_node,
                    checkpointing=req.checkpointing,
                    head_fraction=head_fraction(info.objective, req.mask_prob),
                    hidden_dropout=hidden, attention_dropout=attn,
                    eager_attention=req.attn == "eager", optimizer=req.optimizer)


def make_plan(req: PlanRequest, info: ModelInfo | None = None,
              setups: list[ZeroSetup] | None = None) -> Plan:
    """The whole plan; UserError when no stage fits even one sample (saying what would)."""
    from app.model import parse_overrides

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
    nets = [plan_network(req, info, su, st, net, peak, fpt) for su, st in zip(setups, stages)]
    net_reason = recommend_network(req, info, setups, stages, net, peak, fpt,
                                   [n.comm_dtype for n in nets])
    return Plan(req, info, device, acc.name if acc else None, budget, peak, tokens, fpt, stages,
                pick, reason, net, nets, net_reason)


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
    req, info = plan.request, plan.info
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
                    "recommendation": plan.net_reason},
    }


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
    rows = _rows(plan)
    width = max(len(r[0]) for r in rows)
    for label, cells in rows:
        lines.append(f"{label:<{width}}" + "".join(f"{c:>13}" for c in cells))
    lines += ["", f"pick: {plan.reason}", ""] + render_network(plan)
    return "\n".join(lines)


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
    rows = _network_rows(plan)
    width = max(len(r[0]) for r in rows)
    lines += [f"{label:<{width}}" + "".join(f"{c:>13}" for c in cells) for label, cells in rows]
    return lines + ["", f"network pick: {plan.net_reason}"]


def _network_rows(plan: Plan) -> list[tuple[str, list[str]]]:
    nets, n = plan.networks, plan.net.nodes

    def row(label: str, values: list[Any], fmt) -> tuple[str, list[str]]:
        return label, [("-" if v is None else fmt(v)) for v in values]

    def ms(v: float) -> str:
        return f"{v:,.1f}"

    timed = [x.timed for x in nets]
    rows = [
        (f"per optimizer step, {n} node(s)",
         [s.memory.setup.label.replace(" + offload", "+off") for s in plan.stages]),
        row("gradient comm dtype", [x.comm_dtype for x in nets], str),
        row("GB sent per node", [x.node_bytes for x in nets], _gb),
        row("communication (ms)", [x.at_nodes.comm_ms for x in nets], ms),
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
    a("--attn", default="sdpa", choices=("sdpa", "flash_attention_2", "eager"))
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


def run(args: argparse.Namespace) -> int:
    names = set(PlanRequest.__dataclass_fields__)
    if args.gpus is None:
        args.gpus = args.nodes * (args.gpus_per_node or 8) if args.nodes else 1
    req = PlanRequest(**{k: v for k, v in vars(args).items() if k in names and k != "model_args"},
                      model_args=tuple(args.model_args))
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


def write_plot(plan: Plan, path: str) -> None:
    """The predicted scaling efficiency against nodes per stage (the paper's Figure 1)."""
    from pathlib import Path

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
    ax.set_title(f"{plan.request.model}: predicted scaling efficiency, "
                 f"{link.inter_gbps:g} Gb/s per node")
    ax.set_xlabel(f"nodes ({plan.request.per_node} device(s) each)")
    ax.set_ylabel("efficiency (tokens/s per device against one node)")
    ax.set_xscale("log", base=2)
    xs = network.node_counts(plan.net.nodes)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_ylim(0, 1.1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(Path(path), format="png", dpi=100)
    except OSError as e:
        raise UserError(f"--plot {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
