"""What the planners start from: the model as built on PyTorch's meta device (its config, shape
and exact parameter counts) and the ZeRO setups of this repository's DeepSpeed configs. Shared by
`app plan` (app/plan/planner.py) and `app tune` (app/plan/tune.py); a module of its own so that
neither command imports the other (docs/design.md, "Where things live").
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from app.plan.memory import ModelSize, ZeroSetup
from app.telemetry.flops import ModelShape
from data_tools.errors import UserError

SETUPS = (("zero0", False), ("zero1", False), ("zero2", False), ("zero3", False),
          ("zero3_offload", True))


@dataclass(frozen=True)
class ModelInfo:
    """The planned model: its config, geometry and exact parameter counts."""

    name: str
    objective: str
    config: Any
    shape: ModelShape
    size: ModelSize


def describe_model(name: str, *, vocab_size: int | None = None,
                   overrides: dict[str, Any] | None = None,
                   attn_implementation: str = "sdpa") -> ModelInfo:
    """Build the preset's config and count its parameters on the meta device (no memory)."""
    import torch

    from app.models.build import build_model
    from app.models.presets import build_config, objective_of, preset

    p = preset(name)  # UserError for an unknown preset
    vocab = vocab_size or p.config_class().vocab_size
    if vocab < 1:
        raise UserError(f"--vocab-size {vocab}: must be at least 1")
    config = build_config(name, vocab_size=vocab, special_ids={}, overrides=overrides,
                          attn_implementation=attn_implementation)
    shape = ModelShape.from_config(config)  # refuses shapes that do not divide
    try:
        with torch.device("meta"):  # the training model's sparse MLM head has the same weights
            model = build_model(config)
    except (ValueError, TypeError, RuntimeError) as e:
        raise UserError(f"--model {name}: {str(e).splitlines()[0]}") from None
    unique = {id(t): t for t in model.parameters()}.values()
    largest = max(sum(t.numel() for t in m.parameters(recurse=False)) for m in model.modules())
    size = ModelSize(parameters=sum(t.numel() for t in unique), largest_layer=largest)
    return ModelInfo(name, objective_of(config), config, shape, size)


def dropout_flags(config: Any) -> tuple[bool, bool]:
    """(hidden dropout on, attention dropout on) from the usual config field names."""
    hidden = max(getattr(config, k, 0.0) or 0.0 for k in
                 ("hidden_dropout_prob", "resid_pdrop", "embd_pdrop", "hidden_dropout"))
    attn = max(getattr(config, k, 0.0) or 0.0 for k in
               ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout"))
    return hidden > 0, attn > 0


def zero_setups(hidden: int) -> list[ZeroSetup]:
    """ZeRO 0-3 and 3 + offload, with the buffer sizes of this repo's ds_configs/*.json."""
    from app.runtime.ds_config import load_ds_config, zero_config_path

    out = []
    for stem, offload in SETUPS:
        path = zero_config_path(0).with_name(f"{stem}.json")
        out.append(setup_from_ds(load_ds_config(path), hidden, path, offload))
    return out


def setup_from_ds(ds: dict[str, Any], hidden: int, where: Any,
                  offload: bool | None = None) -> ZeroSetup:
    """The ZeroSetup a DeepSpeed config describes (its "auto" sizes filled as `app train` does)."""
    zero = setup_ds(ds, "bf16", where, hidden).get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    if offload is None:
        offload = stage == 3 and _offloaded(zero.get("offload_param"))
    default = ZeroSetup(stage)
    return ZeroSetup(stage=stage, offload=offload,
                     reduce_bucket=int(zero.get("reduce_bucket_size", default.reduce_bucket)),
                     allgather_bucket=int(zero.get("allgather_bucket_size",
                                                   default.allgather_bucket)),
                     overlap_comm=bool(zero.get("overlap_comm", False)),
                     max_live_parameters=int(zero.get("stage3_max_live_parameters",
                                                      default.max_live_parameters)),
                     prefetch_bucket=int(zero.get("stage3_prefetch_bucket_size",
                                                  default.prefetch_bucket)))


def _offloaded(section: Any) -> bool:
    return isinstance(section, dict) and section.get("device", "none") not in ("none", None)


def setup_ds(ds: dict[str, Any], precision: str, where: Any,
             hidden: int | None = None) -> dict[str, Any]:
    """`ds` with its "auto" fields filled as `app train` fills them for `precision`."""
    from app.runtime.ds_config import fill_auto

    kwargs = dict(micro_batch=1, grad_accum=1, world_size=1, precision=precision, lr=1e-3,
                  betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, pin_memory=False, where=where)
    if hidden and "hidden_size" in inspect.signature(fill_auto).parameters:
        kwargs["hidden_size"] = hidden  # sizes "auto" from the width
    return fill_auto(ds, **kwargs)
