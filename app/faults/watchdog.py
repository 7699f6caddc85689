"""A watchdog per rank: a rank that makes no progress for `--hang-timeout` seconds (stuck in a
collective, the loader or a save) says which rank it is and where, prints the Python stack of
every thread, and exits with EXIT_HUNG instead of hanging the job forever; the launcher then
stops the other ranks (docs/design.md, "Faults").

Progress is a beat: the training loop beats at every micro step, eval and save at their start
and end. A beat is two attribute writes; the watchdog thread wakes a few times a timeout.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

EXIT_HUNG = 124  # as timeout(1) exits


class Watchdog:
    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s, self.rank = timeout_s, rank
        self.phase = "starting"
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
            self._thread.start()

    def beat(self, phase: str) -> None:
        self._last = time.monotonic()
        self.phase = phase

    def _watch(self) -> None:
        while not self._stop.wait(min(self.timeout_s / 4, 10.0)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                print(f"rank {self.rank}: no progress for {idle:.0f} s (--hang-timeout "
                      f"{self.timeout_s:g}) while {self.phase}; the Python stack of every thread "
                      f"follows, then exit {EXIT_HUNG}", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(EXIT_HUNG)

    def close(self) -> None:
        self._stop.set()
