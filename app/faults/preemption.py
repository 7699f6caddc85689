"""Stopping on a signal with a checkpoint, all ranks together (docs/design.md, "Faults").

SIGTERM (what schedulers send before killing a job), SIGUSR1 (Slurm's `--signal`) and SIGINT
(Ctrl-C) set a flag on the rank that got them. At every step boundary the ranks agree on the
flags: a one-integer all-reduce on a CPU (gloo) group, started at one boundary and read at the
next, so it overlaps a whole step and never waits for the accelerator. When any rank asked to
stop, every rank saves the same checkpoint and the run exits with EXIT_PREEMPTED; `--resume auto`
continues exactly. A second Ctrl-C aborts at once.
"""
from __future__ import annotations

import signal
import sys

import torch

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped with a checkpoint; run the same command again
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequests:
    def __init__(self, several_ranks: bool):
        self.requested = 0  # the signal number, 0: none
        self._group = torch.distributed.new_group(backend="gloo") if several_ranks else None
        self._flag = torch.zeros(1, dtype=torch.int64)
        self._work = None
        self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: abort without saving
        self.requested = self.requested or signum
        print(f"got {signal.Signals(signum).name}: stopping at the next step with a checkpoint "
              f"(exit status {EXIT_PREEMPTED})", file=sys.stderr, flush=True)

    def agreed(self) -> int:
        """Called by every rank at every step boundary: the signal some rank got before the
        previous boundary (0: none). The answer is a step late, the same on every rank."""
        if self._group is None:
            return self.requested
        answer = 0
        if self._work is not None:
            self._work.wait()
            answer = int(self._flag.item())  # a CPU tensor: no accelerator sync
        self._flag = torch.tensor([self.requested], dtype=torch.int64)
        self._work = torch.distributed.all_reduce(self._flag, op=torch.distributed.ReduceOp.MAX,
                                                  group=self._group, async_op=True)
        return answer

    def close(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        for s, handler in self._previous.items():
            signal.signal(s, handler)
