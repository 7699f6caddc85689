"""The request on the network model (app.plan.network): the link from --interconnect,
--net-gbps and --net-latency-us, the gradient reduction dtype `app train` gives DeepSpeed, one
optimizer step's compute (measured or FLOPs at the MFU), and a ZeRO stage's collectives at a micro
batch and accumulation as a `network.Job`, with the model's backward layout (when each gradient is
final) read on the meta device.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

from app.plan import network
from app.plan.inputs import ModelInfo, setup_ds
from app.plan.memory import ZeroSetup
from app.plan.request import PlanRequest


@dataclass(frozen=True)
class NetworkSetup:
    """The network the plan is for: the flags resolved against the presets."""

    link: network.Link
    nodes: int
    """The network section's largest node count (the scaling goes 1, 2, 4 ... nodes)."""
    interconnect: str | None
    """The preset the bandwidth or latency came from (None: both given by flags)."""
    assumed: bool
    """No --interconnect nor --net-gbps: the default preset."""


def network_setup(req: PlanRequest, accelerator: str | None) -> NetworkSetup:
    """Bandwidth and latency from --interconnect, --net-gbps, --net-latency-us; a bare --net-gbps
    takes the latency of the preset nearest in bandwidth; intra-node from the accelerator."""
    preset = network.INTERCONNECTS[req.interconnect or network.DEFAULT_INTERCONNECT]
    if req.net_gbps is not None and req.interconnect is None:
        preset = network.nearest_interconnect(req.net_gbps)
    intra_gbps, intra_us = network.intra_default(accelerator)
    link = network.Link(inter_gbps=req.net_gbps or preset.gbps,
                        inter_latency_us=(preset.latency_us if req.net_latency_us is None
                                          else req.net_latency_us),
                        intra_gbps=req.intra_gbps or intra_gbps, intra_latency_us=intra_us)
    named = (req.interconnect is not None or req.net_gbps is None
             or req.net_latency_us is None)
    return NetworkSetup(link, req.network_nodes, preset.name if named else None,
                        req.interconnect is None and req.net_gbps is None)


def app_comm_dtype(stage: int, precision: str) -> str:
    """The gradient reduction dtype `app train` gives DeepSpeed at `stage`: the train flag's
    default where it has one, else `communication_data_type` of the filled ds_config, else
    DeepSpeed's default (the run's precision)."""
    from app.config import add_arguments as train_arguments
    from app.runtime.ds_config import load_ds_config, zero_config_path

    parser = argparse.ArgumentParser(add_help=False)
    train_arguments(parser)
    flag = parser.get_default("grad_comm_dtype")
    if precision != "fp32" and flag in network.DTYPE_BYTES:
        return flag
    ds = setup_ds(load_ds_config(zero_config_path(stage)), precision, zero_config_path(stage))
    given = str(ds.get("communication_data_type") or precision).lower()
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp": "fp32"}.get(
        given, given if given in network.DTYPE_BYTES else precision)


def compute_ms(req: PlanRequest, micro: int, grad_accum: int, peak: float | None,
               fpt: float) -> float | None:
    """One optimizer step's compute on one device: --compute-ms scaled by samples per device
    from the micro batch and accumulation it was measured at (its --step-ms part as it is: once
    a step), else FLOPs at the assumed MFU."""
    if req.compute_ms is not None:
        step = req.step_ms or 0.0
        return step + (req.compute_ms - step) * samples_ratio(req, micro, grad_accum)
    if peak is None:
        return None
    return 1000 * micro * grad_accum * req.seq_len * fpt / (req.mfu * peak * 1e12)


def samples_ratio(req: PlanRequest, micro: int, grad_accum: int) -> float:
    """Samples per device per step against those --compute-ms was measured at."""
    return (micro * grad_accum) / (req.micro_batch * req.grad_accum)


def forward_ms(req: PlanRequest, micro: int, grad_accum: int) -> float | None:
    """All micro steps' forward passes at a micro batch and accumulation, from --forward-ms
    (per micro step at --micro-batch); None where not measured."""
    if req.forward_ms is None:
        return None
    return req.forward_ms * req.grad_accum * samples_ratio(req, micro, grad_accum)


def cpu_ms_per_mb(req: PlanRequest) -> float:
    """--net-cpu-ms-per-mb, else gloo's measured cost on one core (CPU runs), else 0 (GPUs)."""
    if req.net_cpu_ms_per_mb is not None:
        return req.net_cpu_ms_per_mb
    return network.GLOO_CPU_MS_PER_MB if req.device_kind == "cpu" else 0.0


def network_job(req: PlanRequest, info: ModelInfo, setup: ZeroSetup, net: NetworkSetup,
                micro: int, grad_accum: int, compute: float | None,
                comm_dtype: str) -> network.Job:
    """The stage's collectives at a micro batch and accumulation (compute 1 ms when unknown:
    the communication itself does not depend on it)."""
    p = info.size.parameters
    return network.Job(
        stage=setup.stage, params=p, per_node=req.per_node,
        link=replace(net.link, cpu_ms_per_mb=cpu_ms_per_mb(req)),
        layout=backward_layout(info, req.mask_prob),
        compute_ms=compute or 1.0, grad_accum=grad_accum, precision=req.precision,
        comm_dtype=comm_dtype, backward_fraction=req.overlap_fraction, device=req.device_kind,
        step_ms=(req.step_ms or 0.0) if compute else 0.0,
        forward_ms=forward_ms(req, micro, grad_accum) if compute else None,
        buckets={"reduce_bucket": setup.reduce_bucket, "allgather_bucket": setup.allgather_bucket,
                 "prefetch_bucket": setup.prefetch_bucket,
                 "allreduce_bucket": setup.allreduce_bucket},
        zero3_gathers=1 if p <= setup.max_live_parameters else 2)


_LAYOUTS: dict[tuple[int, float], tuple[Any, tuple[network.Grad, ...]]] = {}


def backward_layout(info: ModelInfo, mask_prob: float) -> tuple[network.Grad, ...]:
    """The trainable parameters in backward order (the reducer's), each with the share of
    backward's work done when its gradient is final and the share of forward's done before its
    first use. Work: a matrix's elements where a matmul uses it (an embedding lookup: none), the
    tied MLM decoder on the masked share of tokens only (the sparse head); a weight used twice
    (tied) is final after its last use in backward, the input embedding, at the very end."""
    # by the config object, which the entry holds so that its id() is not reused (a tune search
    # describes many models in one process); the plan's search asks once an option
    key = (id(info.config), mask_prob)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = (info.config, _layout(info, mask_prob))
    return _LAYOUTS[key][1]


def _layout(info: ModelInfo, mask_prob: float) -> tuple[network.Grad, ...]:
    import torch

    from app.models.build import build_model

    with torch.device("meta"):
        model = build_model(info.config)
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    uses = []  # (param, work) in forward order, a tied weight once per module using it
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.requires_grad and p.numel() > 0:
                matmul = p.dim() >= 2 and not isinstance(module, torch.nn.Embedding)
                share = mask_prob if id(p) in lookups and info.objective == "mlm" else 1.0
                uses.append((p, p.numel() * share if matmul else 0.0))
    total = sum(w for _, w in uses) or 1.0
    needed, ready, done = {}, {}, 0.0
    for p, w in uses:
        needed.setdefault(id(p), done / total)
        done += w
    done = 0.0
    for p, w in reversed(uses):
        done += w
        ready[id(p)] = done / total  # the last use in backward wins
    params = [p for p in model.parameters() if p.requires_grad and p.numel() > 0]
    return tuple(network.Grad(p.numel(), ready[id(p)], needed[id(p)]) for p in reversed(params))
