"""bench/overlap_timeline.py: the phases of a ZeRO-1/2 step read from the reducer's and the
gather's trace lines (as app/runtime/overlap.py and app/runtime/gather.py write them)."""
from __future__ import annotations

import json

import pytest

from bench import overlap_timeline


def _reducer(t0):  # ms after t0 -> seconds, as perf_counter
    s = lambda ms: t0 + ms / 1000  # noqa: E731
    return {"buckets": 2, "events": [("ready", 1, s(0)), ("launch", 1, s(1)), ("ready", 0, s(70)),
                                     ("launch", 0, s(71)), ("backward_end", -1, s(75)),
                                     ("done", 1, s(90)), ("done", 0, s(155))]}


def _gather(t0):
    s = lambda ms: t0 + ms / 1000  # noqa: E731
    return {"chunks": 2, "events": [("launch", 0, s(0)), ("launch", 1, s(1)), ("forward", -1, s(3)),
                                    ("done", 0, s(60)), ("done", 1, s(143))]}


def test_the_phases_of_each_step_from_both_traces(tmp_path):
    # step k: backward at 0, buckets done by 155; the step's gather launched at 200 (a 45 ms
    # optimizer step), forward from 203 to 343, the next backward's first gradient at 351
    reducer = [_reducer(10.0), _reducer(10.351)]
    gather = [_gather(10.2)]
    rows = overlap_timeline.timeline(reducer, gather)
    assert rows[0] == pytest.approx({"backward": 75, "tail": 80, "step": 45, "forward": 140,
                                     "to_backward": 8})
    assert set(rows[1]) == {"backward", "tail"}  # no gather after the last backward
    (tmp_path / "red").write_text("".join(json.dumps(r) + "\n" for r in reducer))
    (tmp_path / "gat").write_text("".join(json.dumps(g) + "\n" for g in gather))
    summary = overlap_timeline.summary(rows, skip=0)
    assert summary["tail"]["median"] == pytest.approx(80) and summary["tail"]["steps"] == 2
    assert summary["step"]["steps"] == 1
    assert overlap_timeline.main([str(tmp_path / "red"), str(tmp_path / "gat"), "--skip", "0"]) == 0
    assert overlap_timeline.main([str(tmp_path / "missing")]) == 2
