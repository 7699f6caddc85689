"""The network recommendation: which mode (synchronous or the low-communication one, at which H),
ZeRO stage, micro batch and gradient accumulation to run on the planned network, within the global
batch bound (tokens per optimizer step); each mode's fastest within it; and why, in a line or
two, with what would reach the target where nothing does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

from app.plan import network
from app.plan.inputs import ModelInfo
from app.plan.jobs import NetworkSetup, compute_ms, network_job
from app.plan.memory import MiB, ZeroSetup
from app.plan.request import PlanRequest

MAX_GLOBAL_BATCH_TOKENS = {"mlm": 8192 * 512, "clm": 4 * 2 ** 20}
"""Tokens per optimizer step the network recommendation never exceeds, by objective, unless
--max-global-batch-tokens says otherwise: the largest global batches published models of each
kind trained well with AdamW, a ceiling rather than a target. MLM: RoBERTa's 8K sequences of
512 tokens, 4.2 M tokens (Liu et al. 2019, arXiv:1907.11692: its Table 3 has 2K and 8K
sequences both ahead of BERT's 256 at equal compute, and it trained at 8K); past that, BERT
needed LAMB (You et al. 2019, arXiv:1904.00962: 32K-64K sequences). CLM: Llama's and Llama
2's 4 M tokens at every size (Touvron et al. 2023, arXiv:2302.13971 and arXiv:2307.09288),
above GPT-3's 0.5 M (125M-760M) to 3.2 M (175B) (Brown et al. 2020, arXiv:2005.14165, Table
2.1): a small model's critical batch is below it. Without the bound the plan hid a slow link
by growing the batch (bert-350m on 128 nodes at 25 Gb/s: 200 M tokens a step), which no
optimizer settings make train well."""
DEFAULT_MAX_GLOBAL_BATCH_TOKENS = 4 * 2 ** 20
"""An objective not in MAX_GLOBAL_BATCH_TOKENS."""


MAX_GRAD_ACCUM = 64


def max_global_batch_tokens(req: PlanRequest, info: ModelInfo) -> int:
    """--max-global-batch-tokens, else the objective's default (MAX_GLOBAL_BATCH_TOKENS)."""
    if req.max_global_batch_tokens is not None:
        return int(req.max_global_batch_tokens)
    return MAX_GLOBAL_BATCH_TOKENS.get(info.objective, DEFAULT_MAX_GLOBAL_BATCH_TOKENS)


def _candidates(largest: int, also: int | None = None) -> list[int]:
    """Micro batches to try: powers of two within memory, the largest that fits, and `also`
    (the requested micro batch) where it fits."""
    extra = {also} if also and also <= largest else set()
    return sorted({m for m in (2 ** i for i in range(20)) if m <= largest} | {largest} | extra)


@dataclass(frozen=True)
class Option:
    """One way to run the job on the planned network: a mode, a stage and a batch, with its
    predicted optimizer step at the planned node count."""

    dp_mode: str
    outer_every: int | None
    setup: ZeroSetup
    micro_batch: int
    grad_accum: int
    global_batch: int
    """Samples per optimizer step, all devices."""
    global_batch_tokens: int
    t: network.StepTime
    scaling_efficiency: float
    """Tokens/s per device against one synchronous node's at the same batch, as the per-stage
    tables (network.scaling_rows)."""
    tokens_per_sec: float
    node_bytes: int
    """Bytes a node sends over its inter-node link per optimizer step, on average."""

    @property
    def efficiency(self) -> float:
        """The share of the step the devices compute: tokens/s per device against a node that
        communicates nothing. At most `scaling_efficiency` (a real node's step communicates
        too), and not raised by a batch that slows one node as well (ZeRO-2 at micro batch 1
        reduces over the node's devices every micro step)."""
        return self.t.compute_ms / self.t.step_ms

    def to_json(self, req: PlanRequest) -> dict[str, Any]:
        low = self.dp_mode == "diloco"
        outer_lr, outer_momentum = outer_defaults() if low else (None, None)
        return {"dp_mode": self.dp_mode, "outer_every": self.outer_every,
                "island_ranks": req.island if low else None,
                "outer_dtype": req.outer_dtype if low else None,
                "outer_lr": outer_lr, "outer_momentum": outer_momentum,
                "zero": self.setup.label, "zero_stage": self.setup.stage,
                "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                "global_batch": self.global_batch,
                "global_batch_tokens": self.global_batch_tokens, "step_ms": self.t.step_ms,
                "comm_ms": self.t.comm_ms, "exposed_comm_ms": self.t.exposed_comm_ms,
                "outer_sync_ms": self.t.outer_ms if low else None,
                "efficiency": self.efficiency,
                "scaling_efficiency": self.scaling_efficiency,
                "tokens_per_sec": self.tokens_per_sec,
                "node_bytes_per_step": self.node_bytes,
                "reaches_target": self.efficiency >= network.TARGET_EFFICIENCY}


@dataclass(frozen=True)
class NetworkChoice:
    """The network recommendation: the pick, why, and each mode's best within the bound."""

    pick: Option | None
    lines: tuple[str, ...]
    """Why, a line or two."""
    modes: list[Option]
    """Synchronous at each stage, then the low-communication mode at each H: each at its
    fastest stage and batch within memory and the bound (`modes_of`)."""
    bound: int
    """The global batch bound, tokens per optimizer step."""
    outer_every: int | None = None
    """The H for a --dp-mode diloco table without --outer-every: the pick's, else the smallest
    that reaches the target, else the largest tried."""

    @property
    def reason(self) -> str:
        return " ".join(self.lines)


def outer_every_candidates(req: PlanRequest) -> list[int]:
    """The H the plan predicts: network.OUTER_EVERY_CANDIDATES, the user's --outer-every and
    the bounds --min-outer-every and --max-outer-every (so that one at least may be
    recommended)."""
    extra = {req.outer_every} if req.outer_every else set()
    return sorted(set(network.OUTER_EVERY_CANDIDATES) | extra
                  | {req.min_outer_every, req.max_outer_every})


def search_options(req: PlanRequest, info: ModelInfo, setups: list[ZeroSetup],
                   largest: dict[str, list[int]], net: NetworkSetup, peak: float | None,
                   fpt: float, dtypes: list[str], bound: int) -> list[Option]:
    """Every mode, stage (not offload), micro batch (powers of two, the largest that fits and
    the requested) and accumulation (1, 2, 4 ... 64) within memory (`largest`: per mode, the
    largest micro batch per stage, ZeRO partitioning over the world or over an island) and the
    global batch bound, with its step at `net.nodes` nodes. The low-communication mode where
    `app train` runs it (two islands or more, ZeRO 0-2, not fp16: LowComm.runs); at each H it
    shares the batch's island step, only the outer sync's share changes with H."""
    world = net.nodes * req.per_node
    cap = bound // (world * req.seq_len)  # samples a device per optimizer step
    every = outer_every_candidates(req) if world // req.island > 1 else []  # one island: sync
    out = []
    for i, setup in enumerate(setups):
        top = min(max(largest["sync"][i], largest["diloco"][i]), cap)
        if setup.offload or top < 1:
            continue
        for micro in _candidates(top, req.micro_batch):
            gas = 1
            while gas <= MAX_GRAD_ACCUM and micro * gas <= cap:
                job = network_job(req, info, setup, net, micro, gas,
                                  compute_ms(req, micro, gas, peak, fpt), dtypes[i])
                one = job.at(1)
                tokens = micro * gas * req.seq_len  # a device's, per optimizer step

                def option(mode: str, h: int | None, t: network.StepTime, sent: int,
                           setup: ZeroSetup = setup, micro: int = micro, gas: int = gas,
                           tokens: int = tokens, one: network.StepTime = one) -> Option:
                    return Option(mode, h, setup, micro, gas, micro * gas * world,
                                  tokens * world, t, one.step_ms / t.step_ms,
                                  world * tokens / t.step_ms * 1000, sent)

                if micro <= largest["sync"][i]:
                    out.append(option("sync", None, job.at(net.nodes), job.node_bytes(net.nodes)))
                low = network.LowComm(job, req.island, 1, req.outer_dtype)
                if every and low.runs and micro <= largest["diloco"][i]:
                    island, island_nodes = low.inner(net.nodes)
                    inner = (one if island.per_node == job.per_node and island_nodes == 1
                             else island.at(island_nodes))
                    for h in every:
                        mode = replace(low, outer_every=h)
                        out.append(option("diloco", h, mode.at(net.nodes, inner),
                                          mode.node_bytes(net.nodes)))
                gas *= 2
    return out


def recommend_network(req: PlanRequest, info: ModelInfo, setups: list[ZeroSetup],
                      largest: dict[str, list[int]], net: NetworkSetup, peak: float | None,
                      fpt: float, dtypes: list[str]) -> NetworkChoice:
    """Mode, H, stage and batch within the global batch bound (efficiency: `Option.efficiency`,
    compute over the step). Synchronous data parallelism where some stage and batch reaches
    network.TARGET_EFFICIENCY at `net.nodes` nodes (the smallest batch per device that does,
    then `best_of`); else the low-communication mode at the smallest H within --min-outer-every
    and --max-outer-every that reaches it (quality falls as H grows: network.MIN_OUTER_EVERY,
    network.MAX_OUTER_EVERY), at its smallest batch there; else the fastest of either within
    those bounds, said so, with the smallest H above the bound that would reach it."""
    bound = max_global_batch_tokens(req, info)
    world = net.nodes * req.per_node
    where = (f"{net.link.inter_gbps:g} Gb/s per node, {net.nodes} node(s), global batch at "
             f"most {bound:,} tokens")
    if compute_ms(req, 1, 1, peak, fpt) is None:
        return NetworkChoice(None, ("no compute time to hide behind (give --gpu NAME, "
                                    "--peak-tflops or --compute-ms)",), [], bound)
    if bound < world * req.seq_len:
        return NetworkChoice(None, (f"{where}: the bound is below one sample a device "
                                    f"({world:,} x seq-len {req.seq_len}); raise "
                                    f"--max-global-batch-tokens",), [], bound)
    options = search_options(req, info, setups, largest, net, peak, fpt, dtypes, bound)
    if not options:
        return NetworkChoice(None, (f"{where}: no stage but ZeRO-3 + offload fits (its PCIe "
                                    f"traffic is not modelled)",), [], bound)
    target = network.TARGET_EFFICIENCY
    sync = [o for o in options if o.dp_mode == "sync"]
    low = [o for o in options if o.dp_mode == "diloco" and o.outer_every is not None
           and req.min_outer_every <= o.outer_every <= req.max_outer_every]
    sync_ok = [o for o in sync if o.efficiency >= target]
    low_ok = smallest_h_reaching(low, req.min_outer_every, req.max_outer_every, target)
    if sync_ok:
        pick = smallest_batch(sync_ok)
    elif low_ok:
        pick = low_ok
    else:
        pick = best_of(sync + low) or options[0]
    every = (pick.outer_every if pick.dp_mode == "diloco" else low_ok.outer_every if low_ok
             else max((o.outer_every or 0 for o in low), default=0) or None)
    lines = _choice_reason(req, where, pick, best_of(sync))
    if pick.efficiency < target and low:
        lines += _what_would_reach(req, options, target, lambda: search_options(
            replace(req, outer_dtype="bf16"), info, setups, largest, net, peak, fpt, dtypes,
            bound))
    return NetworkChoice(pick, lines, modes_of(options, setups, outer_every_candidates(req)),
                         bound, every)


def smallest_h_reaching(options: list[Option], lo: float, hi: float,
                        target: float) -> Option | None:
    """The low-communication option at the smallest H in [lo, hi] that reaches `target`, at its
    smallest batch there (`smallest_batch`); None where none does."""
    ok = [o for o in options if o.dp_mode == "diloco" and o.outer_every is not None
          and lo <= o.outer_every <= hi and o.efficiency >= target]
    if not ok:
        return None
    h = min(o.outer_every or 0 for o in ok)
    return smallest_batch([o for o in ok if o.outer_every == h])


def _what_would_reach(req: PlanRequest, options: list[Option], target: float,
                      bf16: Callable[[], list[Option]]) -> tuple[str, ...]:
    """Where no H within the bounds reaches the target: a line for each way out that does, the
    bf16 outer exchange (half the bytes; `bf16`: the options with it) within the bounds, and
    the smallest H above --max-outer-every."""
    out = []
    half = (smallest_h_reaching(bf16(), req.min_outer_every, req.max_outer_every, target)
            if req.outer_dtype == "fp32" else None)
    if half is not None:
        out.append(f"With --outer-dtype bf16 (half the outer sync's bytes; the global weights and "
                   f"the outer step stay fp32) diloco at H={half.outer_every} would reach "
                   f"{half.efficiency:.2f}.")
    above = smallest_h_reaching(options, req.max_outer_every + 1, math.inf, target)
    if above is not None:
        out.append(f"Diloco at H={above.outer_every} would reach {above.efficiency:.2f}: above "
                   f"--max-outer-every {req.max_outer_every}, the largest H measured to hold "
                   f"quality (docs/benchmarks.md); raise it once a quality run of your own holds "
                   f"there.")
    return tuple(out)


NEAR = 0.01
"""Options within this share of the fastest's tokens/s count as equally fast (the model is not
finer than that)."""


def best_of(options: list[Option]) -> Option | None:
    """The fastest (tokens/s); among those within NEAR of it, the lowest stage (the least
    traffic and memory copied), then the fewest micro steps."""
    if not options:
        return None
    top = max(o.tokens_per_sec for o in options)
    return min((o for o in options if o.tokens_per_sec >= (1 - NEAR) * top),
               key=lambda o: (o.setup.stage, o.grad_accum, o.micro_batch))


def smallest_batch(options: list[Option]) -> Option:
    """The smallest batch per device (micro batch x accumulation), then `best_of`."""
    least = min(o.micro_batch * o.grad_accum for o in options)
    return best_of([o for o in options if o.micro_batch * o.grad_accum == least]) or options[0]


def modes_of(options: list[Option], setups: list[ZeroSetup], every: list[int]) -> list[Option]:
    """Synchronous at each stage, then the low-communication mode at each H (its best stage),
    each at its fastest batch within the bound."""
    rows = [best_of([o for o in options if o.dp_mode == "sync" and o.setup == s])
            for s in setups]
    rows += [best_of([o for o in options if o.dp_mode == "diloco" and o.outer_every == h])
             for h in every]
    return [r for r in rows if r is not None]


def _choice_reason(req: PlanRequest, where: str, pick: Option,
                   sync: Option | None) -> tuple[str, ...]:
    """The pick in a line; where it is the low-communication mode, a second: what synchronous
    data parallelism reaches at best, and that quality depends on H."""
    target = network.TARGET_EFFICIENCY
    mode = ("synchronous" if pick.dp_mode == "sync" else
            f"diloco, an outer sync every {pick.outer_every} steps (islands of {req.island}, "
            f"{req.outer_dtype})")
    first = (f"{where}: " + ("" if pick.efficiency >= target else
                             f"nothing reaches efficiency {target:g}; closest: ")
             + f"{mode}, {pick.setup.label} at micro batch {pick.micro_batch} x grad accum "
             f"{pick.grad_accum}: efficiency {pick.efficiency:.2f}, {pick.t.step_ms:,.0f} ms a "
             f"step, {pick.tokens_per_sec:,.0f} tokens/s, {pick.node_bytes / MiB:,.1f} MB per "
             f"node per step, global batch {pick.global_batch_tokens:,} tokens.")
    if pick.dp_mode == "sync" or sync is None:
        return (first,)
    outer_lr, outer_momentum = outer_defaults()
    return first, (f"Synchronous at best: {sync.efficiency:.2f} ({sync.setup.label} at micro "
                   f"batch {sync.micro_batch} x grad accum {sync.grad_accum}, "
                   f"{sync.node_bytes / MiB:,.1f} MB per node per step). Quality depends on H "
                   f"({req.min_outer_every} to {req.max_outer_every} here): docs/benchmarks.md. "
                   f"Start "
                   f"synchronously: train the first steps with --dp-mode sync, then resume with "
                   f"--dp-mode diloco (outer lr {outer_lr:g}, Nesterov momentum "
                   f"{outer_momentum:g}; docs/recipes.md).")


def outer_defaults() -> tuple[float, float]:
    """`app train`'s outer learning rate and Nesterov momentum (--outer-lr, --outer-momentum):
    what a --dp-mode diloco pick runs with."""
    from app.config import TrainConfig

    return TrainConfig.outer_lr, TrainConfig.outer_momentum
