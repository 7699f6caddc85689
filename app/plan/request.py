"""`app plan`'s settings: the flags as a `PlanRequest`, each number checked (finite, in range,
consistent with the others), the defaults they fall back to and the counts derived from them
(devices a node, nodes, an island's ranks, the ranks ZeRO partitions over).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from app.plan import network
from data_tools.errors import UserError

CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022: compute-optimal tokens per parameter
DEFAULT_GPU = "H100-SXM"


@dataclass(frozen=True)
class PlanRequest:
    """`python -m app plan` settings (the flags, checked)."""

    model: str
    """Preset name (app.models.presets.PRESETS)."""
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
    """Tokens per optimizer step no recommendation exceeds (default:
    app.plan.recommend.MAX_GLOBAL_BATCH_TOKENS for the model's objective)."""

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
