"""Switches that make a run misbehave on purpose, for the tests that show the app copes
(docs/design.md, "Metrics"): read from the environment, off unless a test sets them.

    DSPRETRAIN_TEST_SLOW_LOADER=RANK:SECONDS   that rank waits SECONDS more for every micro batch
                                               (a starved loader: telemetry must name the rank)
"""
from __future__ import annotations

import os
import time
from typing import Iterable, Iterator, Mapping


def slow_loader(batches: Iterable, rank: int,
                env: Mapping[str, str] = os.environ) -> Iterable:
    """`batches`, delayed on the rank DSPRETRAIN_TEST_SLOW_LOADER names (unchanged otherwise)."""
    spec = env.get("DSPRETRAIN_TEST_SLOW_LOADER")
    if not spec:
        return batches
    slow_rank, seconds = spec.split(":")
    if int(slow_rank) != rank:
        return batches
    return _delayed(batches, float(seconds))


def _delayed(batches: Iterable, seconds: float) -> Iterator:
    for batch in batches:
        time.sleep(seconds)
        yield batch
