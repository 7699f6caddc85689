"""Checkpoints: DeepSpeed's own save/load, plus what makes a resume exact and safe.

Layout under RUN_DIR/checkpoints/:

    global_step{N}/             DeepSpeed's files (model, optimizer/ZeRO partitions, scheduler)
    global_step{N}/train_state.json   step, consumed samples, tokens, dataset fingerprint, config
    global_step{N}/rng_rank{R}.pt     each rank's RNG states (dropout), written by that rank
    global_step{N}/manifest.json      every file's size and checksum, written last
                                      (app/checkpoint/manifest.py)
    latest                      the newest complete tag (ours, written atomically once every
                                rank's files and the manifest are on disk)

Our files are written before DeepSpeed's save, so `latest` never names a tag without them;
train_state.json lets a resume be checked (and refused) before any process group starts. A save
that fails (a full disk, a permission) removes its partial tag and leaves `latest` where it was.
Tags themselves (their names, which one a resume or a rollback takes, the damaged and
interrupted ones, pruning) are app/checkpoint/tags.py's.
"""
from __future__ import annotations

import json
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Any, cast

import torch

from app.checkpoint import manifest, tags, universal
from app.faults import injection as faults
from app.runtime.device import rng_state, set_rng_state
from app.runtime.dist import any_rank, barrier, world_size
from data_tools import output
from data_tools.errors import UserError

ISLAND_DIR = "island"  # TAG/island{K}: island K's DeepSpeed files (--dp-mode diloco)
# What defines a sample: a resume that changed one would reinterpret `consumed_samples`.
SAMPLE_LAYOUT = ("seq_len", "packing", "seed", "objective")


def check_resumable(state: dict[str, Any], *, fingerprint: str, model_config: dict[str, Any],
                    where: Path, sample_layout: dict[str, Any] | None = None) -> None:
    """Refuse a resume on other data, another model geometry or another sample layout."""
    if state.get("dataset_fingerprint") != fingerprint:
        raise UserError(f"{where}: the checkpoint was trained on dataset "
                        f"{state.get('dataset_fingerprint')}, --data is {fingerprint}: refusing "
                        f"to resume on different data (use a new --out, or --resume never)")
    saved = state.get("model_config", {})
    model_config = json.loads(json.dumps(model_config))  # as saved: string keys, lists
    for key, value in model_config.items():
        if key in saved and saved[key] != value and not _may_change(key):
            raise UserError(f"{where}: model field '{key}' is {saved[key]!r} in the checkpoint "
                            f"and {value!r} now: refusing to resume into another model")
    run = state.get("run_config", {})
    for key, value in (sample_layout or {}).items():
        if run.get(key) is not None and run[key] != value:
            raise UserError(f"{where}: --{key.replace('_', '-')} was {run[key]!r} and is "
                            f"{value!r} now: the checkpoint's sample position would mean other "
                            f"samples; resume with --{key.replace('_', '-')} {run[key]}, or "
                            f"start a new run")


def _may_change(key: str) -> bool:
    """Config fields a resume may change: dropout, kernels, bookkeeping (not the geometry)."""
    return (key.startswith("_") or "dropout" in key or "pdrop" in key or key in (
        "transformers_version", "attn_implementation", "dtype", "torch_dtype", "use_cache"))


def estimate_bytes(ckpt_dir: Path, engine) -> int:
    """Bytes the next save will write: the newest tag's size, else 16 bytes a parameter (fp32
    weights and master copy, two Adam moments), the most any precision or ZeRO stage writes."""
    tag = tags.latest_tag(ckpt_dir) if ckpt_dir.is_dir() else None
    if tag is not None:
        return sum(f.stat().st_size for f in (ckpt_dir / tag).rglob("*") if f.is_file())
    return 16 * sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                    for p in engine.module.parameters())


def save(engine, ckpt_dir: Path, *, step: int, state: dict[str, Any], rank: int,
         keep_last: int, skip_errors: bool = False) -> Path | None:
    """Save tag global_step{step} on every rank, then prune to the newest `keep_last` tags.

    A disk that cannot hold the checkpoint is found before anything is written (every rank
    agrees); a write that fails anyway removes the partial tag and stops this rank, which ends
    the job (the launcher stops the others). `skip_errors` skips the save instead, where that
    is safe: when the ranks agree before writing, or in a world of one. Returns None if skipped.
    """

    tag = tags.tag_for(step)
    tag_dir = ckpt_dir / tag
    needed = estimate_bytes(ckpt_dir, engine)
    free = output.free_bytes(ckpt_dir)
    if any_rank(free is not None and needed > free, engine.device):
        _save_failed(output.disk_full_message(tag_dir, needed), tag, ckpt_dir, skip_errors)
        return None
    try:
        with output.writing(tag_dir, needed):
            _write(engine, ckpt_dir, tag, state, rank)
            # hashed by the rank that wrote them
            entries = manifest.own_entries(tag_dir, rank, _island(engine))
    except UserError as e:
        shutil.rmtree(tag_dir, ignore_errors=True)
        _save_failed(str(e), tag, ckpt_dir, skip_errors and world_size() == 1)
        return None
    # a collective: every rank's partitions are on disk before the manifest, then `latest`
    entries = manifest.gather_entries(entries)
    if rank == 0:
        with output.writing(tag_dir):
            manifest.write(tag_dir, entries)
            (tag_dir / manifest.SAVING).unlink(missing_ok=True)  # complete: its manifest says
        output.write_text_atomic(ckpt_dir / tags.LATEST, tag)
        tags.prune(ckpt_dir, keep_last)
        faults.damage_after_save(step, tag_dir)
    barrier()  # no rank reads `latest` (or starts the next save) before it is written
    return tag_dir


def _write(engine, ckpt_dir: Path, tag: str, state: dict[str, Any], rank: int) -> None:
    tag_dir = ckpt_dir / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:  # first: a tag this save began (deleted by a resume if it does not finish)
        output.write_text_atomic(tag_dir / manifest.SAVING, f"{tag}\n")
    state = {**state, "manifest": manifest.NAME}  # this tag is complete once its manifest is
    torch.save(rng_state(), tag_dir / f"rng_rank{rank}.pt")
    if rank == 0:
        output.write_json_atomic(tag_dir / tags.STATE, state)
    # `latest` is ours to write, after every rank's files are on disk and atomically: DeepSpeed
    # writes it from rank 0 before its final barrier and in place, so a job killed mid-save
    # could leave it naming a partial tag, or empty
    where, under = _deepspeed_dir(engine, ckpt_dir, tag)
    engine.save_checkpoint(where, tag=under, client_state={"train_state": state},
                           save_latest=False)
    outer = getattr(engine, "app_outer", None)
    if outer is not None:  # this rank's slice of the global weights and its outer momentum
        torch.save(outer.state_dict(), tag_dir / f"outer_rank{rank}.pt")
    faults.die_in_save(cast(int, tags.step_of(tag)))  # a tag_for tag: it has a step


def _save_failed(message: str, tag: str, ckpt_dir: Path, skip: bool) -> None:
    previous = tags.latest_tag(ckpt_dir)
    kept = (f"`latest` still names {previous}" if previous else "no earlier checkpoint exists")
    text = f"checkpoint {tag} not saved: {message}; {kept}"
    if not skip:
        raise UserError(text + " (--save-errors skip continues past failed saves)")
    print(f"warning: {text}; training continues (--save-errors skip)", file=sys.stderr,
          flush=True)
    return None


def load(engine, ckpt_dir: Path, tag: str) -> dict[str, Any]:
    """Load model, optimizer and scheduler states; return the train state. RNG: `restore_rng`.

    A checkpoint written in another layout (ZeRO stage, world size, precision, offload) is
    loaded through its universal form (app/checkpoint/universal.py): converted once by rank 0,
    next to it. The LR schedule keeps this run's base LRs (--lr: the resume contract,
    settle.settle_changes); the caller sets the groups' LRs from it once the train state (its
    cool-down) is loaded (app.runtime.engine.apply_lr_schedule).
    """
    sched = getattr(engine, "lr_scheduler", None)
    own = list(sched.base_lrs) if sched is not None else []
    state = _load_tag(engine, ckpt_dir, tag)
    if sched is not None and len(own) == len(sched.base_lrs):
        sched.base_lrs = own  # the checkpoint's were its run's --lr
    return state


def _load_tag(engine, ckpt_dir: Path, tag: str) -> dict[str, Any]:
    tag_dir = ckpt_dir / tag
    if universal.is_universal(tag_dir):
        return universal.load(engine, tag_dir)
    tags.check_files(tag_dir)  # a rollback reads a tag no one checked yet (a resume's: hashed once)
    state = tags.read_state(ckpt_dir, tag)
    here = universal.layout_of(engine.config, engine.dp_world_size)  # an island's, in diloco
    if not universal.saved_layout(state).loads_natively(here) or \
            universal.optimizer_switch(state, engine.config):
        if engine.global_rank == 0:
            universal.ensure(ckpt_dir, tag, state, here)
        barrier()
        return universal.load(engine, universal.path_for(ckpt_dir, tag))
    own = _own_settings(engine)
    where, under = _deepspeed_dir(engine, ckpt_dir, tag)
    try:
        path, client = engine.load_checkpoint(where, tag=under, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        _load_outer(engine, tag_dir)
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{ckpt_dir / tag}: cannot load the checkpoint ({first[:200]})") from None
    if path is None:
        raise UserError(f"{ckpt_dir / tag}: DeepSpeed found no checkpoint to load")
    keep_own_settings(universal._base_optimizer(engine), own)
    return client["train_state"]


def _island(engine) -> tuple[int, int] | None:
    """(this rank's island, ranks an island) in a low-communication run, else None."""
    from app.runtime.islands import of

    found = of(engine)
    return (found.index, found.size) if found is not None else None


def _deepspeed_dir(engine, ckpt_dir: Path, tag: str) -> tuple[str, str]:
    """(directory, tag) DeepSpeed saves and loads this rank's files in: the tag itself, or in a
    low-communication run its island's own subdirectory (`TAG/islandK`), since every island
    writes the same file names (its ranks are DeepSpeed's data-parallel ranks 0..N-1) and their
    optimizer states differ."""
    island = _island(engine)
    if island is None:
        return str(ckpt_dir), tag
    return str(ckpt_dir / tag), f"{ISLAND_DIR}{island[0]}"


def _load_outer(engine, tag_dir: Path) -> None:
    """This rank's outer state (a low-communication run): its slice of the global weights and
    the outer momentum, as saved; a checkpoint without one (a synchronous run's) leaves the
    outer step to start a round from the loaded weights."""
    outer = getattr(engine, "app_outer", None)
    path = tag_dir / f"outer_rank{engine.global_rank}.pt"
    if outer is not None and path.is_file():
        outer.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))


# How a torch optimizer computes, not what it computes: torch's load_state_dict takes them from
# the checkpoint with the hyperparameters, so a CPU checkpoint (single-tensor AdamW) would step
# unfused on a GPU, and a GPU one (fused) fused on a CPU
IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


def _own_settings(engine) -> list[dict[str, Any]]:
    return [{k: g[k] for k in IMPLEMENTATION if k in g}
            for g in universal._base_optimizer(engine).param_groups]


def keep_own_settings(optimizer: torch.optim.Optimizer, own: list[dict[str, Any]]) -> None:
    """Put this run's implementation settings (`IMPLEMENTATION`, taken before the load) back
    into a torch optimizer's groups, and each parameter's step where that implementation keeps
    it: on the parameter's device in fp32 when fused or capturable, else on the host."""
    torch_style = type(optimizer).__module__.startswith("torch.")
    if not torch_style or len(own) != len(optimizer.param_groups):
        return
    for group, settings in zip(optimizer.param_groups, own):
        group.update(settings)
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                optimizer.state[p]["step"] = (step.to(p.device, torch.float32) if on_device
                                              else step.cpu())


def restore_rng(ckpt_dir: Path, tag: str, *, rank: int) -> bool:
    """Put this rank's RNG back as it was at the save (False if the file is missing, e.g. the
    world grew: that rank then keeps its fresh seed)."""
    path = ckpt_dir / tag / f"rng_rank{rank}.pt"
    if not path.is_file():
        return False
    try:
        state = torch.load(path, weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise UserError(f"{path}: corrupt or truncated checkpoint file ({e})") from None
    set_rng_state(state)
    return True


def flat_master_groups(engine) -> list[list[str]] | None:
    """Names of the parameters in each flat fp32 master group, in order, where DeepSpeed keeps
    the masters flattened in its optimizer state (ZeRO-0 in bf16/fp16; ZeRO 1-3 checkpoints
    carry their own layout). Saved in the train state so an export can take the masters."""
    groups = getattr(engine.optimizer, "fp16_groups", None)
    if engine.zero_optimization() or not groups:
        return None
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return [[names[id(p)] for p in group] for group in groups]


def consolidated_state_dict(ckpt_dir: Path, tag: str, stage: int,
                            state: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """fp32 weights of the whole model from one checkpoint tag: ZeRO 1-3 partitions consolidated
    by DeepSpeed's own zero_to_fp32; ZeRO-0 holds the whole module, in bf16/fp16 runs with the
    fp32 masters beside it in the optimizer state (those are the weights, not their rounding).
    `state`: the tag's train state, where it is not in `ckpt_dir / tag` (an island's
    subdirectory)."""
    tag_dir = ckpt_dir / tag
    try:
        partitions = sorted(tag_dir.glob("bf16_zero_pp_rank_*_optim_states.pt"),
                            key=lambda f: int(f.name.split("_")[4]))
        if partitions and "zero_stage" not in _load(partitions[0])["optimizer_state_dict"]:
            return _bf16_optimizer_masters(tag_dir, partitions)
        if stage > 0:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
        saved = _load(sorted(tag_dir.glob("mp_rank_*_model_states.pt"))[0])
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{tag_dir}: cannot read the checkpoint ({first[:200]})") from None
    weights = {k: v.float() for k, v in saved["module"].items()}
    masters = (saved.get("optimizer") or {}).get("fp32_groups_flat")
    groups = (state or tags.read_state(ckpt_dir, tag)).get("flat_master_groups")
    if masters and groups:
        for flat, names in zip(masters, groups):
            offset = 0
            for name in names:
                n = weights[name].numel()
                weights[name] = flat[offset:offset + n].view_as(weights[name]).clone()
                offset += n
    return weights


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def _bf16_optimizer_masters(tag_dir: Path, partitions: list[Path]) -> dict[str, torch.Tensor]:
    """fp32 weights from DeepSpeed's BF16_Optimizer checkpoint (bf16 at ZeRO-1 with fp32
    gradient accumulation), which zero_to_fp32 does not read (no `zero_stage` key in it): each
    rank holds a slice of every flat fp32 group; the slices in rank order are the group, its
    parameters back to back in `param_shapes` order, then alignment padding."""
    model = _load(sorted(tag_dir.glob("mp_rank_*_model_states.pt"))[0])
    states = [_load(f)["optimizer_state_dict"] for f in partitions]
    weights = {k: v.float() for k, v in model["module"].items() if k in model["buffer_names"]}
    for g, shapes in enumerate(model["param_shapes"]):
        flat = torch.cat([s["single_partition_of_fp32_groups"][g] for s in states])
        offset = 0
        for name, shape in shapes.items():
            n = shape.numel()
            weights[name] = flat[offset:offset + n].view(shape).clone()
            offset += n
    return weights
