"""Two fixes applied to a DeepSpeed engine after `deepspeed.initialize`, each measured.

`skip_lone_allreduce`: ZeRO-0 in a world of one skips a gradient "all-reduce" with itself.
`share_fp32_partitions`: ZeRO-3 in fp32 keeps one copy of each partition, not two.
Neither changes a trained value (each docstring says why); each returns what it did.
"""
from __future__ import annotations

import torch


def skip_lone_allreduce(engine) -> bool:
    """ZeRO-0 in a world of one: no gradient all-reduce. DeepSpeed still flattens every gradient
    into one buffer, multiplies it by 1/1, "all-reduces" it alone and copies it back: an
    identity that cost GPT-2 4 x 256 (5 M parameters, CPU) ~3% of its step (docs/benchmarks.md,
    "bench"). Returns whether it was skipped. ZeRO 1-3 keep their own reduction (it also moves
    gradients into their partitions)."""
    if engine.zero_optimization_stage() != 0 or engine.dp_world_size != 1 \
            or getattr(engine, "has_moe_layers", False):
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
