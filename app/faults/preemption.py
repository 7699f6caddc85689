"""Stopping on a signal with a checkpoint, all ranks together (docs/design.md, "Faults").

SIGTERM (what schedulers send before killing a job), SIGUSR1 (Slurm's `--signal`) and SIGINT
(Ctrl-C) set a flag on the process that got them. `catch()` installs the handlers first thing in
a run, so a signal during start-up (staging, conversion, the engine build) never kills a rank in
the middle of a write: `stop_before_loop` ends the run at the next safe point, with nothing new to
save. In the loop, at every step boundary the ranks agree on the flags: a one-integer all-reduce
on the job's own process group, started at one boundary and read LAG boundaries later by every
rank (`StopRequests`), so it needs no connection of its own and never waits for the accelerator.
When any rank asked to stop, every rank saves the same checkpoint and the run exits with
EXIT_PREEMPTED; `--resume auto` continues exactly. A second Ctrl-C aborts at once.

A scheduler signals every process of the job: launch.sh, DeepSpeed's launcher (which exits with
its own status), the ranks, their loader workers (which ignore these signals: their rank shuts
them down). So each rank also writes its exit status where launch.sh asked (EXIT_DIR_ENV), and
launch.sh exits 75 when the ranks did.
"""
from __future__ import annotations

import os
import signal
import sys
from collections import deque

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
    """This rank's exit status, for launch.sh (whose launcher child reports only its own). On
    another host than launch.sh's the directory is made here (private), and collected after."""
    where = os.environ.get(EXIT_DIR_ENV)
    if not where or not _own_directory(where):
        return
    rank = os.environ.get("RANK", "0")
    try:
        with open(os.path.join(where, f"rank{rank}"), "w") as f:
            f.write(f"{code}\n")
    except OSError:
        pass  # launch.sh then goes by the launcher's status


def _own_directory(where: str) -> bool:
    """`where` is a directory of this user (made now if missing, its parent being there)."""
    try:
        os.mkdir(where, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return False
    return (os.path.isdir(where) and not os.path.islink(where)
            and os.stat(where).st_uid == os.getuid())


LAG = 2  # step boundaries between starting an agreement and reading it (see StopRequests)


class StopRequests:
    """The agreed stop of the ranks, on the flag `catch` set.

    No process group of its own: a second group (gloo) would join every rank to every other, a
    socket per peer (~1,000 a rank at 1,024 ranks, over common open-file limits), and would need
    its own network interface. The flag rides on the job's group instead, as a one-integer MAX
    all-reduce on this rank's device (NCCL's rings and trees on a GPU; gloo's own mesh on CPU).

    At every boundary each rank starts one such all-reduce, asynchronously, and reads the one it
    started LAG boundaries earlier. On an accelerator the result is copied into pinned host memory
    behind the collective (non_blocking, an event recorded after it), so reading it waits only if
    the device is still LAG steps behind the host, which a real step never is; on CPU the reduced
    tensor is the host's. Every rank reads the same boundary's result at the same boundary index,
    so all of them stop at the same step, at most LAG + 1 steps after the signal.
    """

    def __init__(self, several_ranks: bool):
        catch()  # where `build` did not already
        self._several = several_ranks
        self._ballots: deque = deque()  # agreements in flight, oldest first
        if several_ranks:
            import torch

            from app.runtime.device import accelerator

            acc = accelerator()
            self._on = acc.current_device_name()  # this rank's device, bound by init
            self._event = acc.Event  # None on CPU: the reduced tensor is already the host's
            host = [torch.zeros(1, dtype=torch.int32) for _ in range(LAG)]  # host memory
            self._pinned = [acc.pin_memory(t) for t in host]  # (a no-op on CPU)

    @property
    def requested(self) -> int:
        return requested()

    def agree_now(self) -> int:
        """Before the loop: the signal any rank got so far (0: none), the same on every rank."""
        if not self._several:
            return self.requested
        import torch

        flag = _int_tensor(self.requested, self._on)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item())  # one host sync, before the loop

    def start(self) -> None:
        """The loop begins: a signal from now on is answered with a checkpoint."""
        global _in_loop
        _in_loop = True

    def agreed(self) -> int:
        """Called by every rank at every step boundary: the signal some rank had got LAG
        boundaries ago (0: none), the same on every rank."""
        if not self._several:
            return self.requested
        answer = self._read(self._ballots.popleft()) if len(self._ballots) == LAG else 0
        self._ballots.append(self._vote(self.requested))
        return answer

    def _vote(self, value: int) -> tuple:
        """Start this rank's part of one agreement: (work, where the answer lands, event)."""
        import torch

        flag = _int_tensor(value, self._on)  # a fill kernel on a device: no host transfer
        work = torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX,
                                            async_op=True)
        if self._event is None:
            return work, flag, None
        work.wait()  # the current stream waits for the collective, the host does not
        host = self._pinned.pop()
        host.copy_(flag, non_blocking=True)
        done = self._event()
        done.record()
        return work, host, done

    def _read(self, ballot: tuple) -> int:
        """The answer of an agreement started LAG boundaries ago (done by now, in practice)."""
        work, host, done = ballot
        if done is None:
            work.wait()  # gloo on CPU: the reduction itself
            return int(host[0])
        done.synchronize()  # the copy behind it
        self._pinned.append(host)
        return int(host[0])

    def close(self) -> None:
        """Wait for the agreements still in flight (every rank started the same ones). A peer
        that is gone fails them: the run's own error says why, so that one is not raised."""
        try:
            while self._ballots:
                self._read(self._ballots.popleft())
        except RuntimeError:  # torch.distributed's errors (DistError and the backends')
            self._ballots.clear()
        if not _requested:  # a run that stops for a signal keeps its handlers to its exit: a
            release()  # second SIGTERM after the stop checkpoint must not turn 75 into 143


def _int_tensor(value: int, device):
    import torch

    return torch.full((1,), value, dtype=torch.int32, device=device)
