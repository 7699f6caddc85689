"""The run's configuration: every `app train` flag, typed, documented and checked in one place.

Checks run before any process group starts, so a bad flag costs one line and exit 2 on every
rank. Derived values (batch sizes per rank, precision) are settled later by the engine and
recorded next to this config in RUN_DIR/config.json.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from app.data.loader import OBJECTIVES
from app.data.packing import PACKINGS
from app.data.sources import is_mixture_arg
from app.faults.anomaly import POLICIES, Rules
from app.runtime import registry
from app.runtime.device import PRECISIONS
from app.schedule import DECAY_SHAPES, DECAYS
from data_tools.cli import config_file, config_flags, finite_float, flag
from data_tools.errors import UserError

RESUME_MODES = ("auto", "never")
WANDB_MODES = ("online", "offline", "disabled")
ATTENTION = ("auto", "sdpa", "eager", "flash_attention_2", "flex")
GRAD_COMM_DTYPES = ("fp32", "bf16")
DP_MODES = ("sync", "diloco")
OUTER_DTYPES = ("fp32", "bf16")


@dataclass
class TrainConfig:
    """`python -m app train` settings. Field names are the flags with '-' for '_'."""

    data: Path | list[str]
    """Dataset directory (dataset.json + shards), as written by `data_tools prepare`; or a
    weighted mixture: WEIGHT:DIR ... or one MIXTURE.json (app/data/sources.py)."""
    out: Path
    """Run directory: config.json, metrics.jsonl, summary.json, checkpoints/, wandb/."""
    model: str | None = None
    """Preset name (app.models.presets.PRESETS); default bert-tiny for mlm, gpt-tiny for clm."""
    objective: str | None = None
    """"mlm" or "clm"; default: the preset's (BERT presets mlm, GPT/Llama presets clm)."""
    model_arg: list[str] = field(default_factory=list)
    """Config field overrides KEY=VALUE (e.g. num_hidden_layers=4)."""
    ds_config: Path | None = None
    """DeepSpeed JSON; its "auto" fields are filled from these flags."""
    zero: int | None = None
    """Shorthand for ds_configs/zero{N}.json (default 0; 1 for bf16: DeepSpeed accumulates bf16
    gradients in fp32 only from ZeRO-1 on)."""
    precision: str = "auto"
    """auto|bf16|fp16|fp32: auto = bf16 on accelerators that have it, fp32 on CPU."""
    seq_len: int = 128
    """Tokens per sample."""
    micro_batch: int = 16
    """Samples per rank per forward/backward pass."""
    grad_accum: int | None = None
    """Micro steps per optimizer step (default 1, or derived from --global-batch)."""
    global_batch: int | None = None
    """Samples per optimizer step over all ranks (= micro_batch * grad_accum * world size)."""
    max_steps: int = 1000
    """Optimizer steps to train for (the LR schedule ends here)."""
    max_tokens: int | None = None
    """Token budget: stop (and end the schedule) once this many real (not padding) tokens were
    trained on (with doc packings: the dataset's mean real tokens a sample)."""
    stop_at_step: int | None = None
    """Stop and save at this step without changing the schedule (preemption drills, tests)."""
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """LR floor as a fraction of the peak."""
    warmup_steps: int | None = None
    """Linear warmup steps (default: 5% of the schedule, at least 1)."""
    lr_decay: str = "cosine"
    """cosine|linear|constant decay after warmup, or wsd (warmup-stable-decay)."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay, on the linear layers' matrices only (biases, norms and
    embeddings are exempt: app/runtime/param_groups.py optimizer_groups)."""
    beta1: float = 0.9
    """AdamW's decay rate of the running mean of gradients."""
    beta2: float = 0.98
    """AdamW's decay rate of the running mean of squared gradients (0.98 rather than 0.999:
    RoBERTa's choice, for stability with large batches)."""
    eps: float = 1e-8
    """AdamW's term added to the denominator, for numerical stability."""
    seed: int = 0
    """Seeds the weights, the sample order, the masks and dropout."""
    pad_vocab_to: int = 128
    """Round the model's vocabulary up to a multiple of N (tensor-core tiles; 1: no padding)."""
    dropout: float | None = None
    """Overrides the preset's dropout (0 makes runs comparable across world sizes)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: less memory, ~30% more compute."""
    attn: str = "auto"
    """Attention kernel: auto (PyTorch's SDPA), sdpa, eager, flash_attention_2, or flex
    (PyTorch's FlexAttention with block masks: compiled on CUDA, where packed documents skip
    each other's tiles; training steps with attention dropout, and on CPU, run its mask through
    SDPA; docs/gpu.md)."""
    compile: bool = False
    """torch.compile the model (through DeepSpeed's engine.compile). Measure it first
    (bench/gpu_mfu.py --compile): on one H200 it made bert-120m's step 1.9x slower (docs/gpu.md)."""
    tf32: bool = False
    """Let fp32 matrix products use TF32 tensor cores (NVIDIA GPUs; ~8x faster, 10-bit mantissa)."""
    packing: str = "concat"
    """concat (windows across documents), doc (one document per sample) or doc-packed (whole
    documents side by side in a window, each attending only to itself; MLM)."""
    mask_prob: float = 0.15
    """mlm: the fraction of tokens chosen for prediction (80% of them masked, 10% random, 10%
    kept)."""
    resume: str = "auto"
    """auto (latest checkpoint in RUN_DIR if any), never, or a checkpoint path."""
    overwrite: bool = False
    """Allow --resume never to replace an existing run in RUN_DIR."""
    save_every: int = 0
    """Save a checkpoint every N steps (0: only at the end)."""
    keep_last: int = 3
    """Checkpoints kept; older ones are deleted after a newer save completed."""
    on_anomaly: str = Rules.policy
    """rollback|skip|stop on a loss spike or a non-finite loss (docs/design.md, "Faults")."""
    spike_z: float = Rules.z
    """A spike: the step loss more than this many standard deviations above the recent mean..."""
    spike_rise: float = Rules.rise
    """...and more than this fraction above it."""
    spike_window: int = Rules.window
    """Steps of recent loss history a step is judged against."""
    max_rollbacks: int = Rules.max_rollbacks
    """More rollbacks than this within 1,000 steps stop the run (exit status 3)."""
    cooldown_steps: int = Rules.cooldown_steps
    """After a rollback the LR ramps back to the schedule over this many steps..."""
    cooldown_factor: float = Rules.cooldown_factor
    """...starting at this fraction of it."""
    hang_timeout: float = 1800.0
    """Seconds without progress (stuck in a collective, the loader, a save) before a rank prints
    where every thread is and exits 124 (0: no watchdog)."""
    save_errors: str = "stop"
    """stop|skip: a save that fails (full disk) stops the run, or is skipped with a warning."""
    eval_every: int = 0
    """Evaluate on the val split every N steps (0: only at the end)."""
    eval_samples: int = 256
    """Val samples per evaluation (at most the split's; of each source, in a mixture)."""
    log_every: int = 10
    """Steps between log lines (host syncs and cross-rank reductions happen only then)."""
    num_workers: int | None = None
    """Data-loader workers per rank (default: from the cores per rank)."""
    stage_to: Path | None = None
    """Node-local directory to copy the dataset to before training (one rank a node copies)."""
    dist_timeout: float = 30.0
    """Minutes a collective may wait for the slowest rank before the job fails."""
    wandb: str | None = None
    """online|offline|disabled (default: online with WANDB_API_KEY, else offline)."""
    wandb_project: str = "dspretrain"
    """The wandb project the run is logged to."""
    wandb_group: str | None = None
    """Group the run with others in wandb (e.g. a sweep or the restarts of one experiment)."""
    wandb_tags: list[str] = field(default_factory=list)
    """Tags of the wandb run."""
    run_name: str | None = None
    """The run's name in wandb (default: the name of --out)."""
    peak_tflops: float | None = None
    """The accelerator's dense peak TFLOP/s for MFU (default: from app/telemetry/hardware.py's
    table)."""
    # Encoder recipes (docs/recipes.md): WSD's decay, warm starts
    decay_fraction: float = 0.2
    """--lr-decay wsd: the last fraction of the run's steps over which the LR decays."""
    decay_shape: str = "1-sqrt"
    """--lr-decay wsd: the decay's shape, 1-sqrt|linear|cosine."""
    init_from: Path | None = None
    """A new run starts from these weights: an `app export` directory, any Hugging Face model
    directory of the same architecture and tokenizer, or another run directory (its latest
    checkpoint); fresh optimizer, schedule, data order (docs/recipes.md)."""
    # Gradient communication (docs/gpu.md)
    grad_comm_dtype: str | None = None
    """fp32|bf16: the dtype gradients are summed in across ranks (DeepSpeed's
    communication_data_type; default: the ds_config's, else fp32; docs/gpu.md says why)."""
    dp_mode: str = "sync"
    """sync (data parallelism over every rank, each step) or diloco (islands of --island-ranks
    ranks train synchronously inside and average their weights every --outer-every steps:
    low communication between islands; docs/recipes.md)."""
    outer_every: int = 50
    """--dp-mode diloco: optimizer steps between the islands' syncs (H)."""
    island_ranks: int | None = None
    """--dp-mode diloco: ranks an island (default: a node's, the ranks on the fast link)."""
    outer_lr: float = 0.7
    """--dp-mode diloco: the outer SGD's learning rate on the averaged pseudo-gradient (DiLoCo's
    0.7)."""
    outer_momentum: float = 0.9
    """--dp-mode diloco: the outer SGD's Nesterov momentum (DiLoCo's 0.9; 0: none)."""
    outer_dtype: str = "fp32"
    """--dp-mode diloco: fp32|bf16, the dtype the pseudo-gradients cross the slow link in."""
    deepspeed_patches: str = "all"
    """Where the app replaces parts of DeepSpeed (app/runtime/registry.py, docs/design.md):
    all, none (DeepSpeed's own path everywhere), NAME,... or all,-NAME,... A patch named that
    cannot apply to the installed DeepSpeed stops the run; under all it is left out."""

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.init_from = Path(self.init_from) if self.init_from is not None else None
        if isinstance(self.data, (list, tuple)):  # from the flag; one plain DIR stays a Path
            data = [str(d) for d in self.data]
            self.data = data if len(data) > 1 or is_mixture_arg(data[0]) else Path(data[0])
        else:
            self.data = Path(self.data)
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{flag(f.name)} {value}: must be a finite number")
        for name in ("seq_len", "micro_batch", "max_steps", "log_every", "keep_last",
                     "eval_samples", "pad_vocab_to"):
            _positive(name, getattr(self, name))
        for name in ("grad_accum", "global_batch", "max_tokens", "stop_at_step"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in ("spike_window", "cooldown_steps"):
            _positive(name, getattr(self, name))
        if self.max_rollbacks < 0 or self.hang_timeout < 0 or self.spike_z <= 0:
            raise UserError("--max-rollbacks and --hang-timeout must be 0 or more, --spike-z "
                            "positive")
        if not 0.0 < self.cooldown_factor <= 1.0:
            raise UserError(f"--cooldown-factor {self.cooldown_factor}: must be in (0, 1]")
        if self.dist_timeout <= 0:
            raise UserError(f"--dist-timeout {self.dist_timeout}: must be positive (minutes)")
        for name in ("save_every", "eval_every"):
            if getattr(self, name) < 0:
                raise UserError(f"{flag(name)} {getattr(self, name)}: must be 0 or more")
        if self.num_workers is not None and self.num_workers < 0:
            raise UserError(f"--num-workers {self.num_workers}: must be 0 or more")
        if self.zero is not None and self.ds_config is not None:
            raise UserError("--zero and --ds-config are exclusive: --zero N means "
                            "ds_configs/zeroN.json")
        if self.zero is not None and not 0 <= self.zero <= 3:
            raise UserError(f"--zero {self.zero}: ZeRO stages are 0, 1, 2 and 3")
        if self.lr <= 0:
            raise UserError(f"--lr {self.lr}: must be positive")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise UserError(f"--dropout {self.dropout}: must be in [0, 1)")
        if self.weight_decay < 0:
            raise UserError(f"--weight-decay {self.weight_decay}: must be 0 or more")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"--{name} {getattr(self, name)}: must be in [0, 1)")
        if self.resume not in RESUME_MODES and not self.resume:
            raise UserError("--resume: expected auto, never or a checkpoint path")
        if self.wandb not in (None, *WANDB_MODES):
            raise UserError(f"--wandb {self.wandb!r}: expected one of {', '.join(WANDB_MODES)}")
        if self.attn not in ATTENTION:
            raise UserError(f"--attn {self.attn!r}: expected one of {', '.join(ATTENTION)}")
        registry.parse(self.deepspeed_patches)  # a bad name or form: one line
        if self.dp_mode not in DP_MODES:
            raise UserError(f"--dp-mode {self.dp_mode!r}: expected one of {', '.join(DP_MODES)}")
        if self.outer_dtype not in OUTER_DTYPES:
            raise UserError(f"--outer-dtype {self.outer_dtype!r}: expected one of "
                            f"{', '.join(OUTER_DTYPES)}")
        _positive("outer_every", self.outer_every)
        if self.island_ranks is not None:
            _positive("island_ranks", self.island_ranks)
        if self.grad_comm_dtype not in (None, *GRAD_COMM_DTYPES):
            raise UserError(f"--grad-comm-dtype {self.grad_comm_dtype!r}: expected one of "
                            f"{', '.join(GRAD_COMM_DTYPES)}")
        self._check_ranges()

    def _check_ranges(self) -> None:
        """The flags the checks above leave open: each numeric field within RANGES, every whole
        number within what torch and numpy hold (a 24-digit --seed was a traceback in torch)."""
        for name, (low, high, words) in RANGES.items():
            value = getattr(self, name)
            if value is not None and not (low(value) and high(value)):
                raise UserError(f"{flag(name)} {value}: must be {words}")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and \
                    not -MAX_INT <= value <= MAX_INT:
                raise UserError(f"{flag(f.name)} {value}: out of range (at most {MAX_INT:,})")

    @property
    def model_name(self) -> str:
        if self.model is not None:
            return self.model
        return "gpt-tiny" if self.objective == "clm" else "bert-tiny"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


MAX_INT = (1 << 63) - 1  # int64: torch's and numpy's integers
SEED_MAX = (1 << 32) - 1  # numpy's legacy seeding and Hugging Face's set_seed take no more


def _any(value: Any) -> bool:
    return True


# (lower test, upper test, the range in words) for the fields no check above covers
RANGES: dict[str, tuple[Any, Any, str]] = {
    "seed": (lambda v: v >= 0, lambda v: v <= SEED_MAX, f"in [0, {SEED_MAX}]"),
    "warmup_steps": (lambda v: v >= 0, _any, "0 or more"),
    "eps": (lambda v: v > 0, lambda v: v < 1, "in (0, 1) (AdamW's denominator term)"),
    "min_lr_ratio": (lambda v: v >= 0, lambda v: v <= 1, "in [0, 1] (a fraction of --lr)"),
    "decay_fraction": (lambda v: v > 0, lambda v: v <= 1, "in (0, 1] (a fraction of the run)"),
    "mask_prob": (lambda v: v > 0, lambda v: v < 1, "in (0, 1)"),
    "spike_rise": (lambda v: v >= 0, _any, "0 or more"),
    "peak_tflops": (lambda v: v > 0, _any, "positive"),
    "max_rollbacks": (lambda v: v >= 0, _any, "0 or more"),
    "hang_timeout": (lambda v: v >= 0, _any, "0 or more (seconds; 0: no watchdog)"),
    "outer_lr": (lambda v: v > 0, lambda v: v <= 10, "in (0, 10] (the outer SGD's rate)"),
    "outer_momentum": (lambda v: v >= 0, lambda v: v < 1, "in [0, 1)"),
}


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise UserError(f"{flag(name)} {value}: must be at least 1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `app train` flags; defaults and help come from TrainConfig."""
    add = config_flags(parser, TrainConfig)
    # RUN_DIR/config.json's "run" section; a record continues its run (--resume auto), never
    # replaces it: what the run did to its --out is not repeated
    config_file(parser, TrainConfig, recorded="run", not_repeated=("resume", "overwrite"))
    add("data", nargs="+", required=True, metavar="DIR | WEIGHT:DIR")
    add("out", type=Path, required=True, metavar="RUN_DIR")
    add("model", metavar="PRESET")
    add("objective", choices=OBJECTIVES)
    add("model_arg", action="append", default=[], metavar="KEY=VALUE")
    add("ds_config", type=Path, metavar="FILE")
    add("zero", type=int, metavar="N")
    add("precision", choices=PRECISIONS)
    for name in ("seq_len", "micro_batch", "grad_accum", "global_batch", "max_steps",
                 "max_tokens", "stop_at_step", "warmup_steps", "seed", "save_every", "keep_last",
                 "eval_every", "eval_samples", "log_every", "num_workers", "pad_vocab_to"):
        add(name, type=int, metavar="N")
    for name in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "eps", "dropout",
                 "mask_prob"):
        add(name, type=finite_float, metavar="F")
    add("lr_decay", choices=DECAYS)
    add("gradient_checkpointing", action="store_true")
    add("compile", action="store_true")
    add("tf32", action="store_true")
    add("attn", choices=ATTENTION)
    add("packing", choices=PACKINGS)
    add("resume", metavar="auto|never|PATH")
    add("overwrite", action="store_true")
    add("save_errors", choices=("stop", "skip"))
    add("on_anomaly", choices=POLICIES)
    for name in ("spike_z", "spike_rise", "cooldown_factor", "hang_timeout"):
        add(name, type=finite_float, metavar="F")
    for name in ("spike_window", "max_rollbacks", "cooldown_steps"):
        add(name, type=int, metavar="N")
    add("stage_to", type=Path, metavar="DIR")
    add("dist_timeout", type=finite_float, metavar="MINUTES")
    add("wandb", choices=WANDB_MODES)
    add("wandb_project", metavar="NAME")
    add("wandb_group", metavar="NAME")
    add("wandb_tags", nargs="+", default=[], metavar="TAG")
    add("run_name", metavar="NAME")
    add("peak_tflops", type=finite_float, metavar="F")
    add("decay_fraction", type=finite_float, metavar="F")
    add("decay_shape", choices=DECAY_SHAPES)
    add("init_from", type=Path, metavar="DIR")
    add("grad_comm_dtype", choices=GRAD_COMM_DTYPES)
    add("deepspeed_patches", metavar="all|none|NAME,...")
    add("dp_mode", choices=DP_MODES)
    for name in ("outer_every", "island_ranks"):
        add(name, type=int, metavar="N")
    for name in ("outer_lr", "outer_momentum"):
        add(name, type=finite_float, metavar="F")
    add("outer_dtype", choices=OUTER_DTYPES)
    # The deepspeed launcher appends --local_rank=N unless given --no_local_rank; LOCAL_RANK in
    # the environment says the same, so the flag is accepted and ignored.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
