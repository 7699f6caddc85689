"""The optimizer's parameter groups: AdamW's weight-decay groups, cut for ZeRO-1/2 into layer
blocks partitioned each on its own, and the groups' parameter names a checkpoint records.
"""
from __future__ import annotations

from typing import Any

import torch

from app.runtime.overlap import block_starts


def optimizer_groups(model: torch.nn.Module, weight_decay: float, blocks: int = 1
                     ) -> list[dict[str, Any]]:
    """Parameter groups for AdamW: weight decay on the matrices of the linear layers only; none on
    biases, LayerNorm weights and embeddings (decaying those only pulls scales and rare tokens'
    vectors toward zero; GPT-3, Megatron and the Hugging Face Trainer all exempt them).

    `blocks` > 1 (ZeRO-1/2: app.runtime.overlap.partition_blocks): the parameters in registration
    order are cut into that many runs of about equal size, each run two groups (decay, then
    none; an empty one left out), so ZeRO partitions each block on its own. 1: two groups."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding)
                  for p in m.parameters()}
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())

    def decays(p: torch.nn.Parameter) -> bool:
        ndim = len(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 partition is flat; its shape
        return ndim >= 2 and id(p) not in embeddings

    if blocks <= 1:
        return [{"params": [p for p in params if decays(p)], "weight_decay": weight_decay},
                {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}]
    groups: list[dict[str, Any]] = []
    for run in layer_blocks(params, blocks):
        for decay, wd in ((True, weight_decay), (False, 0.0)):
            members = [p for p in run if decays(p) is decay]
            if members:
                groups.append({"params": members, "weight_decay": wd})
    return groups


def layer_blocks(params: list[torch.nn.Parameter], blocks: int) -> list[list[torch.nn.Parameter]]:
    """`params` (in order) cut into at most `blocks` runs of consecutive ones of about equal
    size (app.runtime.overlap.block_starts)."""
    starts = block_starts([getattr(p, "ds_numel", p.numel()) for p in params], blocks)
    return [params[a:b] for a, b in zip(starts, starts[1:] + [len(params)])]


def group_names(model: torch.nn.Module, blocks: int = 1) -> list[list[str]]:
    """The parameters' names in each of `optimizer_groups(model, ..., blocks)`, in order. An
    optimizer's saved state holds parameters by their index in its groups; a checkpoint's train
    state records these names beside it, so the state reads back by name without building the
    model (app.checkpoint.universal)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]]
            for group in optimizer_groups(model, 0.0, blocks)]
