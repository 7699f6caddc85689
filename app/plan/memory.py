"""The memory planner: bytes per device of one training process, per ZeRO stage. Pure functions.

    total = runtime + parameters + gradients + optimizer states + buffers
          + activations + backward transient + fragmentation allowance

Model states (P parameters, N data-parallel devices, Adam; a copy is divided by N once its
stage partitions it). Mixed precision (bf16/fp16) follows DeepSpeed's estimators
(`estimate_zero2/3_model_states_mem_needs`: "2 = params_16bit, 18 = 2_grads_16bit +
4_grads_32bit + 4_params_32bit + 8_optimizer_states_32bit"):

    copy (bytes/param)        mixed  fp32   partitioned from stage
    16-bit parameters           2      4      3
    16-bit gradients            2      4      2     (stage 3: the accumulation partition)
    fp32 gradients              4     (4)     1     (fp32: a separate copy only in stages 1
                                                     and 3, the flat buffers the step reads)
    fp32 master parameters      4     (4)     1     (fp32: a copy only in stages 1-2)
    Adam moments (m, v)         8      8      1

ZeRO-2 mixed is then 2P + 18P/N, DeepSpeed's figure exactly. For ZeRO-3 DeepSpeed counts
18P/N + 4 * largest_layer; we add the 16-bit gradient-accumulation partition it omits (2P/N,
`grad_partitions_flat_buffer` in stage3.py) and count the gathered parameters under buffers.

Buffers: ZeRO-0 flattens the gradients for the all-reduce (min(P, 5e8) elements; none in a world
of one, where the app skips that all-reduce: app.runtime.patches.skip_lone_allreduce); ZeRO-1/2 keep
reduce (x2 with overlap_comm) and all-gather buckets; ZeRO-3 keeps the gathered parameters
(up to `stage3_max_live_parameters`, so with this repo's zero3.json the whole model of any
model below 1e9 parameters), the gradients of one layer in flight, its reduce bucket and the
prefetch bucket.
ZeRO-3 + offload keeps only that working set on the device; the states live in host memory
(18P per node's share, x1.5 for pinned buffers, DeepSpeed's figure).

Activations are the tensors autograd saves for backward, counted per family from what the
`transformers` implementations save (see `_FAMILIES`; tests check the count against autograd's
own saved-tensor hooks). With activation checkpointing a block keeps only its input, and one
block's activations are recomputed at a time. The backward transient is the LM head's
gradient (two fp32 V-wide rows per predicted token) alive while its saved output still is.
The fragmentation allowance is a fraction of the activations and transient (many short-lived
allocations; the long-lived model states do not fragment), set per device kind.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from app.telemetry.flops import ModelShape
from data_tools.errors import UserError

GiB = 2 ** 30
MiB = 2 ** 20
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# fp32 state bytes per parameter: Adam/AdamW/LAMB keep two moments, the others one
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "lamb": 8, "lion": 4, "adagrad": 4, "sgd": 4}
STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class DeviceProfile:
    """What the planner assumes about the device beyond its size."""

    kind: str
    """"gpu" (any accelerator with its own memory) or "cpu"."""
    runtime_bytes: int
    """Per-process memory that is not the model's: CUDA context, cuBLAS workspace and NCCL
    buffers on a GPU; the Python/torch/DeepSpeed process on CPU (measured: `calibrate_runtime`)."""
    fragmentation: float
    """Allowance on activations and transients for allocator rounding and fragmentation."""
    mask_bytes: int | None
    """Bytes per dropout-mask element: 1 (bool, CUDA); None = the activation dtype (on CPU,
    dropout keeps a float noise tensor)."""
    fused_attention_with_dropout: bool
    """SDPA uses a fused kernel (no S x S scores stored) also when attention dropout is on:
    true on CUDA; PyTorch's CPU flash kernel has no dropout, so CPU falls back to the math path."""
    host_is_device: bool
    """The model is built in host memory before DeepSpeed partitions it; when the host is the
    device (CPU), ZeRO-3's partitions come on top of that full fp32 copy."""


# The GPU figures are assumptions (documented in docs/plan.md), not measurements.
GPU = DeviceProfile("gpu", runtime_bytes=GiB, fragmentation=0.10, mask_bytes=1,
                    fused_attention_with_dropout=True, host_is_device=False)
# CPU: glibc keeps freed activation memory in the process (RSS), measured at ~1.4-1.8x the
# saved bytes on bert-tiny/bert-120m (docs/plan.md); the runtime is measured per machine.
CPU = DeviceProfile("cpu", runtime_bytes=int(0.42 * GiB), fragmentation=0.6, mask_bytes=None,
                    fused_attention_with_dropout=False, host_is_device=True)


@dataclass(frozen=True)
class ZeroSetup:
    """A ZeRO stage and the knobs of its DeepSpeed config that size buffers (in elements)."""

    stage: int
    offload: bool = False
    """Optimizer states and parameters in host memory (ds_configs/zero3_offload.json)."""
    allreduce_bucket: int = 500_000_000
    """ZeRO-0's gradient all-reduce flattens this many elements at a time (DeepSpeed's default)."""
    reduce_bucket: int = 500_000_000
    allgather_bucket: int = 500_000_000
    overlap_comm: bool = False
    max_live_parameters: int = 1_000_000_000
    """ZeRO-3 keeps up to this many gathered parameters alive between uses."""
    prefetch_bucket: int = 50_000_000
    """ZeRO-3 gathers the next parameters ahead of use in a bucket of this many elements."""

    @property
    def label(self) -> str:
        return f"ZeRO-{self.stage}" + (" + offload" if self.offload else "")


@dataclass(frozen=True)
class Workload:
    """The run being planned, as seen by one device."""

    seq_len: int
    micro_batch: int
    precision: str = "bf16"
    """bf16, fp16 (mixed precision with fp32 master weights) or fp32."""
    world: int = 1
    """Data-parallel devices (the N that ZeRO partitions over)."""
    devices_per_node: int = 1
    checkpointing: bool = False
    """Activation checkpointing (one block's input kept; recomputed in backward)."""
    head_fraction: float = 1.0
    """Positions the LM head runs on (MLM's sparse head: the masked fraction)."""
    hidden_dropout: bool = True
    attention_dropout: bool = True
    eager_attention: bool = False
    """attn_implementation="eager": S x S scores are always stored."""
    optimizer: str = "adamw"
    """Sizes the optimizer states (OPTIMIZER_STATE_BYTES)."""
    outer_state: int = 0
    """Bytes a parameter of the rank's 1/world slice the low-communication mode's outer step
    keeps (app.runtime.outer: the fp32 global weights and the Nesterov momentum, 8; `world` is
    then an island's ranks); 0 for synchronous data parallelism. Counted with the optimizer
    states."""

    @property
    def moments(self) -> int:
        return OPTIMIZER_STATE_BYTES[self.optimizer]

    @property
    def nodes(self) -> int:
        return math.ceil(self.world / self.devices_per_node)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device for one ZeRO setup and workload (see the module docstring)."""

    setup: ZeroSetup
    runtime: int
    parameters: int
    gradients: int
    optimizer: int
    buffers: int
    activations: int
    """For the workload's micro batch, with its checkpointing setting."""
    activations_per_sample: int
    """One sample without checkpointing (as saved for backward)."""
    activations_per_sample_ckpt: int
    """One sample with activation checkpointing."""
    transient: int
    fragmentation: int
    host_per_node: int = 0
    """Host memory per node for offloaded states (ZeRO-3 + offload)."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return (self.runtime + self.model_states + self.buffers + self.activations
                + self.transient + self.fragmentation)


def state_copies(precision: str, stage: int, moments: int = 8) -> dict[str, list[tuple[int, int]]]:
    """Per-parameter copies as {row: [(bytes per parameter, stage that partitions it)]}.

    The table of the module docstring (`moments`: the optimizer's state bytes, 8 for Adam); a
    copy is divided by N when `stage >= its stage`.
    """
    if precision not in PRECISION_BYTES:
        raise UserError(f"--precision {precision!r}: expected one of bf16, fp16, fp32")
    if precision != "fp32":
        return {"parameters": [(2, 3)],
                "gradients": [(2, 2), (4, 1)],
                "optimizer": [(4, 1), (moments, 1)]}
    # the 16-bit (here fp32) gradients, plus stage 1's flat fp32 partition for the step and
    # stage 3's separate fp32 step buffer
    grads = [(4, 2)] + {1: [(4, 1)], 3: [(4, 3)]}.get(stage, [])
    master = [(4, 1)] if stage in (1, 2) else []  # fp32 stage 0 has no wrapper; 3 shares it
    return {"parameters": [(4, 3)], "gradients": grads, "optimizer": master + [(moments, 1)]}


def model_state_bytes(params: int, stage: int, world: int, precision: str,
                      offload: bool = False, moments: int = 8) -> dict[str, int]:
    """Parameters, gradients and optimizer states per device (bytes)."""
    if stage not in STAGES:
        raise UserError(f"ZeRO stage {stage}: stages are 0, 1, 2 and 3")
    if offload:  # everything lives in host memory; the device holds the working set (buffers)
        return {"parameters": 0, "gradients": 0, "optimizer": 0}
    out = {}
    for row, copies in state_copies(precision, stage, moments).items():
        out[row] = sum(b * params / world if stage >= part else b * params for b, part in copies)
    return {row: int(v) for row, v in out.items()}


def host_bytes_per_node(params: int, nodes: int, moments: int = 8) -> int:
    """ZeRO-3 + offload: host memory per node, DeepSpeed's 18P/nodes x 1.5 (zero_init) for Adam:
    16-bit parameters 2 + fp32 gradients 4 + master 4 + moments, x1.5 for pinned buffers."""
    return int(params * (10 + moments) / nodes * 1.5)


def zero3_working_set(live_params: int, largest_layer: int, weight_bytes: int) -> int:
    """ZeRO-3's gathered parameters plus one layer's gradients before their reduce-scatter.

    With live_params = largest_layer and 16-bit weights this is DeepSpeed's 4 x largest layer.
    """
    return weight_bytes * (live_params + largest_layer)


def buffer_bytes(setup: ZeroSetup, params: int, largest_layer: int, precision: str,
                 world: int = 2) -> int:
    """Communication buffers and ZeRO-3's gathered parameters (bytes per device)."""
    w = PRECISION_BYTES[precision]
    if setup.stage == 0:
        return w * min(params, setup.allreduce_bucket) if world > 1 else 0
    if setup.stage in (1, 2):
        reduce = w * min(params, setup.reduce_bucket) * (2 if setup.overlap_comm else 1)
        return reduce + w * min(params, setup.allgather_bucket)
    live = min(params, max(setup.max_live_parameters, largest_layer))
    return (zero3_working_set(live, largest_layer, w)
            + w * min(params, setup.reduce_bucket) + w * min(params, setup.prefetch_bucket))


@dataclass(frozen=True)
class _Saved:
    """Tensors one block saves for backward, in (tokens x width) units, per model family."""

    hidden: int
    """s x d tensors (block inputs, norm inputs/outputs, Q, attention output, ...)."""
    kv: int
    """s x d_kv tensors (K, V)."""
    mlp: int
    """s x f tensors (MLP pre-activation, activation output, gate/up products)."""
    masks: int
    """s x d dropout masks (when hidden dropout is on)."""
    outer_hidden: int
    """s x d tensors outside the blocks: embedding norm input, final norm, LM-head input."""
    outer_masks: int
    """s x d dropout masks outside the blocks (embedding dropout)."""


# Counted from what autograd saves for these `transformers` implementations (tests/test_plan.py
# checks them against saved-tensor hooks). bert: post-LN, GELU; gpt2: pre-LN, Conv1D, gelu_new
# written as elementwise ops (5 s x f tensors); llama: RMSNorm (input and normalised copy), rotary,
# SwiGLU (gate, up, act, product), no dropout.
_FAMILIES = {
    "bert": _Saved(hidden=6, kv=2, mlp=2, masks=2, outer_hidden=1, outer_masks=1),
    "gpt2": _Saved(hidden=6, kv=2, mlp=5, masks=2, outer_hidden=2, outer_masks=1),
    "llama": _Saved(hidden=8, kv=2, mlp=4, masks=0, outer_hidden=3, outer_masks=0),
}


def _family(shape: ModelShape) -> _Saved:
    if shape.model_type in _FAMILIES:
        return _FAMILIES[shape.model_type]
    if shape.gated_mlp:
        return _FAMILIES["llama"]
    return _FAMILIES["bert" if shape.has_mlm_transform else "gpt2"]


def activation_bytes(shape: ModelShape, work: Workload, device: DeviceProfile,
                     checkpointing: bool | None = None, micro_batch: int | None = None) -> int:
    """Bytes saved for backward for a micro batch (see `_FAMILIES`)."""
    s, d, b = work.seq_len, shape.hidden, work.micro_batch if micro_batch is None else micro_batch
    ckpt = work.checkpointing if checkpointing is None else checkpointing
    w = PRECISION_BYTES[work.precision]
    m = device.mask_bytes or w
    fam = _family(shape)
    masks = fam.masks if work.hidden_dropout else 0
    block = s * (d * (fam.hidden * w + masks * m) + shape.kv_dim * fam.kv * w
                 + shape.intermediate * fam.mlp * w)
    block += _attention_core(shape, work, device, w, m)
    outer = s * d * (fam.outer_hidden * w + (fam.outer_masks * m if work.hidden_dropout else 0))
    outer += _head_saved(shape, work, w) + 3 * s * 8  # ids, labels, attention mask (int64)
    layers = shape.layers * block if not ckpt else shape.layers * s * d * w + block
    return b * (layers + outer)


def _attention_core(shape: ModelShape, work: Workload, device: DeviceProfile, w: int,
                    m: int) -> int:
    """Per sample and block: the S x S scores (math path) or the fused kernel's log-sum-exp."""
    s, a = work.seq_len, shape.heads
    fused = not work.eager_attention and (device.fused_attention_with_dropout
                                          or not work.attention_dropout)
    if fused:
        return a * s * 4
    scores = a * s * s * w  # softmax output
    if work.attention_dropout:
        scores += a * s * s * (m + w)  # the mask and the dropped probabilities
    return scores


def _predicted(shape: ModelShape, work: Workload) -> float:
    return work.seq_len * (work.head_fraction if shape.has_mlm_transform else 1.0)


def _head_saved(shape: ModelShape, work: Workload, w: int) -> int:
    """The LM head: its inputs (and MLM transform), and log-softmax's fp32 output."""
    n = _predicted(shape, work)
    transform = 4 * shape.hidden * w if shape.has_mlm_transform else 0
    return int(n * (transform + shape.vocab * 4))


def transient_bytes(shape: ModelShape, work: Workload, micro_batch: int | None = None) -> int:
    """Backward's first step: the head's fp32 gradient rows (two, plus a 16-bit cast)."""
    b = work.micro_batch if micro_batch is None else micro_batch
    w = PRECISION_BYTES[work.precision]
    per_row = 8 + (w if w != 4 else 0)
    return int(b * _predicted(shape, work) * shape.vocab * per_row)


@dataclass(frozen=True)
class ModelSize:
    """Counts the memory formulas need that a config alone does not give exactly."""

    parameters: int
    """Unique parameters (tied weights once)."""
    largest_layer: int
    """Most parameters held directly by one module (DeepSpeed's `model_to_params`)."""


def plan_memory(shape: ModelShape, size: ModelSize, setup: ZeroSetup, work: Workload,
                device: DeviceProfile) -> MemoryPlan:
    """Bytes per device for `setup` running `work` (see the module docstring)."""
    p, w = size.parameters, PRECISION_BYTES[work.precision]
    states = model_state_bytes(p, setup.stage, work.world, work.precision, setup.offload,
                               work.moments)
    if work.outer_state and not setup.offload:
        states["optimizer"] += work.outer_state * p // work.world
    if device.host_is_device and setup.stage == 3 and not setup.offload:
        # measured, not derived: ZeRO-3's steps on a CPU host peak about 4P (fp32) above the
        # terms here (tests/test_plan.py); not the build, which is partitioned (zero.Init) and
        # peaks below the first step (docs/plan.md)
        states["parameters"] += 4 * p
    if setup.offload:
        buffers = zero3_working_set(min(p, max(setup.max_live_parameters, size.largest_layer)),
                                    size.largest_layer, w)
    else:
        buffers = buffer_bytes(setup, p, size.largest_layer, work.precision, work.world)
    act = activation_bytes(shape, work, device)
    transient = transient_bytes(shape, work)
    return MemoryPlan(
        setup=setup, runtime=device.runtime_bytes, buffers=buffers, activations=act,
        activations_per_sample=activation_bytes(shape, work, device, False, 1),
        activations_per_sample_ckpt=activation_bytes(shape, work, device, True, 1),
        transient=transient, fragmentation=int(device.fragmentation * (act + transient)),
        host_per_node=host_bytes_per_node(p, work.nodes, work.moments) if setup.offload else 0,
        **states)


def max_micro_batch(shape: ModelShape, size: ModelSize, setup: ZeroSetup, work: Workload,
                    device: DeviceProfile, budget_bytes: int) -> int:
    """The largest micro batch whose planned total fits `budget_bytes` (0: not even one).

    Everything but the activations, transient and their allowance is independent of the micro
    batch, and those are linear in it.
    """
    one = plan_memory(shape, size, setup, replace(work, micro_batch=1), device)
    per_sample = one.activations + one.transient + one.fragmentation
    fixed = one.total - per_sample
    if fixed + per_sample > budget_bytes:
        return 0
    return int((budget_bytes - fixed) // per_sample)


def calibrate_runtime(measured_peak_bytes: int, planned: MemoryPlan) -> int:
    """The runtime term implied by one measured run: its peak minus everything else planned."""
    return max(0, measured_peak_bytes - (planned.total - planned.runtime))
