"""Islands: the ranks of a low-communication run (`--dp-mode diloco`) that train synchronously
together (docs/design.md, "Low-communication data parallelism").

The world's ranks form islands of `size` consecutive ranks (by default one node's: the fast
intra-node link). Inside an island DeepSpeed trains as usual, at the chosen ZeRO stage, its
data-parallel group being the island's ranks: the app hands DeepSpeed a model-parallel unit
(`IslandMPU`, DeepSpeed's `mpu` protocol) whose data-parallel group is the island and whose
model-parallel group is the rank alone. Across islands the ranks with the same place in their
island form a group of their own (`across`), over which the outer step averages the weights
(app.runtime.outer): the only traffic between islands.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Islands:
    size: int
    """Ranks an island."""
    count: int
    """Islands in the world."""
    index: int
    """This rank's island."""
    local: int
    """This rank's place in its island (its DeepSpeed data-parallel rank)."""
    group: Any
    """This island's ranks: DeepSpeed's data-parallel group."""
    across: Any
    """The ranks at this rank's place in every island: the outer step's group."""
    alone: Any
    """This rank alone: the model-parallel group DeepSpeed is told of (no model parallelism)."""

    @property
    def mpu(self) -> "IslandMPU":
        return IslandMPU(self)


def make(size: int) -> Islands:
    """Split the world (joined already) into islands of `size` consecutive ranks. Every rank
    calls it (it makes process groups, each a collective over the world)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(f"a world of {world} ranks is not islands of {size}")
    count = world // size
    islands = [list(range(i * size, (i + 1) * size)) for i in range(count)]
    across = [list(range(local, world, size)) for local in range(size)]
    group, _ = dist.new_subgroups_by_enumeration(islands)
    across_group, _ = dist.new_subgroups_by_enumeration(across)
    alone, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world)])
    return Islands(size=size, count=count, index=rank // size, local=rank % size, group=group,
                   across=across_group, alone=alone)


class IslandMPU:
    """DeepSpeed's model-parallel unit for islands: data parallelism over the island's ranks,
    no model parallelism (a model-parallel world of one, so DeepSpeed's norms and checkpoint
    names stay those of plain data parallelism)."""

    def __init__(self, islands: Islands):
        self.islands = islands

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self):
        return self.islands.alone

    def get_data_parallel_rank(self) -> int:
        return self.islands.local

    def get_data_parallel_world_size(self) -> int:
        return self.islands.size

    def get_data_parallel_group(self):
        return self.islands.group


def model_parallel(engine) -> bool:
    """Whether `engine` splits the model across ranks (an mpu with a model-parallel world of
    more than one); islands' mpu does not."""
    mpu = getattr(engine, "mpu", None)
    return mpu is not None and mpu.get_model_parallel_world_size() > 1


def of(engine) -> Islands | None:
    """The islands `engine` trains in (None: synchronous data parallelism over the world)."""
    mpu = getattr(engine, "mpu", None)
    return mpu.islands if isinstance(mpu, IslandMPU) else None
