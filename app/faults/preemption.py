"""Stopping on a signal with a checkpoint, all ranks together (docs/design.md, "Faults").

SIGTERM (what schedulers send before killing a job), SIGUSR1 (Slurm's `--signal`) and SIGINT
(Ctrl-C) set a flag on the process that got them. `catch()` installs the handlers first thing in
a run, so a signal during start-up (staging, conversion, the engine build) never kills a rank in
the middle of a write: `stop_before_loop` ends the run at the next safe point, with nothing new to
save. In the loop, at every step boundary the ranks agree on the flags: a one-integer all-reduce
on a CPU (gloo) group, started at one boundary and read at the next, so it overlaps a whole step
and never waits for the accelerator. When any rank asked to stop, every rank saves the same
checkpoint and the run exits with EXIT_PREEMPTED; `--resume auto` continues exactly. A second
Ctrl-C aborts at once.

A scheduler signals every process of the job: launch.sh, DeepSpeed's launcher (which exits with
its own status), the ranks, their loader workers (which ignore these signals: their rank shuts
them down). So each rank also writes its exit status where launch.sh asked (EXIT_DIR_ENV), and
launch.sh exits 75 when the ranks did.
"""
from __future__ import annotations

import os
import signal
import sys

from data_tools.errors import Stopped, UserError

# torch is imported where the group is used: `catch` runs before torch loads (app.train)

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped with a checkpoint; run the same command again
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EXIT_DIR_ENV = "DSPRETRAIN_EXIT_DIR"  # set by launch.sh: one file a rank, its exit status

_requested = 0  # the first stop signal this process got, 0: none
_in_loop = False  # what the handler's line promises: a checkpoint, or a stop before training
_previous: dict = {}  # the handlers before `catch`, put back by `release`


def _handle(signum, frame) -> None:
    global _requested
    if signum == signal.SIGINT and _requested == signal.SIGINT:
        raise KeyboardInterrupt  # the second Ctrl-C: abort without saving
    _requested = _requested or signum
    what = ("stopping at the next step with a checkpoint" if _in_loop
            else "stopping before training starts, nothing new to save")
    print(f"got {signal.Signals(signum).name}: {what} (exit status {EXIT_PREEMPTED})",
          file=sys.stderr, flush=True)


def catch() -> None:
    """Install the stop handlers (once; a signal that came since stays requested)."""
    if not _previous:
        _previous.update({s: signal.signal(s, _handle) for s in SIGNALS})


def release() -> None:
    """The run is over: the old handlers back, no signal requested."""
    global _requested, _in_loop
    for s, handler in _previous.items():
        signal.signal(s, handler)
    _previous.clear()
    _requested, _in_loop = 0, False


def requested() -> int:
    """The stop signal this process got (0: none)."""
    return _requested


def stop_before_loop(phase: str, agreed: int | None = None) -> None:
    """A safe point of the start-up: stop here (EXIT_PREEMPTED, nothing written half) when a
    signal came. `agreed`: the ranks' common answer once a group exists, else this rank's."""
    signum = requested() if agreed is None else agreed
    if signum:
        raise Stopped(f"got {signal.Signals(signum).name} {phase}: nothing new to save; run the "
                      f"same command again", EXIT_PREEMPTED)


def starting_stopped(error: BaseException) -> Stopped | None:
    """A start-up step that failed after a stop signal came: the signal's doing (it reaches the
    job's helper processes too, e.g. an op's compiler), so a stop with nothing to save. Not a
    UserError: the same command would fail again."""
    if not _requested or _in_loop or isinstance(error, (Stopped, UserError, KeyboardInterrupt)):
        return None
    return Stopped(f"got {signal.Signals(_requested).name} while starting, which then failed "
                   f"({type(error).__name__}): nothing new to save; run the same command again",
                   EXIT_PREEMPTED)


def record_exit(code: int) -> None:
    """This rank's exit status, for launch.sh (whose launcher child reports only its own)."""
    where = os.environ.get(EXIT_DIR_ENV)
    if not where or not os.path.isdir(where):
        return
    rank = os.environ.get("RANK", "0")
    try:
        with open(os.path.join(where, f"rank{rank}"), "w") as f:
            f.write(f"{code}\n")
    except OSError:
        pass  # launch.sh then goes by the launcher's status


class StopRequests:
    """The agreed stop of the ranks, on the flag `catch` set."""

    def __init__(self, several_ranks: bool):
        import torch

        catch()  # where `build` did not already
        self._group = torch.distributed.new_group(backend="gloo") if several_ranks else None
        self._flag = torch.zeros(1, dtype=torch.int64)
        self._work = None

    @property
    def requested(self) -> int:
        return requested()

    def agree_now(self) -> int:
        """Before the loop: the signal any rank got so far (0: none), the same on every rank."""
        if self._group is None:
            return self.requested
        import torch

        flag = torch.tensor([self.requested], dtype=torch.int64)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
        return int(flag.item())

    def start(self) -> None:
        """The loop begins: a signal from now on is answered with a checkpoint."""
        global _in_loop
        _in_loop = True

    def agreed(self) -> int:
        """Called by every rank at every step boundary: the signal some rank got before the
        previous boundary (0: none). The answer is a step late, the same on every rank."""
        if self._group is None:
            return self.requested
        import torch

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
        release()
