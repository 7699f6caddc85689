"""The DeepSpeed patch registry: every place the app replaces part of DeepSpeed, in one table
(docs/design.md, "The DeepSpeed patch registry", is the same table in prose).

Each `Patch` names the DeepSpeed symbols it relies on (`targets`, checked with their signatures
before anything is written; `attrs`, instance attributes checked on the live optimizer or engine
when it installs), the DeepSpeed version it was read against, when it applies, the test that
compares it with DeepSpeed's own path, and the upstream change that would retire it.

One switch chooses them: `app train --deepspeed-patches all|none|NAME,...|all,-NAME,...`
(`select`). `none` is DeepSpeed's own path everywhere. Under `all`, a patch whose targets are
missing or changed in the installed DeepSpeed is left out with one line naming it and the
version (DeepSpeed's own path then runs, which is correct: each patch is checked whole before
any part of it installs, so a reducer never runs beside a DeepSpeed collective it meant to
remove); a patch named explicitly that cannot apply stops the run (exit 2) before anything is
written. config.json records the patches that applied (`engine.patches`).

Process-wide swaps of DeepSpeed's module functions go through `swap`, counted per engine, and
are undone when the last engine that needed them is released (`release`, or its garbage
collection): two engines in one process do not leak into each other.
"""
from __future__ import annotations

import importlib
import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from data_tools.errors import UserError

READ_AGAINST = "0.19.8"
"""The DeepSpeed release every patch below was read against (its source, line by line)."""
VERIFIED = ("0.19.8",)
"""Releases the whole test suite passed with (setup.cfg admits these only)."""


@dataclass(frozen=True)
class Target:
    """A DeepSpeed symbol a patch relies on: `module:Name.attr`, and where it is a function, the
    names of its parameters (after `self`) as read in READ_AGAINST; None: any signature."""

    path: str
    params: tuple[str, ...] | None = None

    def problem(self) -> str | None:
        """What is wrong with this target in the installed DeepSpeed (None: as read)."""
        module_name, _, attr = self.path.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            return f"{self.path} is missing"
        if self.params is None:
            return None
        try:
            names = [p for p in inspect.signature(obj).parameters if p != "self"]
        except (TypeError, ValueError):
            return None  # a builtin or a wrapped callable: its signature cannot be read
        if tuple(names[:len(self.params)]) != self.params:
            return f"{self.path} takes ({', '.join(names)}), read as ({', '.join(self.params)})"
        return None


ZERO12 = "deepspeed.runtime.zero.stage_1_and_2"
BF16 = "deepspeed.runtime.bf16_optimizer"
STAGE3 = "deepspeed.runtime.zero.stage3"
ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
UNFUSED = "deepspeed.runtime.fp16.unfused_optimizer:FP16_UnfusedOptimizer"
OPT12 = f"{ZERO12}:DeepSpeedZeroOptimizer"
BF16_OPT = f"{BF16}:BF16_Optimizer"

# ZeRO-1's own reduction without its collective (patches.local_zero1_reduction): the app's
# reducers need it wherever they take ZeRO-1's reduction over
_ZERO1_REDUCTION = (
    Target(f"{OPT12}.allreduce_bucket",
           ("bucket", "communication_data_type", "rank", "log", "divide", "process_group")),
    Target(f"{OPT12}.gradient_reduction_w_predivide", ("tensor", "communication_data_type")),
    Target(f"{ENGINE}.allreduce_gradients"),
    Target(f"{ENGINE}.is_gradient_accumulation_boundary", ()),
)
# what the reducers read on each optimizer they take the reduction of (by its class)
_REDUCER_ATTRS = {
    "DeepSpeedZeroOptimizer": ("flatten", "gradient_average", "sequence_parallel_size",
                               "dp_process_group", "partition_gradients", "overlap_comm",
                               "cpu_offload", "round_robin_bit16_groups", "bit16_groups_flat",
                               "parallel_partitioned_bit16_groups", "real_dp_process_group"),
    "BF16_Optimizer": ("bf16_groups", "bf16_groups_flat", "bf16_partitioned_groups",
                       "fp32_groups_gradients", "fp32_groups_gradients_flat",
                       "fp32_groups_gradient_flat_partition", "immediate_grad_update",
                       "real_dp_process_group", "norm_type")}


@dataclass(frozen=True)
class Patch:
    name: str
    does: str
    applies: str
    targets: tuple[Target, ...]
    attrs: tuple[str, ...] | dict[str, tuple[str, ...]]
    """Attributes of the engine's optimizer (or engine) read or replaced on the instance,
    checked at install where the patch applies; by the object's class name where they differ."""
    test: str
    retire: str
    runs_on: str = "all"
    """all | cuda (devices with streams) | cpu (devices without) | gloo."""


PATCHES: tuple[Patch, ...] = (
    Patch("share_fp32_partitions",
          "ZeRO-3 fp32: the optimizer's fp32 master partitions are the parameters' own "
          "partitions, not a second copy (DeepSpeed compares a torch.device with a str)",
          "ZeRO-3 with fp32 weights, no offload",
          (Target(f"{STAGE3}:DeepSpeedZeroOptimizer_Stage3.step"),),
          ("fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat"),
          "tests/test_zero_switch.py (ZeRO-3 fp32 model state), tests/test_patch_registry.py "
          "(none = all)",
          "an upstream fix of the device comparison in stage3's fp32 partition set-up"),
    Patch("skip_lone_allreduce",
          "no gradient all-reduce of a rank with itself at world size 1",
          "ZeRO-0 or BF16_Optimizer, one data-parallel rank, no MoE",
          (Target(f"{ENGINE}.allreduce_gradients"),), (),
          "tests/test_patch_registry.py (none = all)",
          "DeepSpeed skipping allreduce_gradients when dp_world_size == 1"),
    Patch("local_fp32_clipping",
          "ZeRO-0 fp32 clips by the norm of its (already all-reduced) gradients without "
          "DeepSpeed's all-reduce of the norm",
          "ZeRO-0 in fp32, no MoE, model parallelism or grad scaler",
          (Target(f"{ENGINE}.clip_fp32_gradients", ()),), (),
          "tests/test_patches.py::test_zero0_fp32_clipping_equals_deepspeeds_without_its_"
          "collective",
          "DeepSpeed skipping the norm all-reduce without MoE or model parallelism"),
    Patch("one_norm_collective",
          "ZeRO-1/2's gradient norm in one all-reduce of every group's sum of squares, not one "
          "blocking all-reduce per parameter group",
          "DeepSpeedZeroOptimizer without offload, MoE, model parallelism or Muon",
          (Target(f"{OPT12}.scaled_global_norm", ("norm_type",)),
           Target(f"{OPT12}._muon_update_lacks_loss_scale", ("group_index",)),
           Target("deepspeed.runtime.utils:combine_grad_norm_groups", ("norm_groups",
                                                                       "norm_type")),
           Target("deepspeed.runtime.zero.utils:get_norm_dtype", ()),
           Target("deepspeed.comm.pg_utils:is_parallel", ("group",))),
          ("averaged_gradients", "params_in_partition", "bit16_groups", "dp_process_group",
           "model_parallel_group", "device", "cpu_offload"),
          "tests/test_overlap.py (group norms against DeepSpeed's per-group collectives)",
          "batched per-group norms upstream (one collective in get_grad_norm_direct)"),
    Patch("relink_only_moved",
          "ZeRO-1/2's step re-points only weights that no longer view the flat buffer",
          "DeepSpeedZeroOptimizer (ZeRO-1 fp32, ZeRO-2)",
          (Target(f"{OPT12}._update_model_bit16_weights", ("group_index",)),),
          ("round_robin_bit16_offsets", "round_robin_bit16_groups", "round_robin_bit16_meta",
           "round_robin_bit16_indices", "bit16_groups_flat", "bit16_groups"),
          "tests/test_patches.py (relink: the same weights as DeepSpeed's loop)",
          "upstream relinking only weights that moved (its comment: 'we probably don't need "
          "this?')"),
    Patch("sync_free_steps",
          "BF16_Optimizer's and ZeRO 1-3's optimizer step without host reads: the invalid-norm "
          "check, the clip test and the NaN mask run on the device (a step with non-finite "
          "gradients is skipped by the app's step guard, app.runtime.step_guard)",
          "bf16 or fp32 (not fp16), no model or expert parallelism; ZeRO-2 bf16 unless the "
          "ds_config asks for bf16.check_grad_overflow",
          tuple(Target(f"{m}:is_invalid_grad_norm", ("norm",)) for m in (BF16, ZERO12, STAGE3))
          + (Target(f"{BF16}:clip_tensors_by_global_norm",
                    ("input_tensors", "max_norm", "global_norm", "mpu", "eps")),)
          + tuple(Target(f"{m}:mask_nan_or_inf_with_val_inplace", ("input", "device", "val"))
                  for m in ("deepspeed.runtime.utils", ZERO12, STAGE3))
          + (Target(f"{BF16_OPT}.step", ("closure",)), Target(f"{OPT12}.step", ("closure",)),
             Target(f"{STAGE3}:DeepSpeedZeroOptimizer_Stage3.step")),
          (),
          "tests/test_patch_registry.py (none = all, ZeRO 0-3, fp32 and bf16), "
          "tests/test_host_syncs.py",
          "upstream device-side overflow checks (deepspeedai/DeepSpeed#4436, #4915, #5547)"),
    Patch("bf16_unfused_step",
          "FP16_UnfusedOptimizer.step (ZeRO-0 bf16) re-implemented with its arithmetic on the "
          "device: no per-gradient bool() overflow check, no float() of each norm",
          "ZeRO-0 in bf16 (FP16_UnfusedOptimizer, not fused LAMB)",
          (Target(f"{UNFUSED}.step", ("closure",)), Target(f"{UNFUSED}._update_scale",
                                                           ("skip",))),
          ("fused_lamb_legacy", "fp16_groups", "fp32_groups", "loss_scale_config", "clip_grad",
           "optimizer", "overflow"),
          "tests/test_patch_registry.py (ZeRO-0 bf16: losses and gradient norms equal "
          "DeepSpeed's step)",
          "an upstream FP16_UnfusedOptimizer step without host reads in bf16 mode"),
    Patch("stream_ordered_epilogue",
          "ZeRO-1/2's end of backward makes the compute stream wait for the reduction stream "
          "instead of synchronizing the device",
          "DeepSpeedZeroOptimizer with overlap_comm, no offload, on a device with streams",
          (Target(f"{OPT12}.independent_gradient_partition_epilogue", ()),),
          ("reduction_stream", "overlap_comm", "cpu_offload"),
          "bench/gpu_check.sh (ZeRO-2 with and without it: equal losses; CUDA sanitizer)",
          "deepspeedai/DeepSpeed#8364 (the same sync, open) after #2500",
          runs_on="cuda"),
    Patch("grad_overlap",
          "gradients all-reduced in buckets during backward (app.runtime.overlap.GradReducer) "
          "where DeepSpeed reduces after it: ZeRO-0, and ZeRO-1 where partition_reduce does not "
          "apply",
          "more than one data-parallel rank; ZeRO-0, ZeRO-1 with gradients in param.grad, or "
          "BF16_Optimizer with immediate_grad_update; no MoE, pipeline or sequence parallelism",
          _ZERO1_REDUCTION, _REDUCER_ATTRS,
          "tests/test_overlap.py (the same losses as DeepSpeed's reduction)",
          "an overlapped ZeRO-0 upstream (or torch DDP inside the engine)"),
    Patch("partition_reduce",
          "ZeRO-1's gradients reduce-scattered into each rank's partition during backward "
          "(app.runtime.overlap.PartitionReducer), with BF16_Optimizer's norm from the "
          "partitions",
          "as grad_overlap, at ZeRO-1, where DeepSpeed's flat groups are equal partitions",
          _ZERO1_REDUCTION + (Target(f"{BF16_OPT}.get_grads_for_norm", ("for_clipping",)),),
          _REDUCER_ATTRS,
          "tests/test_overlap.py (bit for bit against DeepSpeed's reduction; NCCL's branch "
          "with -gloo_pairwise)",
          "DeepSpeed's overlap_comm at stage 1 (#4887) measured on NCCL as fast"),
    Patch("param_gather",
          "ZeRO-1/2's weight all-gather launched in chunks after the step and waited for by "
          "each module in the next forward (app.runtime.gather)",
          "ZeRO-1/2 over more than one rank, no offload, MoE, pipeline or sequence parallelism",
          (Target(f"{BF16}:all_gather_dp_groups",
                  ("groups_flat", "partitioned_param_groups", "dp_process_group")),
           Target(f"{ZERO12}:all_gather_dp_groups",
                  ("groups_flat", "partitioned_param_groups", "dp_process_group")),
           Target(f"{OPT12}._optimizer_step", ("group_no",)),
           Target(f"{OPT12}.step", ("closure",)), Target(f"{BF16_OPT}.step", ("closure",)),
           Target(f"{ENGINE}.save_checkpoint", ("save_dir", "tag")),
           Target(f"{ENGINE}.load_checkpoint", ("load_dir", "tag"))),
          ("real_dp_process_group", "nccl_start_alignment_factor"),
          "tests/test_param_gather.py (the same losses as DeepSpeed's gather; NCCL's branch "
          "with -gloo_pairwise)",
          "an upstream overlapped parameter gather (deepspeedai/DeepSpeed#6876)"),
    Patch("zero2_overlap",
          "ZeRO-2's bucket reductions launched asynchronously, completed when their buffer is "
          "needed (app.runtime.zero2_overlap). For the simulated CPU cluster only: on devices "
          "with streams DeepSpeed's own overlap runs",
          "ZeRO-2 over more than one rank on a device without streams (CPU)",
          tuple(Target(f"{OPT12}.{name}", params) for name, params in (
              ("reduce_ipg_grads", ("comm_dtype",)),
              ("average_tensor", ("tensor", "communication_data_type")),
              ("allreduce_and_copy", ("small_bucket", "communication_data_type", "rank", "log",
                                      "divide", "process_group")),
              ("allreduce_and_copy_with_multiple_ranks", ("small_bucket",
                                                          "communication_data_type")),
              ("reduce_independent_p_g_buckets_and_remove_grads", ("param", "i")),
              ("get_gradient_for_reduction", ("param",)),
              ("copy_grads_in_partition", ("param", "group_idx")),
              ("_clear_previous_reduced_grads", ()),
              ("clear_grad_attribute", ("param",))))
          + (Target(f"{ZERO12}:pg_correctness_test"),
             Target("deepspeed.runtime.torch_autocast:sort_dtypes", ("dtypes",))),
          ("ipg_buckets", "extra_large_param_to_reduce", "params_already_reduced",
           "is_param_in_current_partition", "reduce_bucket_size", "bit16_groups",
           "contiguous_gradients", "reduce_scatter", "zenflow"),
          "tests/test_zero2_overlap.py (bit for bit against DeepSpeed's ZeRO-2; ~130 s of the "
          "suite, for the CPU netsim benchmark)",
          "none needed on GPUs; retire with the CPU netsim benchmark",
          runs_on="cpu"),
    Patch("gloo_pairwise",
          "not a DeepSpeed patch: on gloo the app's reduce-scatter and all-gather (reducers, "
          "gather, zero2_overlap) are point-to-point exchanges, which move half the bytes of "
          "gloo's own; without it they run the collectives NCCL runs, on gloo (tests)",
          "the gloo backend (CPU)", (), (),
          "tests/test_overlap.py, tests/test_param_gather.py (both branches)",
          "a gloo reduce-scatter that moves a reduce-scatter's bytes",
          runs_on="gloo"),
)
NAMES = tuple(p.name for p in PATCHES)
BY_NAME = {p.name: p for p in PATCHES}
ALL = frozenset(NAMES)


def parse(text: str) -> tuple[frozenset[str], frozenset[str]]:
    """`--deepspeed-patches` (all | none | NAME,... | all,-NAME,...) as (selected, named): the
    patches asked for, and those asked for by name (which must apply or stop the run)."""
    words = [w.strip() for w in str(text).split(",") if w.strip()]
    if not words:
        raise UserError("--deepspeed-patches: expected all, none, or patch names "
                        f"({', '.join(NAMES)})")
    selected: set[str] = set()
    named: set[str] = set()
    for i, word in enumerate(words):
        if word in ("all", "none"):
            if i:
                raise UserError(f"--deepspeed-patches {text}: '{word}' must come first")
            selected = set(ALL) if word == "all" else set()
            continue
        name, remove = (word[1:], True) if word.startswith("-") else (word, False)
        if name not in BY_NAME:
            raise UserError(f"--deepspeed-patches: unknown patch {name!r} (known: "
                            f"{', '.join(NAMES)})")
        if remove:
            selected.discard(name)
            named.discard(name)
        else:
            selected.add(name)
            named.add(name)
    return frozenset(selected), frozenset(named)


def select(text: str, version: str | None = None) -> tuple[frozenset[str], list[str]]:
    """The patches this run may install and the lines to print about the others: every
    selected patch's targets checked in the installed DeepSpeed, before anything is written.
    A patch asked for by name whose targets are missing or changed is a UserError; under
    `all` it is left out (DeepSpeed's own path runs) with one line."""
    selected, named = parse(text)
    if version is None:
        import deepspeed
        version = deepspeed.__version__
    notes = []
    if selected and version not in VERIFIED:
        notes.append(f"DeepSpeed {version}: the app's patches were read against {READ_AGAINST} "
                     f"and tested with {', '.join(VERIFIED)}; each checks its targets below "
                     f"(--deepspeed-patches none runs DeepSpeed's own path)")
    usable = set(selected)
    for name in sorted(selected, key=NAMES.index):
        problems = [p for p in (t.problem() for t in BY_NAME[name].targets) if p]
        if not problems:
            continue
        usable.discard(name)
        line = (f"DeepSpeed patch {name}: {problems[0]} in DeepSpeed {version} (read against "
                f"{READ_AGAINST})")
        if name in named:
            raise UserError(f"--deepspeed-patches {name}: {line.split(': ', 1)[1]}; leave it "
                            f"out, or install deepspeed=={READ_AGAINST}")
        notes.append(f"{line}: left out, DeepSpeed's own path runs")
    return frozenset(usable), notes


def missing_attrs(name: str, obj: Any) -> list[str]:
    """The instance attributes patch `name` reads on `obj` that it lacks."""
    attrs = BY_NAME[name].attrs
    if isinstance(attrs, dict):
        attrs = attrs.get(type(obj).__name__, ())
    return [a for a in attrs if not hasattr(obj, a)]


def applies(name: str, selection: Iterable[str], obj: Any, notes: list[str]) -> bool:
    """Whether patch `name` is selected and finds its instance attributes on `obj` (else one
    line in `notes`: DeepSpeed's own path runs)."""
    if name not in selection:
        return False
    missing = missing_attrs(name, obj)
    if missing:
        import deepspeed
        notes.append(f"DeepSpeed patch {name}: {type(obj).__name__}.{missing[0]} is missing in "
                     f"DeepSpeed {deepspeed.__version__} (read against {READ_AGAINST}): left "
                     f"out, DeepSpeed's own path runs")
        return False
    return True


# -- process-wide swaps, undone with the last engine ---------------------------------------------

_SWAPS: dict[tuple[int, str], dict[str, Any]] = {}  # (id(module), name) -> original, users


def swap(module: Any, name: str, make: Callable[[Callable], Callable], owner: Any) -> None:
    """Replace `module.name` by `make(original)` while `owner` (an engine) lives or until
    `release(owner)`; several owners share one swap, undone with the last of them."""
    key = (id(module), name)
    entry = _SWAPS.get(key)
    if entry is None:
        original = getattr(module, name)
        entry = _SWAPS[key] = {"module": module, "name": name, "original": original,
                               "owners": set()}
        setattr(module, name, make(original))
    _own(owner, key)


def _own(owner: Any, key: tuple[int, str]) -> None:
    entry = _SWAPS[key]
    if id(owner) in entry["owners"]:
        return
    entry["owners"].add(id(owner))
    owned = getattr(owner, "_app_swaps", None)
    if owned is None:
        owned = []
        try:
            owner._app_swaps = owned
            weakref.finalize(owner, _release_ids, id(owner), owned)
        except (AttributeError, TypeError):
            pass
    owned.append(key)


def release(owner: Any) -> None:
    """Undo the swaps `owner` held (the last owner of a swap restores DeepSpeed's function)."""
    _release_ids(id(owner), getattr(owner, "_app_swaps", []))


def _release_ids(owner_id: int, keys: list) -> None:
    for key in list(keys):
        entry = _SWAPS.get(key)
        if entry is None:
            continue
        entry["owners"].discard(owner_id)
        if not entry["owners"]:
            setattr(entry["module"], entry["name"], entry["original"])
            del _SWAPS[key]
    keys.clear()


def _pristine() -> list[tuple[Any, str, Any]]:
    """Process-wide functions DeepSpeed itself replaces and leaves replaced: ZeRO-3's
    `zero.Init` swaps `torch.nn.functional.linear` for its memory-efficient `zero3_linear_wrap`
    ("This will persist unless manually reset", DeepSpeed 0.19.8 partition_parameters.py), whose
    rounding differs from torch's: a ZeRO-0 run after a ZeRO-3 run in one process trained other
    losses from step 2 on. Taken when this module is first imported, before any engine."""
    import torch.nn.functional as F
    return [(F, "linear", F.linear)]


_PRISTINE = _pristine()


def adopt_deepspeed_swaps(owner: Any) -> None:
    """After an engine is built: the functions DeepSpeed swapped for it (`_PRISTINE`) are
    restored when the last engine that saw them swapped goes (`release`), as the app's own."""
    for module, name, original in _PRISTINE:
        if getattr(module, name) is original:
            continue
        key = (id(module), name)
        if key not in _SWAPS:
            _SWAPS[key] = {"module": module, "name": name, "original": original,
                           "owners": set()}
        _own(owner, key)


def swapped(module: Any, name: str) -> bool:
    return (id(module), name) in _SWAPS


def table_markdown() -> str:
    """The registry as the Markdown table docs/design.md carries (tests/test_patch_registry.py
    keeps the two equal)."""
    rows = ["| patch | replaces (DeepSpeed " + READ_AGAINST + ") | applies | runs on | "
            "compared with DeepSpeed in | retired by |",
            "| --- | --- | --- | --- | --- | --- |"]
    for p in PATCHES:
        symbols = ", ".join(f"`{t.path.split(':', 1)[1]}`" for t in p.targets) or "-"
        rows.append(f"| `{p.name}` | {symbols} | {p.applies} | {p.runs_on} | {p.test} | "
                    f"{p.retire} |")
    return "\n".join(rows)
