"""ZeRO-3's partitioned build: a model constructed inside `deepspeed.zero.Init`, with the
same weights, bit for bit, as an unpartitioned build of the same seed.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, Mapping

import torch
from transformers import PreTrainedModel


@contextlib.contextmanager
def partitioned(zero3_config: Mapping[str, Any] | None) -> Iterator[None]:
    """Build inside `deepspeed.zero.Init`: each module's parameters are partitioned across the
    ranks as soon as the module is constructed, so a rank holds its shard plus at most one
    module's full tensors, never the model.

    transformers initialises weights in `post_init` (`init_weights`), which runs inside each
    PreTrainedModel's constructor, after its submodules are already partitioned (empty on every
    rank). For the duration of the build `init_weights` is replaced by one that visits the
    modules in transformers' own order and runs the model's own `_initialize_weights` on each
    with that module's parameters whole on every rank (`_materialized`), each rank keeping its
    slice. The random draws happen in the same order as in an unpartitioned build, so the
    weights are the same, bit for bit (tests/test_zero_switch.py).
    """
    if zero3_config is None:
        yield
        return
    import deepspeed

    original = PreTrainedModel.init_weights
    PreTrainedModel.init_weights = _partitioned_init_weights
    try:
        with deepspeed.zero.Init(config_dict_or_path=dict(zero3_config)):
            yield
    finally:
        PreTrainedModel.init_weights = original


@contextlib.contextmanager
def _materialized(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Give each partitioned parameter a whole tensor on this rank (NaN-filled, fp32, as an
    unpartitioned build initialises) for an init function to write, then keep this rank's slice
    of what it wrote. Every rank makes the same draws in the same order, so there is nothing to
    communicate, and one module's parameters at a time are whole. A tensor the init left alone
    (a tied weight initialised already) is not copied back."""
    import torch.distributed as dist

    params = list({id(p): p for p in params}.values())
    empties = [p.data for p in params]
    for p in params:
        p.data = torch.full(p.ds_shape, float("nan"), dtype=torch.float32,
                            device=p.ds_tensor.device)
    try:
        yield
    finally:
        for p, empty in zip(params, empties):
            whole, p.data = p.data, empty
            untouched = torch.isnan(whole)
            if untouched.all():
                continue
            if untouched.any():
                raise RuntimeError(f"weight init left part of a {tuple(p.ds_shape)} parameter "
                                   f"unwritten")
            n = p.ds_tensor.numel()
            piece = whole.view(-1)[dist.get_rank(group=p.ds_process_group) * n:][:n]
            p.ds_tensor.view(-1)[:piece.numel()].copy_(piece)


def _partitioned_init_weights(self: PreTrainedModel) -> None:
    """`PreTrainedModel.init_weights` for partitioned parameters (see `partitioned`)."""
    from transformers import initialization

    custom = self.is_custom_code() if hasattr(self, "is_custom_code") else False
    two_args = len(inspect.signature(self._initialize_weights).parameters) >= 2
    guard = getattr(initialization, "guard_torch_init_functions", contextlib.nullcontext)

    def visit(module: torch.nn.Module, init_fn) -> None:
        for child in module.children():
            visit(child, child._initialize_weights if isinstance(child, PreTrainedModel)
                  else init_fn)
        if getattr(module, "_is_hf_initialized", False):
            return
        # a module's init may also write its direct children's parameters (as transformers has it)
        params = list(module.parameters(recurse=False))
        for child in module.children():
            if not isinstance(child, PreTrainedModel):
                params.extend(child.parameters(recurse=False))
        with _materialized([p for p in params if hasattr(p, "ds_id")]):
            init_fn(module, custom) if two_args else init_fn(module)

    with torch.no_grad(), guard():
        visit(self, self._initialize_weights)
    if "recompute_mapping" in inspect.signature(self.tie_weights).parameters:
        self.tie_weights(recompute_mapping=False)  # as transformers' own init_weights calls it
    else:
        self.tie_weights()
