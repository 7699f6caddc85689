"""The outer step of a low-communication run (`--dp-mode diloco`, DiLoCo: Douillard et al.
2023, arXiv 2311.08105): every `every` optimizer steps the islands (app.runtime.islands)
average how far each moved from the weights they last agreed on, and an outer optimizer (torch's
SGD with Nesterov momentum) moves those global weights by the average; every island then starts
the next round from them. Between syncs nothing crosses islands.

What each rank holds (its "slice"): the fp32 master weights it steps, as DeepSpeed's wrapper keeps
them. At ZeRO-1/2 (DeepSpeedZeroOptimizer, BF16_Optimizer) that is the rank's partition of each
flat group, already 1/N of the model; at ZeRO-0 every island rank holds the whole model, so rank
i of an island takes the i-th 1/N of the flattened masters. Each rank keeps, for its slice only,
the global weights (`anchor`) and the outer momentum: 8 bytes a parameter over the island.

A sync (`sync`): pseudo-gradient = anchor - slice (fp32), its mean over the islands by one
all-reduce over the rank's `across` group (in `dtype`: fp32, or bf16 to halve the bytes on the
slow link), then `SGD(nesterov=True).step()` on the anchor, whose copy goes back into the masters;
the wrapper then refreshes the model's (bf16) weights and gathers the slices inside the island
(its own `update_lp_params`; ZeRO-0: an all-gather of the slices over the island's fast link). The
weights each island trains on next are bit for bit the same on every rank of the world.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from app.runtime.islands import Islands

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class OuterSync:
    """The outer optimizer of one engine (module docstring)."""

    def __init__(self, engine, islands: Islands, *, every: int, lr: float, momentum: float,
                 dtype: str = "fp32"):
        self.engine, self.islands, self.every = engine, islands, every
        self.dtype = DTYPES[dtype]
        self.kind, self.masters = _masters(engine)
        flat = self._flat()
        self.whole = self.kind == "zero0"  # every island rank holds the whole model
        n = flat.numel()
        self.slice_len = -(-n // islands.size) if self.whole else n
        start = islands.local * self.slice_len if self.whole else 0
        self.start, self.stop = min(start, n), min(start + self.slice_len, n)
        self.anchor = torch.nn.Parameter(self._mine(flat).clone(), requires_grad=False)
        self.optimizer = torch.optim.SGD([self.anchor], lr=lr, momentum=momentum,
                                         nesterov=momentum > 0)
        self.last_ms = 0.0
        self.bytes_sent = 0
        self.syncs = 0
        self.loaded = False  # the anchor came from a checkpoint (else: reset_anchor at start)
        self.synced_at = 0  # the optimizer step the last sync followed (0: the start)

    def describe(self) -> str:
        return (f"DiLoCo: {self.islands.count} islands of {self.islands.size} rank(s); every "
                f"{self.every} step(s) the weights are averaged across islands "
                f"({str(self.dtype).removeprefix('torch.')}, {self.slice_len:,} elements a rank) "
                f"and take an outer SGD step (lr {self.optimizer.param_groups[0]['lr']}, Nesterov "
                f"momentum {self.optimizer.param_groups[0]['momentum']})")

    # -- the masters ---------------------------------------------------------------------------

    def _flat(self) -> torch.Tensor:
        return _flatten_dense_tensors([m.detach().float() for m in self.masters])

    def _mine(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start:self.stop] if self.whole else flat

    @torch.no_grad()
    def _write_back(self, mine: torch.Tensor) -> None:
        """The masters set to the global weights (this rank's slice, then the island's), and the
        model's weights refreshed from them."""
        if self.whole:
            flat = torch.empty(self.slice_len * self.islands.size, dtype=mine.dtype,
                               device=mine.device)
            padded = flat.narrow(0, self.islands.local * self.slice_len, self.slice_len)
            padded.zero_()
            padded.narrow(0, 0, mine.numel()).copy_(mine)
            if self.islands.size > 1:  # every island rank's slice, over the fast link
                dist.all_gather_into_tensor(flat, padded.clone(), group=self.islands.group)
            mine = flat.narrow(0, 0, sum(m.numel() for m in self.masters))
        for master, new in zip(self.masters, _unflatten_dense_tensors(mine, self.masters)):
            master.data.copy_(new.view_as(master))
        _refresh(self.engine, self.kind)

    # -- the round -----------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether optimizer step `step` (1-based, done) ends a round."""
        return step % self.every == 0

    @torch.no_grad()
    def sync(self, step: int) -> None:
        """The outer step after optimizer step `step` (module docstring): a collective over
        every rank of the world."""
        from app.runtime import gather

        start = time.perf_counter()
        gather.flush(self.engine)  # the weights whole before they are read
        mine = self._mine(self._flat())
        delta = (self.anchor - mine).to(self.dtype)
        dist.all_reduce(delta, group=self.islands.across)
        self.bytes_sent += 2 * delta.numel() * delta.element_size() * (self.islands.count - 1) \
            // self.islands.count
        self.anchor.grad = delta.to(torch.float32).div_(self.islands.count)
        self.optimizer.step()
        self.anchor.grad = None
        self._write_back(self.anchor.detach())
        self.syncs += 1
        self.synced_at = step
        self.last_ms = 1000 * (time.perf_counter() - start)

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": self.anchor.detach().cpu(), "optimizer": self.optimizer.state_dict(),
                "every": self.every, "islands": self.islands.count,
                "island_size": self.islands.size, "slice": [self.start, self.stop],
                "synced_at": self.synced_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["islands"], state["island_size"]) != (self.islands.count, self.islands.size) \
                or list(state["slice"]) != [self.start, self.stop]:
            raise ValueError(f"outer state of {state['islands']} islands of "
                             f"{state['island_size']}, slice {state['slice']}: this run has "
                             f"{self.islands.count} of {self.islands.size}, slice "
                             f"{[self.start, self.stop]}")
        self.anchor.data.copy_(state["anchor"].to(self.anchor.device))
        self.optimizer.load_state_dict(state["optimizer"])
        self.synced_at = int(state.get("synced_at", 0))
        self.loaded = True

    def reset_anchor(self) -> None:
        """The global weights are the island's weights now (a run that switches to this mode from
        synchronous training, or a fresh start), the momentum zero."""
        self.anchor.data.copy_(self._mine(self._flat()))
        self.optimizer.state.clear()


def _masters(engine) -> tuple[str, list[torch.Tensor]]:
    """(kind, the fp32 master tensors this rank steps), by DeepSpeed's optimizer wrapper."""
    opt = engine.optimizer
    name = type(opt).__name__
    if isinstance(opt, torch.optim.Optimizer):  # ZeRO-0 fp32: the model's own weights
        return "zero0", [p for g in opt.param_groups for p in g["params"]]
    if name == "FP16_UnfusedOptimizer":  # ZeRO-0 bf16: fp32 copies of every weight
        return "zero0", [p for group in opt.fp32_groups for p in group]
    if name == "DeepSpeedZeroOptimizer":  # ZeRO-1/2: this rank's partition of each group
        return "zero12", list(opt.single_partition_of_fp32_groups)
    if name == "BF16_Optimizer":
        return "zero12", list(opt.fp32_groups_flat_partition)
    raise ValueError(f"--dp-mode diloco: {name} is not supported (ZeRO 0-2, fp32 or bf16)")


def _refresh(engine, kind: str) -> None:
    """The model's weights from the masters the outer step wrote."""
    opt = engine.optimizer
    if kind == "zero12":  # copy into the lp partitions, all-gather in the island
        opt.update_lp_params()
        for i in range(len(getattr(opt, "bit16_groups", []))):
            opt._update_model_bit16_weights(i)
    elif type(opt).__name__ == "FP16_UnfusedOptimizer":
        for fp32_group, lp_group in zip(opt.fp32_groups, opt.fp16_groups):
            for fp32_param, lp in zip(fp32_group, lp_group):
                lp.data.copy_(fp32_param.data)
