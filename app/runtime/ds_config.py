"""The DeepSpeed config: the one owner of ZeRO stage, precision and clipping.

A ds_config file (ds_configs/zero{0,1,2,3}.json or --ds-config) is read and checked here; the
app fills its "auto" fields from the run's flags (`fill_auto`) and checks the result through
DeepSpeed's own config model (`validate_ds_config`) before any process group exists. After
`deepspeed.initialize`, batch sizes are read back from the engine, not kept here.
"""
from __future__ import annotations

import copy
import math
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
    """Read a DeepSpeed JSON config; UserError naming the file (and line, and key) when it is
    unusable: every value is type-checked here, before it decides anything (check_types)."""
    ds = read_json(path, missing=f"--ds-config {path}: no such file")
    if not isinstance(ds, dict):
        raise UserError(f"{path}: expected a JSON object")
    zero = ds.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise UserError(f"{path}: key 'zero_optimization' must be an object")
    stage = zero.get("stage", 0)
    if type(stage) is not int or stage not in (0, 1, 2, 3):  # not true, nor 1.0
        raise UserError(f"{path}: key 'zero_optimization.stage' is {stage!r}; ZeRO stages are "
                        f"0, 1, 2 and 3")
    check_types(ds, path)
    return ds


# The app owns the LR schedule (--lr, --warmup-steps, --lr-decay, --min-lr-ratio: app/schedule.py);
# DeepSpeed would run a file's scheduler instead, while config.json recorded ours.
OWNED_SECTIONS = {"scheduler": "the LR schedule is the app's (--lr, --warmup-steps, --lr-decay, "
                               "--min-lr-ratio); remove the section"}
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
               "gradient_accumulation_steps")


def check_types(ds: dict[str, Any], where: Path) -> None:
    """Every value of the config has the type DeepSpeed's own model declares for it, exactly:
    DeepSpeed coerces ("true" runs bf16 while our reading of the file said fp32; "8" is a batch
    size), so a quoted number or boolean is refused here, naming the key. "auto" passes (filled
    later from the flags)."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    for key, why in OWNED_SECTIONS.items():
        if key in ds:
            raise UserError(f"{where}: key '{key}': {why}")
    for key in _BATCH_KEYS + ("steps_per_print",):
        if key in ds and ds[key] != "auto" and not _is_int(ds[key]):
            raise UserError(f"{where}: key '{key}' is {ds[key]!r}: expected a whole number or "
                            f"\"auto\"")
    clip = ds.get("gradient_clipping", 0.0)
    if clip != "auto" and not _is_number(clip):
        raise UserError(f"{where}: key 'gradient_clipping' is {clip!r}: expected a number or "
                        f"\"auto\"")
    for key, model in (("zero_optimization", DeepSpeedZeroConfig),
                       ("bf16", DeepSpeedBF16Config), ("fp16", DeepSpeedFP16Config)):
        if key in ds:
            if not isinstance(ds[key], dict):
                raise UserError(f"{where}: key '{key}' must be an object")
            _check_section(model, ds[key], key, where)
    _check_optimizer_shape(ds.get("optimizer"), where)


def _is_int(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or \
        (isinstance(value, float) and value.is_integer())  # 5e8, as configs often write it


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_CHECKS = {bool: (lambda v: isinstance(v, bool), "true or false (a JSON boolean, no quotes)"),
           int: (_is_int, "a whole number (no quotes)"),
           float: (_is_number, "a number (no quotes)")}


def _check_section(model, section: dict[str, Any], prefix: str, where: Path) -> None:
    """The scalar fields of one DeepSpeed pydantic section model, recursing into sub-models."""
    import typing

    from pydantic import BaseModel

    by_name = {}
    for name, info in model.model_fields.items():
        by_name[name] = info
        if info.alias:
            by_name[info.alias] = info
    for key, value in section.items():
        info = by_name.get(key)
        if info is None or value == "auto":
            continue  # an unknown key is DeepSpeed's own check (validate_ds_config)
        kinds = list(typing.get_args(info.annotation) or (info.annotation,))
        if value is None and type(None) in kinds:
            continue
        kinds = [k for k in kinds if k is not type(None)]
        if len(kinds) == 1 and isinstance(kinds[0], type) and issubclass(kinds[0], BaseModel) \
                and isinstance(value, dict):
            _check_section(kinds[0], value, f"{prefix}.{key}", where)
        elif len(kinds) == 1 and kinds[0] in _CHECKS and not _CHECKS[kinds[0]][0](value):
            raise UserError(f"{where}: key '{prefix}.{key}' is {value!r}: expected "
                            f"{_CHECKS[kinds[0]][1]}")


def _check_optimizer_shape(opt: Any, where: Path) -> None:
    if opt is None:
        return
    if not isinstance(opt, dict):
        raise UserError(f"{where}: key 'optimizer' must be an object")
    if not isinstance(opt.get("type"), str):
        raise UserError(f"{where}: key 'optimizer.type' is {opt.get('type')!r}: expected the "
                        f"optimizer's name (e.g. \"AdamW\")")
    if not isinstance(opt.get("params", {}), dict):
        raise UserError(f"{where}: key 'optimizer.params' must be an object")


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
              torch_adam: bool = False, hidden_size: int | None = None,
              grad_comm_dtype: str | None = None,
              torch_adam_fused: bool = False) -> dict[str, Any]:
    """A copy of `ds` with every "auto" field set; UserError for an "auto" the app cannot fill.
    `torch_adam` (Device.torch_adam) picks torch's AdamW over DeepSpeed's compiled one unless the
    config says which, or offloads the optimizer (DeepSpeed's CPU Adam then); with
    `torch_adam_fused` (Device.torch_adam_fused) torch's fused one. `hidden_size`, the
    model's width, sizes the ZeRO-3 persistence threshold (PERSISTENCE_PER_HIDDEN).
    `grad_comm_dtype` (--grad-comm-dtype) sets communication_data_type (`_fill_comm_dtype`)."""
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
                         "weight_decay": weight_decay}, where)
    _fill_precision(ds, precision)
    _fill_sync_free(ds, precision)
    _fill_comm_dtype(ds, precision, grad_comm_dtype, where)
    zero = ds.setdefault("zero_optimization", {"stage": 0})
    opt = ds["optimizer"]
    offloaded = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    if (torch_adam and isinstance(opt, dict) and not offloaded
            and str(opt.get("type", "")).lower() in ("adam", "adamw")):
        params = opt["params"]
        params.setdefault("torch_adam", True)
        if torch_adam_fused and params["torch_adam"] is True and not params.get("foreach"):
            # DeepSpeed pops torch_adam and hands the rest to torch.optim.AdamW: fused=True
            # is its one-kernel CUDA update (no JIT build, its step a device tensor)
            params.setdefault("fused", True)
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


# What the flags set, by optimizer: the settings each of DeepSpeed's own optimizers takes
# (torch.optim's are read from their signature).
FLAG_OF = {"lr": "--lr", "betas": "--beta1/--beta2", "eps": "--eps",
           "weight_decay": "--weight-decay"}
_DEEPSPEED_TAKES = {"adam": set(FLAG_OF), "adamw": set(FLAG_OF), "lamb": set(FLAG_OF),
                    "muadam": set(FLAG_OF), "muadamw": set(FLAG_OF),
                    "lion": {"lr", "betas", "weight_decay"},
                    "adagrad": {"lr", "eps", "weight_decay"},
                    "musgd": {"lr", "weight_decay"}, "muon": {"lr", "weight_decay"}}


def optimizer_takes(name: str) -> set[str] | None:
    """The parameter names optimizer `name` takes (None: not known, not checked)."""
    import inspect

    if name.lower() in _DEEPSPEED_TAKES:
        return None  # DeepSpeed's own: many extra settings of their own
    cls = getattr(torch.optim, name, None)
    if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
        return None
    return {p for p in inspect.signature(cls).parameters if p not in ("self", "params")}


def _fill_optimizer(ds: dict[str, Any], settings: dict[str, Any], where: Path) -> None:
    """Fill the optimizer's "auto" settings from the flags, only those it takes; a number in the
    file for a setting a flag also sets must agree with it (config.json records the flags: a
    file's other value would be what runs)."""
    opt = ds.get("optimizer")
    if opt is None:  # no optimizer block (common in HF-style configs): DeepSpeed would build none
        ds["optimizer"] = {"type": "AdamW", "params": dict(settings)}
        return
    name = opt["type"]
    params = opt.setdefault("params", {})
    takes = optimizer_takes(name)
    fills = _DEEPSPEED_TAKES.get(name.lower(), set(FLAG_OF) & (takes or set()))
    if takes is not None:
        for key in params:
            if key not in takes:
                raise UserError(f"{where}: key 'optimizer.params.{key}': torch.optim.{name} "
                                f"takes no '{key}' (it takes {', '.join(sorted(takes))})")
    for key, value in settings.items():
        if key not in fills:
            continue
        if params.get(key, "auto") == "auto":
            params[key] = value
        elif _differs(params[key], value):
            raise UserError(f"{where}: key 'optimizer.params.{key}' is {params[key]!r} but "
                            f"{FLAG_OF[key]} gives {value!r} (set it to \"auto\" or pass the "
                            f"same value to {FLAG_OF[key]})")


def _differs(given: Any, flags: Any) -> bool:
    if isinstance(flags, list):
        return not (isinstance(given, list) and len(given) == len(flags)
                    and not any(_differs(g, f) for g, f in zip(given, flags)))
    return not _is_number(given) or not math.isclose(given, flags, rel_tol=1e-9, abs_tol=0.0)


def _fill_precision(ds: dict[str, Any], precision: str) -> None:
    """Enable the run's precision; bf16 accumulates gradients in fp32 where DeepSpeed allows it
    (ZeRO 1-3; at ZeRO-0 it refuses the mix and accumulates them in bf16), at ZeRO-1 during
    backward (`immediate_grad_update`)."""
    for name in ("bf16", "fp16"):
        section = ds.get(name)
        if isinstance(section, dict) and section.get("enabled") == "auto":
            section["enabled"] = precision == name
    if precision in ("bf16", "fp16") and not isinstance(ds.get(precision), dict):
        ds[precision] = {"enabled": True}  # a file without the section runs what we report
    if precision == "bf16" and zero_stage(ds) >= 1 and "data_types" not in ds:
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    if precision == "bf16" and zero_stage(ds) == 1 and isinstance(ds.get("bf16"), dict):
        # BF16_Optimizer adds each bf16 gradient to its fp32 buffer in the gradient's hook,
        # during backward, so the app's reducer can send it from there (app.runtime.overlap)
        ds["bf16"].setdefault("immediate_grad_update", True)


def _fill_sync_free(ds: dict[str, Any], precision: str) -> None:
    """No host sync in a step (docs/gpu.md): what a file does not set itself. DeepSpeed's
    throughput timer (on by default) synchronises the device at every forward and every step for
    a figure the app measures itself (ComputeClock): off. In bf16 at ZeRO-2, the one stage whose
    optimizer reads it, DeepSpeed's per-step overflow check (a host read of an all-reduced flag)
    is off: the app's LossMonitor marks a non-finite loss on the device and the anomaly policy
    acts on it (app.runtime.patches, `sync_free_steps`, which honours a file's
    `"check_grad_overflow": true`). fp16 keeps its check: the dynamic loss scale skips steps on
    it."""
    if "timers" not in ds:
        ds["timers"] = {"throughput": {"enabled": False}}
    if precision == "bf16" and zero_stage(ds) == 2 and isinstance(ds.get("bf16"), dict):
        ds["bf16"].setdefault("check_grad_overflow", False)


def _fill_comm_dtype(ds: dict[str, Any], precision: str, flag: str | None, where: Path) -> None:
    """The dtype gradients are summed in across ranks: --grad-comm-dtype, else the file's
    communication_data_type, else fp32 (DeepSpeed's own default is the weights' dtype: bf16
    gradients summed in bf16; docs/gpu.md). fp16 runs keep DeepSpeed's fp16 unless the flag says
    otherwise."""
    given = ds.get("communication_data_type")
    if given is not None and given != "auto" and flag is not None and given != flag:
        raise UserError(f"{where}: key 'communication_data_type' is {given!r} but "
                        f"--grad-comm-dtype gives {flag!r} (drop one, or make them agree)")
    if flag is not None:
        ds["communication_data_type"] = flag
    elif given == "auto" or (given is None and precision != "fp16"):
        ds["communication_data_type"] = "fp16" if precision == "fp16" else "fp32"


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
    # DeepSpeed checks the batch sizes against the current world: one rank before the process
    # group exists (a run's plan), the group's once it does (a second run in one process)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    probe["train_batch_size"] = (probe["train_micro_batch_size_per_gpu"]
                                 * probe["gradient_accumulation_steps"] * world)
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
    torch_opt = getattr(torch.optim, opt, None)
    if opt.lower() not in DEEPSPEED_OPTIMIZERS and not (
            isinstance(torch_opt, type) and issubclass(torch_opt, torch.optim.Optimizer)):
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
