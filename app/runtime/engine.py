"""The DeepSpeed engine: `initialize` (the optimizer from the config, our LR schedule, the
patches) and what the app reads back from a built engine.

The ds_config (app.runtime.ds_config) owns ZeRO stage, precision and clipping; after
`initialize`, what DeepSpeed built (optimizer, dtypes), the gradient norm, the loss scale and the
model-state bytes are read from the engine here, so the loop sees an `nn.Module` with
backward/step and never imports DeepSpeed.
"""
from __future__ import annotations

import contextlib
import gc
import os
import sys
import types
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from app.runtime import gather, islands, registry, step_guard
from app.runtime.device import device_ordinal
from app.runtime.ds_config import zero_stage
from app.runtime.ops import load_op, optimizer_op
from app.runtime.overlap import GradReducer, PartitionReducer, flat_group
from app.runtime.patches import (
    bf16_unfused_step,
    local_fp32_clipping,
    local_zero1_reduction,
    one_norm_collective,
    partitioned_bf16_norm,
    relink_only_moved,
    share_fp32_partitions,
    skip_lone_allreduce,
    stream_ordered_epilogue,
    sync_free_steps,
)
from app.runtime.step_guard import HOST_SKIP
from app.runtime.zero2_overlap import overlap_zero2, uses_muon


def initialize(model: torch.nn.Module, ds_config: dict[str, Any],
               lr_lambda: Callable[[int], float], param_groups: list[dict[str, Any]],
               patches: Iterable[str] = registry.ALL, mpu: Any = None):
    """`deepspeed.initialize` with the optimizer from the config (over `param_groups`) and our
    LR schedule on it, then the DeepSpeed patches in `patches` that apply (app.runtime.registry;
    `engine.app_patches` lists those that did) and the non-finite step guard. `mpu`: DeepSpeed's
    model-parallel unit (a low-communication run's islands: app.runtime.islands)."""
    import deepspeed

    guards = []

    def scheduler(optimizer):  # DeepSpeed hands it the torch optimizer inside its wrapper
        guards.append(step_guard.StepGuard(optimizer))
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    op = optimizer_op(ds_config)
    if op:
        load_op(op)

    # DeepSpeed takes LOCAL_RANK as the device ordinal unless told: with one visible device per
    # task (Slurm --gpus-per-task=1) that ordinal names no device (app.runtime.device)
    args = types.SimpleNamespace(device_rank=device_ordinal(int(os.environ.get("LOCAL_RANK", 0))))
    # DeepSpeed's BF16_Optimizer (bf16 at ZeRO 0-1) runs gc.collect() twice per parameter group
    # as it builds (a forced see_memory_usage, DeepSpeed 0.19), each a walk over every object the
    # imports made (~500k: torch, transformers, DeepSpeed): 0.2-0.3 s apiece, 7.7 s of bert-tiny's
    # 9.4 s build on a CPU core (docs/design.md, "Start-up"). Frozen, those objects are out of the
    # collector's way; they live as long as the process does. What is garbage now is collected
    # first. With ZeRO, DeepSpeed's optimizer check imports Muon while it builds (torch.compile,
    # functorch, networkx: ~560 modules, ~80k objects): imported here, they are frozen too.
    if zero_stage(ds_config) > 0:
        with contextlib.suppress(ImportError):
            import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    gc.collect()
    gc.freeze()
    gc.enable()  # off since app/__main__.py, for the imports
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=param_groups,
                                           config=ds_config, lr_scheduler=scheduler, mpu=mpu)
    registry.adopt_deepspeed_swaps(engine)  # ZeRO-3's F.linear: undone with the engine
    install_patches(engine, frozenset(patches))
    if guards:
        guards[0].attach(engine)
    return engine


class _Installing:
    """The selection, what applied and the lines about what could not (an installer's `ready`
    checks a patch's instance attributes once the patch otherwise applies)."""

    def __init__(self, selection: frozenset[str]):
        self.selection = selection
        self.applied: list[str] = []
        self.notes: list[str] = []

    def on(self, name: str) -> bool:
        return name in self.selection

    def ready(self, name: str, obj: Any) -> bool:
        return registry.applies(name, self.selection, obj, self.notes)

    def did(self, name: str, result: Any) -> Any:
        if result:
            self.applied.append(name)
        return result


def install_patches(engine, selection: frozenset[str]) -> list[str]:
    """Install the selected patches that apply to this engine, in the registry's order; sets
    `engine.app_patches` (the names that applied), `engine.app_sync_free` and
    `engine.app_grad_reduction` (config.json, the start-up lines). A patch whose instance
    attributes are missing is left out with one line on stderr (DeepSpeed's own path)."""
    at = _Installing(selection)
    opt = engine.optimizer
    at.did("share_fp32_partitions", at.on("share_fp32_partitions")
           and share_fp32_partitions(engine, at.ready))
    at.did("skip_lone_allreduce", at.on("skip_lone_allreduce")
           and skip_lone_allreduce(engine, at.ready))
    at.did("local_fp32_clipping", at.on("local_fp32_clipping")
           and local_fp32_clipping(engine, at.ready))
    at.did("one_norm_collective", at.on("one_norm_collective")
           and one_norm_collective(opt, at.ready))
    at.did("relink_only_moved", at.on("relink_only_moved") and relink_only_moved(opt, at.ready))
    engine.app_sync_free = None
    if at.on("bf16_unfused_step"):
        engine.app_sync_free = at.did("bf16_unfused_step", bf16_unfused_step(engine, at.ready))
    if at.on("sync_free_steps") and not engine.app_sync_free:
        engine.app_sync_free = at.did("sync_free_steps", sync_free_steps(engine, at.ready))
    at.did("stream_ordered_epilogue", at.on("stream_ordered_epilogue")
           and stream_ordered_epilogue(opt, at.ready))
    engine.app_grad_reduction = overlap_reduction(engine, at)
    if at.on("param_gather"):  # ZeRO-1/2's weight all-gather during the next forward
        gathered = at.did("param_gather", gather.install(engine, at.ready,
                                                          pairwise=at.on("gloo_pairwise")))
        if gathered:
            engine.app_grad_reduction += f"; {gathered}"
    exchanges = {"partition_reduce", "param_gather", "zero2_overlap"} & set(at.applied)
    if at.on("gloo_pairwise") and exchanges and dist.get_backend() == "gloo":
        at.applied.append("gloo_pairwise")  # their point-to-point exchanges ran on gloo
    engine.app_patches = at.applied
    for note in at.notes:
        if int(os.environ.get("RANK", 0)) == 0:
            print(note, file=sys.stderr)
    return at.applied


def overlap_reduction(engine, at: _Installing | None = None) -> str:
    """Reduce gradients during backward where DeepSpeed would reduce them after it (ZeRO-0;
    ZeRO-1 with gradients in `param.grad` or BF16_Optimizer's buffer, reduce-scattered): the
    app's bucketed reducers (app.runtime.overlap) take the boundary's reduction over, where
    their patches (grad_overlap, partition_reduce, zero2_overlap) are selected. Returns how this
    run reduces its gradients, and why, for the start-up line and config.json."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    at = at or _Installing(registry.ALL)
    stage, opt = engine.zero_optimization_stage(), engine.optimizer
    dtype = str(engine.communication_data_type).removeprefix("torch.")
    if engine.dp_world_size == 1:
        return "no reduction (one rank)"
    if getattr(engine, "has_moe_layers", False) or engine.pipeline_parallelism \
            or getattr(engine, "sequence_parallel_size", 1) > 1:
        return f"DeepSpeed's all-reduce in {dtype} after backward (not overlapped: MoE, " \
               f"pipeline or sequence parallel)"
    zero1 = (stage == 1 and isinstance(opt, DeepSpeedZeroOptimizer)
             and not opt.partition_gradients and not opt.overlap_comm and not opt.cpu_offload
             and not getattr(opt, "use_grad_accum_attribute", True))
    bf16 = isinstance(opt, BF16_Optimizer) and opt.immediate_grad_update
    # a 16-bit wire is divided before the sum, as DeepSpeed does (the sum of N ranks' fp16
    # gradients overflows N times sooner); fp32 sums first and DeepSpeed's step divides once
    average = not zero1 or torch.finfo(engine.communication_data_type).bits < 32
    scatter = ((zero1 or bf16) and at.on("partition_reduce")
               and at.ready("partition_reduce", opt)
               and _scatter_reduction(engine, zero1, bf16, average, at.on("gloo_pairwise")))
    if scatter:
        at.did("partition_reduce", True)
        return scatter
    if ((stage == 0 and not hasattr(opt, "get_grads_for_reduction")) or zero1 or bf16) \
            and at.on("grad_overlap") and (stage == 0 or at.ready("grad_overlap", opt)):
        reducer = GradReducer(engine.module.parameters(), group=engine.seq_data_parallel_group,
                              world_size=engine.dp_world_size,
                              comm_dtype=engine.communication_data_type,
                              is_boundary=engine.is_gradient_accumulation_boundary,
                              average=average, keep_missing=not (zero1 or bf16),
                              grad_of=_fp32_grads(opt) if bf16 else None)
        _take_over(engine, reducer, zero1, average)
        at.did("grad_overlap", True)
        if zero1:
            return f"{reducer.describe()}; ZeRO-1 then keeps its partition (its own " \
                   f"collective skipped); parameters all-gathered by the step"
        if bf16:
            return f"{reducer.describe()} from BF16_Optimizer's fp32 accumulation; " \
                   f"parameters all-gathered by the step"
        return reducer.describe()
    if isinstance(opt, BF16_Optimizer):
        return f"all-reduce in {dtype} after backward, then an all-gather of the parameters " \
               f"(not overlapped: BF16_Optimizer accumulates in fp32 after backward without " \
               f"bf16.immediate_grad_update)"
    zero2 = None
    if stage == 2:  # devices without streams
        zero2 = overlap_zero2(engine, enabled=at.on("zero2_overlap"), ready=at.ready,
                              pairwise=at.on("gloo_pairwise"))
        at.did("zero2_overlap", zero2 and getattr(opt, "app_zero2_overlap", None))
    if zero2:
        return zero2
    if stage == 2:
        return f"ZeRO-2's reduce buckets in {dtype} at each of the " \
               f"{engine.gradient_accumulation_steps()} micro step(s) (overlapped on a GPU side " \
               f"stream, not on CPU, where each collective blocks backward; ZeRO 0-1 reduce " \
               f"once a step, during backward)"
    if stage < 2:
        return f"DeepSpeed's all-reduce in {dtype} after backward (not overlapped)"
    return f"DeepSpeed's ZeRO-{stage} reduce-scatter in {dtype} during backward"


def _scatter_reduction(engine, zero1: bool, bf16: bool, average: bool,
                       pairwise: bool) -> str | None:
    """ZeRO-1 (fp32 DeepSpeedZeroOptimizer, or BF16_Optimizer): the reducer reduce-scatters
    each rank's partition during backward (app.runtime.overlap.PartitionReducer), half an
    all-reduce's bytes; None where DeepSpeed's flat groups are not equal partitions of the data
    parallel group (then the all-reduce reducer runs)."""
    opt, group = engine.optimizer, engine.seq_data_parallel_group
    if uses_muon(opt):
        return None  # Muon reads each matrix's whole gradient, reduced
    if bf16 and (islands.model_parallel(engine) or opt.norm_type != 2):
        return None  # partitioned_bf16_norm: the 2-norm, over the data parallel ranks only
    if zero1:
        pairs = zip(opt.round_robin_bit16_groups, opt.bit16_groups_flat,
                    opt.parallel_partitioned_bit16_groups)
    else:
        pairs = zip(opt.bf16_groups, opt.bf16_groups_flat, opt.bf16_partitioned_groups)
    found = [flat_group(*pair) for pair in pairs]
    groups = [g for g in found if g is not None]
    if not groups or len(groups) != len(found) or any(
            dist.get_world_size(g) != engine.dp_world_size for g in opt.real_dp_process_group):
        return None
    reducer = PartitionReducer(groups, list(engine.module.parameters()), group=group,
                               world_size=engine.dp_world_size,
                               comm_dtype=engine.communication_data_type,
                               is_boundary=engine.is_gradient_accumulation_boundary,
                               average=average, grad_of=_fp32_grads(opt) if bf16 else None,
                               pairwise=pairwise)
    _take_over(engine, reducer, zero1, average)
    if zero1:
        return f"{reducer.describe()}; ZeRO-1 then copies its partition (its own collective " \
               f"skipped); parameters all-gathered by the step"
    partitioned_bf16_norm(opt, group)
    return f"{reducer.describe()} from BF16_Optimizer's fp32 accumulation; gradient norm " \
           f"summed over the partitions; parameters all-gathered by the step"


def _take_over(engine, reducer, zero1: bool, predivided: bool) -> None:
    """`reducer` reduces the boundary's gradients in place of DeepSpeed (at ZeRO-1, DeepSpeed's
    own reduction then only copies this rank's partition, dividing it unless the reducer
    divided before the sum: patches.local_zero1_reduction)."""
    engine.app_grad_reducer = reducer
    engine.allreduce_gradients = _reduce_at_boundary(engine, reducer, zero1)
    if zero1:
        local_zero1_reduction(engine.optimizer, predivided=predivided)


def _fp32_grads(opt) -> Callable:
    """A bf16 parameter's gradient as BF16_Optimizer keeps it: its view of the fp32
    accumulation buffer (with `immediate_grad_update`, its hook adds each micro step's bf16
    gradient there during backward, before the reducer's hook reads it)."""
    views = {id(lp): opt.fp32_groups_gradients[i][j]
             for i, group in enumerate(opt.bf16_groups) for j, lp in enumerate(group)}
    return lambda p: views.get(id(p))


def _reduce_at_boundary(engine, reducer: GradReducer, then_deepspeed: bool) -> Callable:
    """The engine's `allreduce_gradients` (called at the end of `engine.backward`): at the
    boundary, the reducer's `finish`; at ZeRO-1, DeepSpeed's own then moves the reduced
    gradients into its partition (its collective skipped: patches.local_zero1_reduction)."""
    deepspeed_reduction = engine.allreduce_gradients

    def allreduce_gradients(*args, **kwargs):
        if engine.is_gradient_accumulation_boundary():
            reducer.finish()
        if then_deepspeed:
            deepspeed_reduction(*args, **kwargs)

    return allreduce_gradients


def optimizer_step(engine) -> torch.Tensor | float:
    """`engine.step()` (the optimizer steps at the boundary micro step only), and this optimizer
    step's skip flag for the anomaly monitor (app.faults.anomaly): the step guard's device
    scalar (1.0 where the gradients were not finite and the update was not applied:
    app.runtime.step_guard), HOST_SKIP where DeepSpeed skipped it on the host outside fp16, else
    0.0. fp16's overflow skips are the loss scaler's routine, not marked. Where DeepSpeed
    skipped, the LR schedule advances all the same: it follows the step counter and the data."""
    guard = getattr(engine, "app_step_guard", None)
    if guard is not None:
        guard.begin()
    skipped = engine.skipped_steps  # a host counter: reading it costs nothing
    engine.step()
    if engine.skipped_steps != skipped:
        engine.lr_scheduler.step()
        return 0.0 if engine.fp16_enabled() else HOST_SKIP
    found = guard.skipped() if guard is not None else None
    return 0.0 if found is None else found


def global_batch(engine) -> int:
    """Samples an optimizer step over the whole job: DeepSpeed's batch is its data-parallel
    world's, an island's in a low-communication run (app.runtime.islands)."""
    found = islands.of(engine)
    return engine.train_batch_size() * (found.count if found else 1)


def apply_lr_schedule(engine) -> None:
    """Set every parameter group's LR from the schedule at its current step (after a rollback
    changed the schedule: the cool-down applies from the very next step)."""
    sched = engine.lr_scheduler
    for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * fn(sched.last_epoch)


def engine_facts(engine) -> dict[str, Any]:
    """What DeepSpeed built from the config (recorded in config.json): the optimizer wrapper,
    the dtypes of the weights and of gradient accumulation, and whether its step runs without
    host reads (patches.sync_free_steps; None: DeepSpeed's own step)."""
    model_dtype, grad_dtype = engine.get_data_types()
    guard = getattr(engine, "app_step_guard", None)
    return {"optimizer": type(engine.optimizer).__name__, "model_dtype": str(model_dtype),
            "grad_accum_dtype": str(grad_dtype), "zero_stage": engine.zero_optimization_stage(),
            "communication_data_type": str(engine.communication_data_type),
            "grad_reduction": getattr(engine, "app_grad_reduction", None),
            "sync_free_step": getattr(engine, "app_sync_free", None),
            "patches": list(getattr(engine, "app_patches", [])),
            "dp_mode": engine.app_outer.describe() if hasattr(engine, "app_outer") else "sync",
            "nonfinite_skip": guard.describe() if guard is not None else None}


def grad_norm_before_step(engine) -> torch.Tensor | None:
    """The global gradient norm, when DeepSpeed will not report one (ZeRO-0 in fp32).

    Call after the boundary micro step's backward (gradients are all-reduced then) and before
    `engine.step()` clears them. Returns None where `engine.get_global_grad_norm()` will work.
    """
    if engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled():
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return None
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def model_state_bytes(engine) -> int:
    """Bytes of model state this rank holds: parameters (at ZeRO-3 its partitions and the
    persistent ones), gradients and optimizer states, counted once per tensor storage.

    Walks the module's parameters and the optimizer chain (DeepSpeed's ZeRO wrapper, then the
    torch optimizer inside it: flat buffers, partitions, `state`). Call between the boundary
    micro step's backward and `engine.step()`, where gradients exist (the step frees them);
    it reads tensor sizes only, no device sync. The ZeRO paper's model states, measured.
    """
    seen: dict[tuple[int, int], int] = {}

    def add(obj: Any, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta":
                return
            storage = obj.untyped_storage()
            if storage.data_ptr():
                seen[(storage.data_ptr(), obj.device.index or 0)] = storage.nbytes()
        elif depth > 0 and isinstance(obj, (list, tuple)):
            for item in obj:
                add(item, depth - 1)
        elif depth > 0 and isinstance(obj, dict):
            for item in obj.values():
                add(item, depth - 1)

    for p in engine.module.parameters():
        for t in (p, p.grad, getattr(p, "ds_tensor", None)):
            add(t, 0)
    optimizer, hops = engine.optimizer, 0
    while optimizer is not None and hops < 4:  # ZeRO wrapper -> torch optimizer
        add(vars(optimizer), 4)
        optimizer, hops = getattr(optimizer, "optimizer", None), hops + 1
    return sum(seen.values())


def reported_grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def loss_scale(engine) -> float | None:
    """The dynamic loss scale (fp16 only)."""
    if not engine.fp16_enabled():
        return None
    scale = getattr(engine.optimizer, "cur_scale", None) or getattr(engine.optimizer,
                                                                    "loss_scale", None)
    return None if scale is None else float(scale)


def versions() -> dict[str, str]:
    import deepspeed
    import transformers

    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__}
