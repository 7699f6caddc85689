"""Checkpoints across ZeRO stages, world sizes, precisions and offload (docs/design.md,
"Switching ZeRO stage or world size").

A DeepSpeed checkpoint is laid out for the run that wrote it: ZeRO 1-2 save each rank's slice of
every flat parameter group, ZeRO-3 each rank's slice of every parameter, ZeRO-0 the whole module
with the optimizer's state per parameter. DeepSpeed loads one only into the same layout
("checkpoint used a DP world size of X but current is Y"). This module reads any of them (from
the files, no process group) into the *universal* form: every parameter whole, by name, as its
fp32 master weight and both Adam moments, plus the optimizer step and the LR schedule; and loads
that form into an engine of any stage, world size, precision or offload setting through
DeepSpeed's own fragment API (`safe_set_full_fp32_param`, `safe_set_full_optimizer_state`).

Layout of a universal checkpoint (`checkpoints/global_stepN.universal/`, written once next to the
tag it came from and reused, or wherever `python -m app convert --out` puts it):

    universal.json    format, the source's layout, step, the parameters' names and shapes
    train_state.json  the source's train state (resume checks read it as they read a tag's)
    state.pt          {"fp32" | "exp_avg" | "exp_avg_sq": {name: tensor}} (memory-mapped on load)
    scheduler.pt      the LR scheduler's state dict
    rng_rank{R}.pt    the source's RNG files (hard links)

The source tag is never modified.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, cast

import torch

from app.runtime import gather as param_gather
from app.runtime.overlap import partition_blocks
from data_tools import output
from data_tools.errors import UserError

FORMAT = 1
MARK = "universal.json"
SUFFIX = ".universal"
KINDS = ("fp32", "exp_avg", "exp_avg_sq")
STATE_FILE = "state.pt"
SCHEDULER_FILE = "scheduler.pt"

NamesFor = Callable[[dict[str, Any]], list[list[str]]]
"""model config (a train state's "model_config") -> the parameters' names in each optimizer group,
in order, as the run built them: how a caller above the model (app.build, app convert) names the
parameters of a checkpoint written before its train state recorded them (`param_group_names`).
This package reads checkpoints from their files; it never builds a model."""


@dataclass(frozen=True)
class Layout:
    """How a run lays out its model and optimizer state: what a DeepSpeed checkpoint is tied to."""

    zero_stage: int
    world_size: int
    precision: str
    offload: bool
    optimizer_blocks: int = 1
    """The optimizer's groups: this many layer blocks of two
    (app.runtime.param_groups.optimizer_groups); 1 is the two groups of every checkpoint written
    before the blocks."""

    def __str__(self) -> str:
        blocks = f", {self.optimizer_blocks} layer blocks" if self.optimizer_blocks > 1 else ""
        return (f"ZeRO-{self.zero_stage}, {self.world_size} rank{'s' * (self.world_size > 1)}, "
                f"{self.precision}{', optimizer offload' if self.offload else ''}{blocks}")

    def loads_natively(self, other: Layout) -> bool:
        """DeepSpeed's own load works: the same partitioning (ZeRO-0 holds whole tensors, so
        its world size does not matter), the same optimizer groups and wrapper."""
        return (self.zero_stage == other.zero_stage and self.precision == other.precision
                and self.offload == other.offload
                and self.optimizer_blocks == other.optimizer_blocks
                and (self.zero_stage == 0 or self.world_size == other.world_size))


def convertible_into(layout: Layout, flag: str = "--zero") -> str | None:
    """Why a checkpoint cannot be converted into `layout` (None: it can). ZeRO-0 in bf16/fp16
    keeps its fp32 masters in DeepSpeed's FP16_Optimizer flat groups, which the fragment API
    does not reach."""
    if layout.zero_stage == 0 and layout.precision != "fp32":
        return (f"converting into ZeRO-0 with {layout.precision} is not supported; use "
                f"{flag} 1 (the same communication volume, the fp32 masters sharded)")
    return None


def layout_of(ds_config: dict[str, Any], world_size: int, blocks: int | None = None) -> Layout:
    """The layout a run of `ds_config` on `world_size` ranks has (`blocks`: its optimizer's
    layer blocks; default: what this version builds at that stage)."""
    zero = ds_config.get("zero_optimization") or {}
    precision = ("bf16" if (ds_config.get("bf16") or {}).get("enabled")
                 else "fp16" if (ds_config.get("fp16") or {}).get("enabled") else "fp32")
    offload = (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    stage = int(zero.get("stage", 0))
    return Layout(stage, int(world_size), precision, bool(offload),
                  partition_blocks(stage) if blocks is None else int(blocks))


def adam_of(ds_config: dict[str, Any]) -> str:
    """Which optimizer DeepSpeed builds from a (filled) ds_config, as DeepSpeed decides it
    (ds/runtime/engine.py, get_optimizer_configuration): torch's Adam(W) when
    'optimizer.params.torch_adam' is set, else its CPU Adam where the optimizer is offloaded,
    else its fused op. Other optimizers by their type."""
    opt = ds_config.get("optimizer") or {}
    kind, params = str(opt.get("type", "AdamW")), opt.get("params") or {}
    if kind.lower() not in ("adam", "adamw"):
        return kind
    if params.get("torch_adam"):
        return f"torch {kind}" + (" (fused)" if params.get("fused") else "")
    offload = ((ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {})
    return "DeepSpeed CPUAdam" if offload.get("device") in ("cpu", "nvme") else \
        "DeepSpeed FusedAdam"


def optimizer_switch(state: dict[str, Any], ds_config: dict[str, Any]) -> tuple[str, str] | None:
    """(the checkpoint's optimizer, this run's) where their states differ in form, so a load
    must go through the universal form: torch's Adam keeps its step per parameter as a tensor
    and its own group settings (a load of DeepSpeed's groups leaves AdamW without decoupled
    weight decay), DeepSpeed's keep the step as an int, per group in the fused op's case. torch's
    fused and single-tensor AdamW share a form (`store.keep_own_settings`)."""
    saved, now = adam_of(state.get("ds_config") or {}), adam_of(ds_config)
    if saved.startswith("torch ") == now.startswith("torch "):
        return None
    return saved, now


def saved_layout(state: dict[str, Any]) -> Layout:
    """The layout a checkpoint was written in, from its train state (no `optimizer_blocks`:
    written before the blocks, in two groups). Its world is DeepSpeed's data-parallel world: in
    a low-communication run an island's ranks (--dp-mode diloco)."""
    run = state.get("run_config") or {}
    world = int(run["island_ranks"]) if run.get("dp_mode") == "diloco" \
        and run.get("island_ranks") else state["world_size"]
    return layout_of(state.get("ds_config") or {}, world, int(state.get("optimizer_blocks", 1)))


def is_universal(tag_dir: Path) -> bool:
    return (tag_dir / MARK).is_file()


def path_for(ckpt_dir: Path, tag: str) -> Path:
    """Where the universal form of ckpt_dir/tag lives when written next to it."""
    return ckpt_dir / f"{tag}{SUFFIX}"


# -- reading DeepSpeed's checkpoints -----------------------------------------------------------

@dataclass
class Whole:
    """A checkpoint's trainable state with every parameter whole, by name."""

    tensors: dict[str, dict[str, torch.Tensor]]
    """kind ("fp32", "exp_avg", "exp_avg_sq") -> name -> tensor (fp32, the parameter's shape)."""
    step: int
    """Optimizer steps taken (Adam's bias correction)."""
    scheduler: dict[str, Any]


def read(tag_dir: Path, state: dict[str, Any], names_for: NamesFor | None = None) -> Whole:
    """The whole state of one checkpoint tag of any ZeRO stage, world size and precision.
    `names_for`: the parameter names of a ZeRO-0 checkpoint whose train state lacks them."""
    layout = saved_layout(state)
    try:
        if layout.zero_stage == 0:
            return _read_zero0(tag_dir, state, names_for)
        bf16_optimizer = _by_rank(tag_dir.glob("bf16_zero_pp_rank_*_mp_rank_00_optim_states.pt"))
        if bf16_optimizer:
            return _read_flat_partitions(tag_dir, bf16_optimizer)
        parts = _by_rank(tag_dir.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"))
        if not parts:
            raise UserError(f"{tag_dir}: no *_optim_states.pt: an incomplete ZeRO checkpoint")
        if layout.zero_stage == 3:
            return _read_zero3(tag_dir, parts)
        return _read_flat_partitions(tag_dir, parts)
    except (RuntimeError, EOFError, OSError, KeyError, IndexError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{tag_dir}: cannot read the checkpoint for conversion "
                        f"({type(e).__name__}: {first[:200]})") from None


def _by_rank(files) -> list[Path]:
    """Partition files in rank order (rank 10 after rank 9, not after rank 1)."""
    # each was globbed by a *pp_rank_<rank>_* pattern: the search finds it
    return sorted(files, key=lambda f: int(
        cast("re.Match[str]", re.search(r"pp_rank_(\d+)_", f.name)).group(1)))


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def _step_of(optimizer_state: dict[str, Any]) -> int:
    """The step count from a torch optimizer state dict: per parameter (torch's Adam(W),
    DeepSpeed's CPU Adam) or per group (DeepSpeed's fused Adam)."""
    for entry in optimizer_state.get("state", {}).values():
        if "step" in entry:
            return int(entry["step"])
    for group in optimizer_state.get("param_groups", []):
        if "step" in group:
            return int(group["step"])
    return 0


def _split(flat: torch.Tensor, shapes: dict[str, torch.Size], into: dict[str, torch.Tensor]
           ) -> None:
    """Parameters laid back to back in a flat group (then alignment padding)."""
    offset = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        into[name] = flat[offset:offset + n].view(shape).float().clone()
        offset += n
    if offset > flat.numel():
        raise ValueError(f"flat group of {flat.numel()} elements holds {offset}")


def _read_zero0(tag_dir: Path, state: dict[str, Any], names_for: NamesFor | None) -> Whole:
    """ZeRO-0: the whole module, and the optimizer's state per parameter (fp32; by its index in
    the optimizer's groups, named by the train state's `param_group_names`), or over flat fp32
    master groups (bf16/fp16: DeepSpeed's FP16_Optimizer; names in the train state)."""
    saved = _load(sorted(tag_dir.glob("mp_rank_*_model_states.pt"))[0])
    opt = saved.get("optimizer") or {}
    tensors: dict[str, dict[str, torch.Tensor]] = {k: {} for k in KINDS}
    if "fp32_groups_flat" in opt:
        groups = state.get("flat_master_groups")
        if not groups:
            raise UserError(f"{tag_dir}: a ZeRO-0 {saved_layout(state).precision} checkpoint "
                            f"without its master groups' names (written before they were "
                            f"recorded): cannot convert it")
        inner = opt["optimizer_state_dict"]
        module = saved["module"]
        for g, names in enumerate(groups):
            shapes = {n: module[n].shape for n in names}
            _split(opt["fp32_groups_flat"][g], shapes, tensors["fp32"])
            moments = inner["state"][g]
            for kind in ("exp_avg", "exp_avg_sq"):
                _split(moments[kind], shapes, tensors[kind])
        return Whole(tensors, _step_of(inner), saved["lr_scheduler"])
    names = [n for group in param_names(tag_dir, state, names_for) for n in group]
    index = [i for group in opt["param_groups"] for i in group["params"]]
    if len(index) != len(names):
        raise UserError(f"{tag_dir}: the optimizer holds {len(index)} parameters, the model "
                        f"{len(names)}: not this model's checkpoint")
    module = saved["module"]
    for name, i in zip(names, index):
        tensors["fp32"][name] = module[name].float().clone()
        entry = opt["state"].get(i, {})
        for kind in ("exp_avg", "exp_avg_sq"):
            tensors[kind][name] = (entry[kind].float().clone() if kind in entry
                                   else torch.zeros_like(tensors["fp32"][name]))
    return Whole(tensors, _step_of(opt), saved["lr_scheduler"])


def _read_flat_partitions(tag_dir: Path, parts: list[Path]) -> Whole:
    """ZeRO 1-2 (and DeepSpeed's BF16_Optimizer): rank r holds the r-th slice of each flat
    fp32 group and of its moments; the slices in rank order are the group."""
    model = _load(sorted(tag_dir.glob("mp_rank_*_model_states.pt"))[0])
    states = [_load(f)["optimizer_state_dict"] for f in parts]
    tensors: dict[str, dict[str, torch.Tensor]] = {k: {} for k in KINDS}
    for g, shapes in enumerate(model["param_shapes"]):
        _split(torch.cat([s["single_partition_of_fp32_groups"][g] for s in states]), shapes,
               tensors["fp32"])
        for kind in ("exp_avg", "exp_avg_sq"):
            _split(torch.cat([s["base_optimizer_state"]["state"][g][kind] for s in states]),
                   shapes, tensors[kind])
    return Whole(tensors, _step_of(states[0]["base_optimizer_state"]), model["lr_scheduler"])


def _read_zero3(tag_dir: Path, parts: list[Path]) -> Whole:
    """ZeRO-3: every parameter is split on its own into `world` slices of ceil(n / world)
    elements (the last padded); rank r's flat group is its slice of each parameter in turn."""
    world = len(parts)
    model = _load(tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    states = [_load(f)["optimizer_state_dict"] for f in parts]
    tensors: dict[str, dict[str, torch.Tensor]] = {k: {} for k in KINDS}
    for g, shapes in enumerate(model["param_shapes"]):
        flats = {"fp32": [s["fp32_flat_groups"][g] for s in states],
                 **{kind: [s["optimizer_state_dict"]["state"][g][kind] for s in states]
                    for kind in ("exp_avg", "exp_avg_sq")}}
        offset = 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            part = math.ceil(n / world)
            for kind, ranks in flats.items():
                whole = torch.cat([r[offset:offset + part] for r in ranks])[:n]
                tensors[kind][name] = whole.view(shape).float().clone()
            offset += part
    inner = states[0]["optimizer_state_dict"]
    return Whole(tensors, _step_of(inner), model["lr_scheduler"])


def param_names(tag_dir: Path, state: dict[str, Any], names_for: NamesFor | None
                ) -> list[list[str]]:
    """The trained parameters' names in the optimizer's groups, in order: recorded in the train
    state at save time (app.build), else, for a checkpoint written before that, from the
    caller's `names_for` (a skeleton of the model: app.models.build.skeleton_group_names)."""
    groups = state.get("param_group_names")
    if groups:
        return groups
    if names_for is None:
        raise UserError(f"{tag_dir}: a ZeRO-0 checkpoint written before checkpoints named their "
                        f"optimizer's parameters: convert it first with `python -m app convert "
                        f"{tag_dir} --to-zero N --to-world W`")
    return names_for(state["model_config"])


# -- the universal form on disk ----------------------------------------------------------------

def write(source: Path, state: dict[str, Any], out: Path, *, command: str,
          target: Layout | None = None, names_for: NamesFor | None = None) -> Path:
    """Convert the checkpoint tag `source` (train state `state`) into the universal form at
    `out`, whole or not at all (a temporary sibling renamed into place). `names_for`: `read`'s."""
    whole = read(source, state, names_for)
    info = {"format": FORMAT, "source": str(source), "source_layout": asdict(saved_layout(state)),
            "target_layout": asdict(target) if target else None, "step": whole.step,
            "parameters": {n: list(t.shape) for n, t in whole.tensors["fp32"].items()}}
    needed = sum(t.numel() * 4 for kind in whole.tensors.values() for t in kind.values())
    free = output.free_bytes(out.parent if out.parent.exists() else source.parent)
    if free is not None and needed > free:
        raise UserError(output.disk_full_message(out, needed))
    with output.new_dir(out, "universal checkpoint", command) as tmp:
        torch.save(whole.tensors, tmp / STATE_FILE)
        torch.save(whole.scheduler, tmp / SCHEDULER_FILE)
        output.write_json_atomic(tmp / "train_state.json", state, fsync=False)
        for rng in sorted(source.glob("rng_rank*.pt")):
            try:
                os.link(rng, tmp / rng.name)
            except OSError:
                shutil.copy2(rng, tmp / rng.name)
        output.write_json_atomic(tmp / MARK, info)
    return out


def ensure(ckpt_dir: Path, tag: str, state: dict[str, Any], target: Layout,
           names_for: NamesFor | None = None) -> Path:
    """The universal form of ckpt_dir/tag, next to it: written on first need, then reused.
    `names_for`: `read`'s."""
    out = path_for(ckpt_dir, tag)
    if is_universal(out):
        return out
    print(f"resume: converting {ckpt_dir / tag} ({saved_layout(state)}) to {out}, once",
          file=sys.stderr, flush=True)
    return write(ckpt_dir / tag, state, out, command="train --resume", target=target,
                 names_for=names_for)


def read_info(tag_dir: Path) -> dict[str, Any]:
    try:
        info = json.loads((tag_dir / MARK).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{tag_dir / MARK}: unreadable ({e})") from None
    if info.get("format") != FORMAT:
        raise UserError(f"{tag_dir / MARK}: format {info.get('format')!r}, this version reads "
                        f"{FORMAT}")
    return info


# -- loading into an engine --------------------------------------------------------------------

def load(engine, tag_dir: Path) -> dict[str, Any]:
    """Put a universal checkpoint's weights, moments, step and LR schedule into `engine`, of
    whatever stage, world size, precision and offload; return the train state."""
    param_gather.flush(engine)  # a rollback: no step's late weight gather over the loaded ones
    info = read_info(tag_dir)
    try:
        tensors = torch.load(tag_dir / STATE_FILE, map_location="cpu", mmap=True,
                             weights_only=True)
        scheduler = torch.load(tag_dir / SCHEDULER_FILE, map_location="cpu", weights_only=False)
        state = json.loads((tag_dir / "train_state.json").read_text())
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{tag_dir}: cannot read the converted checkpoint ({first[:200]})"
                        ) from None
    step = int(info["step"])
    _ensure_states(engine)
    params = dict(engine.module.named_parameters())
    missing = sorted(set(params) - set(tensors["fp32"]))
    if missing:
        raise UserError(f"{tag_dir}: no saved values for parameter {missing[0]} "
                        f"({len(missing)} missing): another model's checkpoint")
    for name, param in params.items():
        _load_param(engine, name, param, {kind: tensors[kind][name] for kind in KINDS},
                    where=tag_dir)
    _set_step(_base_optimizer(engine), step)
    load_schedule(engine.lr_scheduler, scheduler)
    engine.global_steps = step
    engine.global_samples = step * engine.train_batch_size()
    return state


def load_schedule(sched, saved: dict[str, Any]) -> None:
    """The saved LR schedule's position into `sched` (a LambdaLR), and every group's LR from it.
    A checkpoint of another group count (two groups, or layer blocks: Layout.optimizer_blocks)
    keeps this run's per-group base LRs (from the same config: one LR, or Muon's two) and takes
    the saved step (torch's own load stops at the count's mismatch)."""
    own = list(sched.base_lrs)
    if len(saved.get("base_lrs", own)) == len(own):
        sched.load_state_dict(saved)
    else:
        saved = dict(saved)
        saved["base_lrs"] = own
        saved["lr_lambdas"] = (list(saved.get("lr_lambdas") or [None]) * len(own))[:len(own)]
        sched.load_state_dict(saved)
        sched._last_lr = [base * fn(sched.last_epoch)
                          for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    for group, lr in zip(sched.optimizer.param_groups, sched._last_lr):
        group["lr"] = lr


def _base_optimizer(engine) -> torch.optim.Optimizer:
    """The optimizer that holds the Adam state: inside DeepSpeed's ZeRO/mixed-precision wrapper,
    or the engine's own at ZeRO-0 in fp32."""
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def _load_param(engine, name: str, param: torch.nn.Parameter,
                values: dict[str, torch.Tensor], *, where: Path) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    numel = getattr(param, "ds_numel", param.numel())
    if values["fp32"].numel() != numel:
        raise UserError(f"{where}: parameter {name} has {values['fp32'].numel()} elements "
                        f"saved and {numel} in this model")
    if hasattr(param, "ds_id") or hasattr(param, "_hp_mapping"):  # ZeRO 1-3, BF16_Optimizer
        device = param.ds_tensor.device if hasattr(param, "ds_id") else param.device
        v = {k: t.to(device, torch.float32) for k, t in values.items()}
        safe_set_full_fp32_param(param, v["fp32"])
        for kind in ("exp_avg", "exp_avg_sq"):
            safe_set_full_optimizer_state(param, v[kind], kind)
        _set_low_precision(engine, param, v["fp32"])
        return
    # ZeRO-0 in fp32 (bf16/fp16 is refused before the run, `convertible_into`): the parameter
    # is the master, and the optimizer's state is keyed by it
    with torch.no_grad():
        param.copy_(values["fp32"].view_as(param))
    state = _base_optimizer(engine).state[param]
    for kind in ("exp_avg", "exp_avg_sq"):
        state[kind] = values[kind].to(param.device, torch.float32).view_as(param).clone()


def _set_low_precision(engine, param: torch.nn.Parameter, fp32: torch.Tensor) -> None:
    """The weights the forward pass uses, from the fp32 master: this rank's ZeRO-3 partition
    (and the full tensor where ZeRO-3 keeps a small parameter gathered), or the whole module
    parameter at ZeRO 1-2."""
    with torch.no_grad():
        if not hasattr(param, "ds_id"):
            param.copy_(fp32.view_as(param))
            return
        part = param.ds_tensor
        n = part.numel()
        rank = engine.optimizer._get_param_partition_rank(param) \
            if hasattr(engine.optimizer, "_get_param_partition_rank") else engine.global_rank
        flat = fp32.flatten()
        start = n * rank
        piece = flat[start:start + n]
        part.view(-1)[:piece.numel()].copy_(piece)
        if param.numel() == param.ds_numel:  # gathered and kept (a persistent small parameter)
            param.copy_(fp32.view(param.ds_shape))


def _ensure_states(engine) -> None:
    """Adam's moments exist for every tensor the optimizer steps: its groups' parameters, or
    the flat fp32 partitions ZeRO hands it (ZeRO-3 only at step time). Optimizers create them at
    their first step; DeepSpeed's fragment API writes into them."""
    optimizer = _base_optimizer(engine)
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        tensors += list(getattr(engine.optimizer, name, None) or [])
    created = False
    for p in {id(t): t for t in tensors}.values():
        entry = optimizer.state[p]
        for kind in ("exp_avg", "exp_avg_sq"):
            if kind not in entry:
                entry[kind] = torch.zeros_like(p, memory_format=torch.preserve_format)
                created = True
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if created and link is not None:  # ZeRO 1-2, BF16_Optimizer: fragments map the moments
        engine.optimizer._hp_optimizer_states_linked = False
        link()


def _set_step(optimizer: torch.optim.Optimizer, step: int) -> None:
    """Adam's step count wherever this optimizer keeps it: per parameter as a tensor (torch: on
    the parameter's device in fp32 where the group is fused or capturable, else on the host),
    per parameter as an int (DeepSpeed's CPU Adam) or per group (DeepSpeed's fused Adam)."""
    torch_style = type(optimizer).__module__.startswith("torch.")
    on_device: set[int] = set()
    for group in optimizer.param_groups:
        if "step" in group or not torch_style:
            group["step"] = step
        if group.get("fused") or group.get("capturable"):
            on_device.update(id(p) for p in group["params"])
    for p, entry in optimizer.state.items():
        old = entry.get("step")
        if isinstance(old, torch.Tensor):
            entry["step"] = torch.full_like(old, float(step))
        elif old is not None or not torch_style:
            entry["step"] = step
        else:
            entry["step"] = torch.tensor(float(step), dtype=torch.float32,
                                         device=p.device if id(p) in on_device else None)
