"""A plan's outputs: the terminal tables (`render`: per ZeRO stage, the network, each mode's best),
the JSON of `app plan --json` (`to_json`) and the PNG of `--plot` (`write_plot`: the predicted
scaling efficiency against nodes, never over a file plan did not write).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from app.plan import network
from app.plan.jobs import cpu_ms_per_mb
from app.plan.memory import MiB
from app.plan.planner import Plan, StageNetwork, gb
from data_tools import output
from data_tools.errors import UserError


def _duration(days: float) -> str:
    if days >= 1:
        return f"{days:,.1f} d"
    hours = days * 24
    return f"{hours:.1f} h" if hours >= 1 else f"{hours * 60:.1f} min"


def to_json(plan: Plan) -> dict[str, Any]:
    """The plan as JSON-able data (bytes as integers, per device unless named otherwise)."""
    req, info, choice = plan.request, plan.info, plan.choice
    stages = []
    for i, s in enumerate(plan.stages):
        m = s.memory
        stages.append({
            "zero": m.setup.label, "zero_stage": m.setup.stage, "offload": m.setup.offload,
            "parameters_bytes": m.parameters, "gradients_bytes": m.gradients,
            "optimizer_states_bytes": m.optimizer, "buffers_bytes": m.buffers,
            "activations_bytes": m.activations,
            "activations_per_sample_bytes": m.activations_per_sample,
            "activations_per_sample_checkpointed_bytes": m.activations_per_sample_ckpt,
            "transient_bytes": m.transient, "fragmentation_bytes": m.fragmentation,
            "runtime_bytes": m.runtime, "total_bytes": m.total,
            "host_per_node_bytes": m.host_per_node, "fits": s.fits,
            "max_micro_batch": s.max_micro_batch, "micro_batch": s.micro_batch,
            "global_batch": s.global_batch, "tokens_per_sec": s.tokens_per_sec,
            "step_time_s": s.step_time_s, "days": s.days, "cost": s.cost,
            "recommended": i == plan.pick, "network": _network_json(plan.networks[i])})
    pick = plan.stages[plan.pick].memory.setup.label if plan.pick is not None else None
    return {
        "model": {"preset": req.model, "objective": info.objective, "model_type":
                  info.shape.model_type, "parameters": info.size.parameters,
                  "largest_layer_parameters": info.size.largest_layer,
                  "hidden": info.shape.hidden, "layers": info.shape.layers,
                  "heads": info.shape.heads, "vocab": info.shape.vocab,
                  "flops_per_token": plan.flops_per_token},
        "inputs": {"seq_len": req.seq_len, "micro_batch": req.micro_batch,
                   "grad_accum": req.grad_accum, "precision": req.precision,
                   "gradient_checkpointing": req.checkpointing, "optimizer": req.optimizer,
                   "gpus": req.gpus, "gpus_per_node": req.per_node,
                   "accelerator": plan.accelerator, "memory_per_device_bytes": plan.budget,
                   "peak_tflops": plan.peak_tflops, "mfu": req.mfu, "tokens": plan.tokens,
                   "price_per_gpu_hour": req.price_per_gpu_hour},
        "stages": stages,
        "recommendation": {"zero": pick, "reason": plan.reason},
        "network": {"interconnect": plan.net.interconnect, "assumed": plan.net.assumed,
                    "net_gbps": plan.net.link.inter_gbps,
                    "net_latency_us": plan.net.link.inter_latency_us,
                    "intra_gbps": plan.net.link.intra_gbps,
                    "intra_latency_us": plan.net.link.intra_latency_us,
                    "nodes": plan.net.nodes, "gpus_per_node": req.per_node,
                    "compute_from": "measured" if req.compute_ms else "mfu",
                    "step_ms": req.step_ms, "forward_ms": req.forward_ms,
                    "overlap_fraction": req.overlap_fraction, "device_kind": req.device_kind,
                    "net_cpu_ms_per_mb": cpu_ms_per_mb(req),
                    "dp_mode": req.dp_mode, "outer_every": _table_every(plan),
                    "island_ranks": req.island, "outer_dtype": req.outer_dtype,
                    "min_outer_every": req.min_outer_every,
                    "max_outer_every": req.max_outer_every,
                    "max_global_batch_tokens": choice.bound if choice else None,
                    "target_efficiency": network.TARGET_EFFICIENCY,
                    "recommendation": plan.net_reason,
                    "pick": choice.pick.to_json(req) if choice and choice.pick else None,
                    "modes": [o.to_json(req) for o in choice.modes] if choice else []},
    }


def _table_every(plan: Plan) -> int | None:
    """The H the per-stage tables are for (None: synchronous)."""
    modes = [n.mode for n in plan.networks if n.mode is not None]
    return modes[0].outer_every if modes else None


def _network_json(n: StageNetwork) -> dict[str, Any]:
    """A stage's network figures at the largest node count (times in ms per optimizer step)."""
    at, last = n.at_nodes, (n.scaling[-1] if n.scaling else {})
    return {"path": network.path_of(n.job.stage, n.job.precision), "comm_dtype": n.comm_dtype,
            "comm_ms": at.comm_ms, "exposed_comm_ms": at.exposed_comm_ms if n.timed else None,
            "cpu_comm_ms": at.cpu_comm_ms,
            "step_ms": at.step_ms if n.timed else None,
            "compute_ms": at.compute_ms if n.timed else None,
            "tokens_per_sec": last.get("tokens_per_sec"), "efficiency": last.get("efficiency"),
            "node_bytes_per_step": n.node_bytes, "collectives": at.parts,
            "dp_mode": "diloco" if n.mode else "sync",
            "outer_every": n.mode.outer_every if n.mode else None,
            "outer_sync_ms": at.outer_ms if n.mode else None,
            "runs_in_train": n.mode.runs if n.mode else True,
            "scaling": n.scaling}


def render(plan: Plan) -> str:
    """The plan as a table for the terminal."""
    req, info = plan.request, plan.info
    nodes = math.ceil(req.gpus / req.per_node)
    peak = (f"MFU {req.mfu:.0%} of {plan.peak_tflops:,.1f} TFLOP/s"
            + (f" ({plan.accelerator})" if plan.accelerator else "") if plan.peak_tflops else
            "no peak TFLOP/s for time and cost (give --gpu NAME or --peak-tflops)")
    lines = [
        f"{req.model} ({info.objective}): {info.size.parameters / 1e6:,.1f}M parameters, vocab "
        f"{info.shape.vocab:,}, seq-len {req.seq_len}, {req.precision}, {req.optimizer}"
        f"{', activation checkpointing' if req.checkpointing else ''}",
        f"{req.gpus} device(s) ({nodes} node(s) x {req.per_node}), {gb(plan.budget)} GB each; "
        f"{plan.flops_per_token / 1e9:,.2f} GFLOP per token; {plan.tokens / 1e9:,.2f}B tokens"
        f"{' (20 per parameter)' if not req.tokens else ''}; {peak}",
        "",
    ]
    lines += aligned(_rows(plan))
    lines += ["", f"pick: {plan.reason}", ""] + render_network(plan)
    return "\n".join(lines)


def aligned(rows: list[tuple[str, list[str]]], cell: int | list[int] = 13) -> list[str]:
    """Table lines: the labels left-aligned, each column right-aligned in `cell` characters (one
    figure for every column, or one a column), wider where a cell needs it, so that no two
    columns run together at any size (a thousand nodes' tokens/s)."""
    width = max(len(label) for label, _ in rows)
    count = max(len(cells) for _, cells in rows)
    least = cell if isinstance(cell, list) else [cell] * count
    widths = [max([least[min(i, len(least) - 1)]] +
                  [len(cells[i]) + 2 for _, cells in rows if i < len(cells)])
              for i in range(count)]
    return [f"{label:<{width}}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths))
            for label, cells in rows]


def render_network(plan: Plan) -> list[str]:
    """The network section: per stage at the largest node count, and efficiency by node count."""
    req, net, link = plan.request, plan.net, plan.net.link
    source = (f"{net.interconnect} preset" if net.interconnect else "flags") + (
        ", assumed: give --interconnect or --net-gbps" if net.assumed else "")
    parts = "".join(f", {name} {value:g} ms" for name, value in (
        ("optimizer step", req.step_ms), ("forward per micro step", req.forward_ms))
        if value is not None)
    compute = (f"compute: measured {req.compute_ms:g} ms per step at micro batch "
               f"{req.micro_batch} x {req.grad_accum}{parts}" if req.compute_ms else
               "compute: FLOPs at the assumed MFU" if plan.peak_tflops else
               "compute: unknown (no peak TFLOP/s), so communication only")
    lines = [f"network: {link.inter_gbps:,g} Gb/s per node, {link.inter_latency_us:g} us per "
             f"ring step ({source}); {link.intra_gbps:,g} Gb/s between a node's devices; "
             f"{net.nodes} node(s) x {req.per_node}; {compute}"]
    every = _table_every(plan)
    if every is not None:
        lines.append(f"mode: diloco, islands of {req.island} rank(s) (ZeRO partitions over an "
                     f"island), an outer sync of the {req.outer_dtype} weights every {every} "
                     f"steps, blocking" + ("" if req.outer_every else ", H as recommended")
                     + "; app train runs it at ZeRO 0-2 in fp32 or bf16")
    lines += aligned(_network_rows(plan))
    why = plan.choice.lines if plan.choice else (plan.net_reason,)
    return lines + render_modes(plan) + ["", f"network pick: {why[0]}", *why[1:]]


def render_modes(plan: Plan) -> list[str]:
    """Each mode's fastest within the bound: synchronous per stage, diloco per H."""
    choice = plan.choice
    if choice is None or not choice.modes:
        return []
    req = plan.request
    default = "" if req.max_global_batch_tokens else (
        f" (the {plan.info.objective} default; --max-global-batch-tokens sets it)")
    head = ("mode", "ZeRO", "micro x accum", "step (ms)", "efficiency", "MB/node/step")
    rows = [head] + [(
        "sync" if o.dp_mode == "sync" else f"diloco H={o.outer_every}"
        + (" (below min)" if (o.outer_every or 0) < req.min_outer_every else
           " (above max)" if (o.outer_every or 0) > req.max_outer_every else ""),
        o.setup.label, f"{o.micro_batch} x {o.grad_accum}", f"{o.t.step_ms:,.1f}",
        f"{o.efficiency:.2f}", f"{o.node_bytes / MiB:,.1f}") for o in choice.modes]
    return ["", f"modes at {plan.net.nodes} node(s), each at its fastest batch within "
            f"{choice.bound:,} tokens a step{default}:"] + aligned(
        [(r[0], list(r[1:])) for r in rows], [8, 15])


def _network_rows(plan: Plan) -> list[tuple[str, list[str]]]:
    nets, n = plan.networks, plan.net.nodes

    def row(label: str, values: list[Any], fmt) -> tuple[str, list[str]]:
        return label, [("-" if v is None else fmt(v)) for v in values]

    def ms(v: float) -> str:
        return f"{v:,.1f}"

    timed = [x.timed for x in nets]
    every = _table_every(plan)
    rows = [
        (f"per optimizer step, {n} node(s)" + (f", diloco H={every}" if every else ""),
         [s.memory.setup.label.replace(" + offload", "+off") for s in plan.stages]),
        row("gradient comm dtype", [x.comm_dtype for x in nets], str),
        row("GB sent per node" + (" (mean)" if every else ""), [x.node_bytes for x in nets],
            gb),
        row("communication (ms)", [x.at_nodes.comm_ms for x in nets], ms),
    ] + ([row("outer sync, each (ms)", [x.at_nodes.outer_ms for x in nets], ms),
          row("app train runs it", [x.mode and x.mode.runs for x in nets],
              lambda v: "yes" if v else "no")]
         if every else []) + [
        row("exposed (ms)", [x.at_nodes.exposed_comm_ms if t else None
                             for x, t in zip(nets, timed)], ms),
        row("step time (ms)", [x.at_nodes.step_ms if t else None for x, t in zip(nets, timed)],
            ms),
        row("tokens/s", [x.scaling[-1]["tokens_per_sec"] if x.scaling else None for x in nets],
            lambda v: f"{v:,.0f}"),
    ]
    for i, count in enumerate(network.node_counts(n)):
        rows.append(row(f"efficiency, {count} node(s)",
                        [x.scaling[i]["efficiency"] if x.scaling else None for x in nets],
                        lambda v: f"{v:.2f}"))
    return rows


def _rows(plan: Plan) -> list[tuple[str, list[str]]]:
    st = plan.stages
    mem = [s.memory for s in st]

    def row(label: str, values: list[Any], fmt) -> tuple[str, list[str]]:
        return label, [("-" if v is None else fmt(v)) for v in values]

    micro = "micro batch" if plan.request.micro_batch else "largest micro batch"
    return [
        ("GB per device", [m.setup.label.replace(" + offload", "+off") for m in mem]),
        row("parameters", [m.parameters for m in mem], gb),
        row("gradients", [m.gradients for m in mem], gb),
        row("optimizer states", [m.optimizer for m in mem], gb),
        row("buffers (comm, ZeRO-3 gathered)", [m.buffers for m in mem], gb),
        row(f"activations ({micro})", [m.activations for m in mem], gb),
        row("  per sample", [m.activations_per_sample for m in mem], gb),
        row("  per sample, checkpointed", [m.activations_per_sample_ckpt for m in mem], gb),
        row("backward transient (LM head)", [m.transient for m in mem], gb),
        row("fragmentation allowance", [m.fragmentation for m in mem], gb),
        row("runtime (context, NCCL)", [m.runtime for m in mem], gb),
        row("total", [m.total for m in mem], gb),
        row("host memory per node", [m.host_per_node or None for m in mem], gb),
        row("largest micro batch", [s.max_micro_batch for s in st], lambda v: f"{v:,}"),
        row("global batch (samples)", [s.global_batch if s.fits else None for s in st],
            lambda v: f"{v:,}"),
        row("tokens/s (whole job)", [s.tokens_per_sec for s in st], lambda v: f"{v:,.0f}"),
        row("step time (s)", [s.step_time_s if s.fits else None for s in st],
            lambda v: f"{v:,.2f}"),
        row("time to train the tokens", [s.days for s in st], _duration),
        row("cost", [s.cost for s in st], lambda v: f"{v:,.0f}"),
    ]


PLOT_SOFTWARE = "dspretrain app plan"  # the PNG's Software text: what makes a plot plan's own


def plan_plot(path: Path) -> bool:
    """True when `path` is a PNG an earlier `app plan --plot` wrote (its Software text chunk,
    which comes before the image data)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"\x89PNG\r\n\x1a\n") and PLOT_SOFTWARE.encode() in head


def write_plot(plan: Plan, path: str) -> None:
    """The predicted scaling efficiency against nodes per stage (the paper's Figure 1), through
    the file gate of data_tools/output.py: never over a file plan did not write."""
    import io

    target = Path(path)
    output.claim_file(target, "--plot", ours=plan_plot, what="plot")
    try:
        import matplotlib
    except ImportError:
        raise UserError(f"--plot {path}: matplotlib is not installed") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    if not any(n.scaling for n in plan.networks):
        raise UserError(f"--plot {path}: no compute time to plot against (give --gpu NAME, "
                        f"--peak-tflops or --compute-ms)")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (stage, n) in enumerate(zip(plan.stages, plan.networks)):
        xs = [r["nodes"] for r in n.scaling]
        ax.plot(xs, [r["efficiency"] for r in n.scaling], "o--" if stage.memory.setup.offload
                else "o-", color=f"C{i}", label=stage.memory.setup.label)
    ax.axhline(1.0, color="gray", linestyle=":", label="ideal")
    link = plan.net.link
    every = _table_every(plan)
    ax.set_title(f"{plan.request.model}: predicted scaling efficiency, "
                 f"{link.inter_gbps:g} Gb/s per node" + (f", diloco H={every}" if every else ""))
    ax.set_xlabel(f"nodes ({plan.request.per_node} device(s) each)")
    ax.set_ylabel("efficiency (tokens/s per device against one node)")
    ax.set_xscale("log", base=2)
    xs = network.node_counts(plan.net.nodes)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_ylim(0, 1.1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=100, metadata={"Software": PLOT_SOFTWARE})
    finally:
        plt.close(fig)
    output.make_dirs(target.parent, "--plot")
    output.write_bytes_atomic(target, buf.getvalue())
