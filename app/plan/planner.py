"""The plan `app plan` reports, assembled: per ZeRO stage the memory at the micro batch in use,
the largest that fits, throughput, time and cost (`plan_stage`) and which stage to pick
(`recommend`); each stage's figures on the planned network (`plan_network`); the network
recommendation (app.plan.recommend); and, where no stage fits one sample, what would
(`nothing_fits`). Formulas: docs/plan.md.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from app.plan import network
from app.plan.inputs import ModelInfo, describe_model, dropout_flags, zero_setups
from app.plan.jobs import (
    NetworkSetup,
    app_comm_dtype,
    compute_ms,
    network_job,
    network_setup,
)
from app.plan.memory import (
    GPU,
    DeviceProfile,
    GiB,
    MemoryPlan,
    Workload,
    ZeroSetup,
    max_micro_batch,
    plan_memory,
)
from app.plan.recommend import NetworkChoice, recommend_network
from app.plan.request import CHINCHILLA_TOKENS_PER_PARAM, DEFAULT_GPU, PlanRequest
from app.telemetry import hardware
from app.telemetry.flops import flops_per_token, head_fraction
from data_tools.errors import UserError

OUTER_STATE_BYTES = 8
"""The low-communication mode's outer state a parameter of a rank's slice (app.runtime.outer:
the fp32 global weights and the outer Nesterov momentum)."""


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
                   f"fits ({gb(s.memory.total)} GB); higher stages only add communication")
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


def gb(n: float) -> str:
    """Bytes as GB (2^30 bytes), two decimals: the tables' and the messages' unit."""
    return f"{n / GiB:,.2f}"


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
    head = (f"{gb(budget)} GB per device fits no ZeRO stage for {req.model} at seq-len "
            f"{req.seq_len} (it needs at least {gb(least.total)} GB, with "
            f"{least.setup.label} at micro batch 1)")
    if device.runtime_bytes >= budget:
        return (f"{head}: the per-device runtime alone (CUDA context, NCCL buffers) is assumed "
                f"to take {gb(device.runtime_bytes)} GB (--runtime-gb)")
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
