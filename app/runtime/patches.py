"""Fixes applied to a DeepSpeed engine after `deepspeed.initialize`, each measured.

`skip_lone_allreduce`: ZeRO-0 in a world of one skips a gradient "all-reduce" with itself.
`share_fp32_partitions`: ZeRO-3 in fp32 keeps one copy of each partition, not two.
`local_zero1_reduction`: ZeRO-1's boundary reduction skips its collective, for gradients the
app's reducer (app.runtime.overlap) summed during backward.
None changes a trained value (each docstring says why); each returns what it did.
"""
from __future__ import annotations

import types

import torch


def skip_lone_allreduce(engine) -> bool:
    """ZeRO-0 (and BF16_Optimizer, ZeRO-1 in bf16) in a world of one: no gradient all-reduce.
    DeepSpeed still flattens every gradient into one buffer, multiplies it by 1/1, "all-reduces"
    it alone and copies it back: an identity that cost GPT-2 4 x 256 (5 M parameters, CPU) ~3%
    of its step (docs/benchmarks.md, "bench"); BF16_Optimizer adds its fp32 gradients to its
    buffer before that (engine `_backward_epilogue`), so nothing is lost by skipping it. Returns
    whether it was skipped. ZeRO 1-3 keep their own reduction (it also moves gradients into
    their partitions)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    stage0 = engine.zero_optimization_stage() == 0 or isinstance(engine.optimizer, BF16_Optimizer)
    if not stage0 or engine.dp_world_size != 1 or getattr(engine, "has_moe_layers", False):
        return False
    engine.enable_backward_allreduce = False
    return True


def share_fp32_partitions(engine) -> int:
    """ZeRO-3 with fp32 parameters: the optimizer's fp32 partitions become the parameters' own
    partitions instead of a copy of them (4 bytes a parameter less, over the ranks). Returns the
    bytes freed on this rank.

    DeepSpeed skips the fp32 master copy when a partition is fp32 on the device already (its
    autocast case, where the two are aliases), but its test compares `tensor.device` with the
    accelerator's device name, a torch.device with a str, which is never equal in torch 2.x: fp32
    runs kept two identical copies (measured: model state at 2 ranks 0.625x ZeRO-0's instead of
    0.5x; docs/benchmarks.md, "bench"). Equal values, so nothing trained changes; DeepSpeed's
    copy of the master onto the partition after each step becomes a copy onto itself. Offloaded
    optimizers keep their own copies.
    """
    opt = engine.optimizer
    masters = getattr(opt, "fp32_partitioned_groups_flat", None)
    partitions = getattr(opt, "fp16_partitioned_groups_flat", None)
    if not masters or not partitions or getattr(opt, "offload_optimizer", False):
        return 0
    freed = 0
    for master, part in zip(masters, partitions):
        if (part is not None and master.dtype == part.dtype and master.shape == part.shape
                and master.device == part.device and master.numel() > 0
                and master.untyped_storage().data_ptr() != part.untyped_storage().data_ptr()
                and torch.equal(master, part)):
            freed += master.untyped_storage().nbytes()
            master.data = part.data
    return freed


def local_zero1_reduction(optimizer) -> None:
    """ZeRO-1 (DeepSpeedZeroOptimizer, gradients in `param.grad`): its reduction at the boundary
    keeps everything but the collective. The app's reducer has already summed every rank's
    gradient into `param.grad` during backward; DeepSpeed then divides by the world size, as
    before its all-reduce, and moves this rank's slice into its partition, now a local copy.

    Every gradient collective of ZeRO-1 goes through `allreduce_bucket` (the bucketed
    reduce-scatter path, `reduce_scatter: true`) or `gradient_reduction_w_predivide` (`false`);
    both are replaced on this instance by their bodies without the collective. Sum then divide
    against divide then sum: the same bits when the world size is a power of two (an exact
    division), else within an ulp.
    """
    def allreduce_bucket(self, bucket, communication_data_type, rank=None, log=None,
                         divide=True, process_group=None):
        tensor = self.flatten(bucket)
        reduced = tensor if communication_data_type == tensor.dtype \
            else tensor.to(communication_data_type)
        if divide and self.gradient_average:
            reduced.div_(_dp_size(self, process_group))
        if reduced is not tensor:
            tensor.copy_(reduced)
        return reduced

    def gradient_reduction_w_predivide(self, tensor, communication_data_type):
        if tensor.numel() == 0:
            return tensor
        reduced = tensor if communication_data_type == tensor.dtype \
            else tensor.to(communication_data_type)
        if self.gradient_average:
            reduced.div_(_dp_size(self, None))
        if reduced is not tensor:
            tensor.copy_(reduced)
        return reduced

    optimizer.allreduce_bucket = types.MethodType(allreduce_bucket, optimizer)
    optimizer.gradient_reduction_w_predivide = types.MethodType(gradient_reduction_w_predivide,
                                                                optimizer)


def _dp_size(optimizer, process_group) -> float:
    import torch.distributed as dist

    group = optimizer.dp_process_group if process_group is None else process_group
    return dist.get_world_size(group=group) / float(optimizer.sequence_parallel_size)
