"""`python -m app plan`: memory and throughput per ZeRO stage before a run.

For ZeRO 0, 1, 2, 3 and 3 + offload: bytes per device by term (app.plan.memory), the largest micro
batch that fits, the global batch, tokens/s and step time at an assumed MFU (app.telemetry.flops,
app.telemetry.hardware), days and cost to train the token budget, and which stage to pick; then
the network (app.plan.network): communication per step, the part compute does not hide, step time
and scaling efficiency from 1 to N nodes, synchronous or in the low-communication mode
(`--dp-mode diloco`: islands, an outer sync every H steps), each mode's best within a global batch
bound (tokens per optimizer step), and the mode, H, stage, micro batch and gradient accumulation
to run. Formulas: docs/plan.md. Nothing is downloaded or allocated: the model is
built on PyTorch's meta device to count its parameters.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from app.plan import network
from app.plan.memory import GPU, OPTIMIZER_STATE_BYTES, GiB
from app.plan.planner import make_plan
from app.plan.recommend import MAX_GLOBAL_BATCH_TOKENS
from app.plan.render import plan_plot, render, to_json, write_plot
from app.plan.request import DEFAULT_GPU, PlanRequest
from app.telemetry import hardware
from data_tools import output


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", required=True, metavar="PRESET", help="model preset (as app train)")
    a("--model-arg", dest="model_args", action="append", default=[], metavar="KEY=VALUE",
      help="config field override (as app train)")
    a("--vocab-size", type=int, metavar="N", help="vocabulary (default: the config class's)")
    a("--seq-len", type=int, default=128, metavar="N", help="tokens per sample (default 128)")
    a("--micro-batch", type=int, metavar="N", help="samples per device per pass (default: the "
      "largest that fits, per stage)")
    a("--grad-accum", type=int, default=1, metavar="N", help="micro steps per optimizer step")
    a("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    a("--gradient-checkpointing", dest="checkpointing", action="store_true",
      help="plan with activation checkpointing")
    a("--gpus", type=int, metavar="N", help="devices in the whole job (default 1, or --nodes x "
      "--gpus-per-node)")
    a("--gpus-per-node", type=int, metavar="N", help="devices per node (default min(gpus, 8))")
    mem = parser.add_mutually_exclusive_group()
    mem.add_argument("--gpu", metavar="NAME", help=f"accelerator: {', '.join(hardware.names())} "
                     f"(default {DEFAULT_GPU})")
    mem.add_argument("--gpu-mem-gb", type=float, metavar="G", help="memory per device (GiB)")
    a("--peak-tflops", type=float, metavar="F", help="dense peak per device (default: the "
      "accelerator's for the precision)")
    a("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATE_BYTES))
    a("--tokens", type=float, metavar="N", help="tokens to train (default 20 per parameter)")
    a("--mfu", type=float, default=0.35, metavar="F", help="assumed MFU (default 0.35)")
    a("--price-per-gpu-hour", type=float, metavar="F", help="for the cost row")
    a("--mask-prob", type=float, default=0.15, metavar="F", help="MLM masked fraction")
    a("--attn", default="sdpa", choices=("sdpa", "flash_attention_2", "flex", "eager"),
      help="the attention kernel (default sdpa); flex and flash_attention_2 are fused as SDPA is "
      "(no S x S scores kept)")
    a("--runtime-gb", type=float, metavar="G", help="per-device runtime memory (default "
      f"{GPU.runtime_bytes / GiB:g})")
    a("--fragmentation", type=float, metavar="F", help="allowance on activations (default "
      f"{GPU.fragmentation:g})")
    add_network_arguments(parser)
    a("--json", action="store_true", help="print JSON instead of the table")
    a("--plot", metavar="PATH", help="write the predicted scaling efficiency against nodes, per "
      "stage, as a PNG")


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--nodes", type=int, metavar="N", help="nodes the network section scales to (default: "
      "gpus / gpus-per-node; without --gpus, --gpus is N x gpus-per-node)")
    a("--interconnect", metavar="NAME", help="network preset: " + ", ".join(
        f"{i.name} ({i.gbps:g} Gb/s, {i.latency_us:g} us)" for i in
        network.INTERCONNECTS.values()) + f" (default {network.DEFAULT_INTERCONNECT})")
    a("--net-gbps", type=float, metavar="G", help="inter-node bandwidth per node, Gb/s (shared "
      "by its devices; default: the preset's)")
    a("--net-latency-us", type=float, metavar="US", help="latency of one message between "
      "nodes (default: the preset's, or the preset's nearest --net-gbps)")
    a("--intra-gbps", type=float, metavar="G", help="bandwidth between a node's devices, per "
      "device, Gb/s (default: the accelerator's NVLink/PCIe figure)")
    a("--comm-dtype", choices=sorted(network.DTYPE_BYTES), help="gradient reduction dtype "
      "(default: what app train gives DeepSpeed)")
    a("--compute-ms", type=float, metavar="MS", help="a measured one-node optimizer step at "
      "--micro-batch and --grad-accum: replaces the FLOPs/MFU estimate")
    a("--step-ms", type=float, metavar="MS", help="the optimizer step's part of --compute-ms "
      "(a run's perf/optimizer_ms): nothing overlaps it, and it does not grow with the batch "
      "(default: counted as forward and backward)")
    a("--forward-ms", type=float, metavar="MS", help="the forward pass's part of --compute-ms "
      "per micro step (a run's perf/forward_ms): the window ZeRO-1/2's weight gathers hide "
      "behind; backward is the rest (default: --overlap-fraction)")
    a("--overlap-fraction", type=float, default=network.BACKWARD_FRACTION, metavar="F",
      help="share of a micro step that hides an overlapped gradient reduction (default 2/3: "
      "backward)")
    a("--device-kind", default="gpu", choices=("gpu", "cpu"), help="which overlap assumptions "
      "apply: cpu for DeepSpeed's CPU accelerator (a simulated cluster), whose side streams are "
      "no-ops (default gpu)")
    a("--net-cpu-ms-per-mb", type=float, metavar="MS", help="CPU ms a rank's own core spends "
      "per MB its node sends, taken from compute (default: "
      f"{network.GLOO_CPU_MS_PER_MB:g}, gloo's measured, with --device-kind cpu; else 0)")
    a("--dp-mode", default="sync", choices=network.DP_MODES, help="the data parallelism the "
      "per-stage tables show: sync (one group over the world, default) or diloco (islands "
      "synchronous inside, an outer sync every --outer-every steps); the recommendation "
      "weighs both")
    a("--outer-every", type=int, metavar="H", help="diloco: optimizer steps between outer "
      "syncs (default: the recommended)")
    a("--island-ranks", type=int, metavar="N", help="diloco: ranks an island, a divisor of "
      "--gpus-per-node or whole nodes (default: --gpus-per-node)")
    a("--outer-dtype", default="fp32", choices=network.OUTER_DTYPES, help="diloco: the outer "
      "sync's exchange dtype (default fp32)")
    a("--min-outer-every", type=int, default=network.MIN_OUTER_EVERY, metavar="H",
      help=f"the smallest H the plan recommends (default {network.MIN_OUTER_EVERY}: quality "
      "depends on H; docs/plan.md)")
    a("--max-outer-every", type=int, default=network.MAX_OUTER_EVERY, metavar="H",
      help=f"the largest H the plan recommends (default {network.MAX_OUTER_EVERY}: the largest "
      "measured to hold quality within 2 %% of synchronous; docs/benchmarks.md)")
    a("--max-global-batch-tokens", type=float, metavar="T", help="tokens per optimizer step "
      "no recommendation exceeds (default: " + ", ".join(
          f"{k} {v:,}" for k, v in MAX_GLOBAL_BATCH_TOKENS.items()) + ")")


def run(args: argparse.Namespace) -> int:
    names = set(PlanRequest.__dataclass_fields__)
    if args.gpus is None:
        args.gpus = args.nodes * (args.gpus_per_node or 8) if args.nodes else 1
    req = PlanRequest(**{k: v for k, v in vars(args).items() if k in names and k != "model_args"},
                      model_args=tuple(args.model_args))
    if args.plot:  # refused before the plan is made
        output.claim_file(Path(args.plot), "--plot", ours=plan_plot, what="plot")
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import logs to stdout
        plan = make_plan(req)
    if args.plot:
        write_plot(plan, args.plot)
    if args.json:
        json.dump(to_json(plan), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(plan))
    return 0
