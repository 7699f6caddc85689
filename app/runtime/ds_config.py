"""The DeepSpeed config: the one owner of ZeRO stage, precision and clipping.

A ds_config file (ds_configs/zero{0,1,2,3}.json or --ds-config) is read and checked here; the
app fills its "auto" fields from the run's flags (`fill_auto`) and checks the result through
DeepSpeed's own config model (`validate_ds_config`) before any process group exists. After
`deepspeed.initialize`, batch sizes are read back from the engine, not kept here.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from app.runtime.device import Device, resolve_precision
from data_tools.errors import UserError
from data_tools.manifest import read_json

CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"


def zero_config_path(stage: int) -> Path:
    return CONFIG_DIR / f"zero{stage}.json"


def load_ds_config(path: Path) -> dict[str, Any]:
    """Read a DeepSpeed JSON config; UserError naming the file (and line) when it is unusable."""
    ds = read_json(path, missing=f"--ds-config {path}: no such file")
    if not isinstance(ds, dict):
        raise UserError(f"{path}: expected a JSON object")
    zero = ds.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise UserError(f"{path}: key 'zero_optimization' must be an object")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise UserError(f"{path}: key 'zero_optimization.stage' is {stage!r}; ZeRO stages are "
                        f"0, 1, 2 and 3")
    return ds


def _enabled(ds: dict[str, Any], key: str) -> Any:
    section = ds.get(key)
    return section.get("enabled", False) if isinstance(section, dict) else False


def settle_precision(ds: dict[str, Any], requested: str, device: Device, where: Path) -> str:
    """The run's precision: the ds_config's when it fixes one, else --precision resolved.

    A file that sets bf16/fp16 explicitly owns the knob; --precision may then only agree.
    """
    fixed = [name for name in ("bf16", "fp16") if _enabled(ds, name) is True]
    if len(fixed) > 1:
        raise UserError(f"{where}: both 'bf16.enabled' and 'fp16.enabled' are true")
    if fixed:
        if requested not in ("auto", fixed[0]):
            raise UserError(f"--precision {requested}: {where} sets '{fixed[0]}.enabled': true")
        return resolve_precision(fixed[0], device)
    resolved = resolve_precision(requested, device)
    if resolved != "fp32" and _enabled(ds, resolved) is False and resolved in ds:
        # the file turns this precision off explicitly: it owns the knob
        if requested == "auto":
            return "fp32"
        raise UserError(f"--precision {requested}: {where} sets '{resolved}.enabled': false")
    return resolved


# DeepSpeed-scale sizes for the "auto" ZeRO knobs (elements), not Hugging Face's hidden^2 (1.2 M
# at width 768: hundreds of latency-bound collectives a step on 128 GPUs). 5e7 is DeepSpeed's own
# stage-3 prefetch default and a tenth of its reduce-bucket default: few collectives, each large
# enough to run at full bandwidth, with a bucket of 200 MB in fp32.
ZERO_SIZES = {"reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000,
              "stage3_prefetch_bucket_size": 50_000_000,
              "stage3_param_persistence_threshold": 100_000}
# ZeRO-3 keeps parameters below the persistence threshold whole on every rank (no gather for
# them). Given the model's width, "auto" is 10 x hidden, as Hugging Face fills it: biases and
# LayerNorm weights stay whole, every matrix is partitioned. DeepSpeed's fixed 1e5 keeps every
# matrix of a width-128 model whole (bert-tiny: ZeRO-3 at 2 ranks then held 0.62x ZeRO-0's model
# state, not ~0.5x; docs/benchmarks.md, "bench").
PERSISTENCE_PER_HIDDEN = 10


def fill_auto(ds: dict[str, Any], *, micro_batch: int, grad_accum: int, world_size: int,
              precision: str, lr: float, betas: tuple[float, float], eps: float,
              weight_decay: float, pin_memory: bool, where: Path,
              torch_adam: bool = False, hidden_size: int | None = None) -> dict[str, Any]:
    """A copy of `ds` with every "auto" field set; UserError for an "auto" the app cannot fill.
    `torch_adam` (Device.torch_adam) picks torch's AdamW over DeepSpeed's compiled one unless the
    config says which, or offloads the optimizer (DeepSpeed's CPU Adam then). `hidden_size`, the
    model's width, sizes the ZeRO-3 persistence threshold (PERSISTENCE_PER_HIDDEN)."""
    ds = copy.deepcopy(ds)
    batch = {"train_micro_batch_size_per_gpu": micro_batch,
             "gradient_accumulation_steps": grad_accum,
             "train_batch_size": micro_batch * grad_accum * world_size}
    for key, value in batch.items():
        if ds.get(key, "auto") == "auto":
            ds[key] = value
        elif ds[key] != value:
            raise UserError(f"{where}: key '{key}' is {ds[key]} but the flags give {value} "
                            f"(set it to \"auto\" or drop the flag)")
    if ds.get("gradient_clipping") == "auto":
        ds["gradient_clipping"] = 1.0
    _fill_optimizer(ds, {"lr": lr, "betas": list(betas), "eps": eps,
                         "weight_decay": weight_decay})
    _fill_precision(ds, precision)
    zero = ds.setdefault("zero_optimization", {"stage": 0})
    opt = ds["optimizer"]
    offloaded = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    if (torch_adam and isinstance(opt, dict) and not offloaded
            and str(opt.get("type", "")).lower() in ("adam", "adamw")):
        opt["params"].setdefault("torch_adam", True)
    sizes = dict(ZERO_SIZES)
    if hidden_size:
        sizes["stage3_param_persistence_threshold"] = PERSISTENCE_PER_HIDDEN * hidden_size
    for key, value in sizes.items():
        if zero.get(key) == "auto":
            zero[key] = value
    for key in ("offload_optimizer", "offload_param"):
        if isinstance(zero.get(key), dict) and zero[key].get("pin_memory") == "auto":
            zero[key]["pin_memory"] = pin_memory
    left = _auto_paths(ds)
    if left:
        raise UserError(f"{where}: key '{left[0]}' is \"auto\" and the app does not fill it")
    return ds


def _fill_optimizer(ds: dict[str, Any], settings: dict[str, Any]) -> None:
    opt = ds.get("optimizer")
    if opt is None:  # no optimizer block (common in HF-style configs): DeepSpeed would build none
        ds["optimizer"] = {"type": "AdamW", "params": dict(settings)}
    elif isinstance(opt, dict):
        params = opt.setdefault("params", {})
        for key, value in settings.items():
            if params.get(key, "auto") == "auto":
                params[key] = value


def _fill_precision(ds: dict[str, Any], precision: str) -> None:
    """Enable the run's precision; bf16 accumulates gradients in fp32 where DeepSpeed allows it
    (ZeRO 1-3; at ZeRO-0 it refuses the mix and accumulates and all-reduces them in bf16)."""
    for name in ("bf16", "fp16"):
        section = ds.get(name)
        if isinstance(section, dict) and section.get("enabled") == "auto":
            section["enabled"] = precision == name
    if precision in ("bf16", "fp16") and not isinstance(ds.get(precision), dict):
        ds[precision] = {"enabled": True}  # a file without the section runs what we report
    if precision == "bf16" and zero_stage(ds) >= 1 and "data_types" not in ds:
        ds["data_types"] = {"grad_accum_dtype": "fp32"}


class _ReadKeys(dict):
    """A dict that notes which keys were looked up: DeepSpeed reads its top-level keys with
    .get and ignores the rest, so a key it never looked up is one it does not know."""

    def __init__(self, data: dict[str, Any]):
        super().__init__(data)
        self.read: set[str] = set()

    def get(self, key, *default):
        self.read.add(key)
        return super().get(key, *default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)


def _pydantic_key(ds: dict[str, Any], error) -> str:
    """'zero_optimization.bogus_key' from a DeepSpeed section model's validation error."""
    loc = ".".join(str(p) for p in error["loc"])
    first = str(error["loc"][0]) if error["loc"] else ""
    for key, section in ds.items():
        if isinstance(section, dict) and first in section:
            return f"{key}.{loc}"
    return loc


def validate_ds_config(ds: dict[str, Any], where: Path) -> list[str]:
    """Check a filled config through DeepSpeed's own config model, before any process group.

    What DeepSpeed refuses becomes one UserError naming the key; returns warnings for top-level
    keys DeepSpeed does not know (it ignores them silently: usually a typo).
    """
    import difflib
    import logging

    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS, DeepSpeedConfig
    from deepspeed.utils import logger
    from pydantic import ValidationError

    probe = _ReadKeys(copy.deepcopy(ds))
    # DeepSpeed checks the batch sizes against the current world, which is one rank here
    probe["train_batch_size"] = (probe["train_micro_batch_size_per_gpu"]
                                 * probe["gradient_accumulation_steps"])
    level = logger.level
    logger.setLevel(logging.WARNING)  # its config parsing logs at info on every rank
    try:
        DeepSpeedConfig(probe)
    except ValidationError as e:
        err = e.errors()[0]
        raise UserError(f"{where}: key '{_pydantic_key(ds, err)}': {err['msg']} (DeepSpeed's "
                        f"config check)") from None
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        raise UserError(f"{where}: DeepSpeed refuses this config: {e}") from None
    finally:
        logger.setLevel(level)
    opt = ds.get("optimizer", {}).get("type", "")
    if opt.lower() not in DEEPSPEED_OPTIMIZERS and not hasattr(torch.optim, opt):
        raise UserError(f"{where}: key 'optimizer.type' is {opt!r}: neither a DeepSpeed optimizer "
                        f"({', '.join(DEEPSPEED_OPTIMIZERS)}) nor one of torch.optim")
    clip = ds.get("gradient_clipping", 0.0)
    if not isinstance(clip, (int, float)) or isinstance(clip, bool) or clip < 0:
        raise UserError(f"{where}: key 'gradient_clipping' is {clip!r}: expected a number >= 0")
    warnings = []
    for key in sorted(set(ds) - probe.read):
        close = difflib.get_close_matches(key, sorted(probe.read), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        warnings.append(f"{where}: key '{key}' is not a DeepSpeed setting and is ignored{hint}")
    return warnings


def _auto_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _auto_paths(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if node == "auto" else []


def zero_stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))
