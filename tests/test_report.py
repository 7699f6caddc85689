"""`app report`: summary lines and the curves picture from a run directory's metrics.jsonl."""
from __future__ import annotations

import json

from app.__main__ import main as app_main


def write_run(run_dir, rows, tail=""):
    run_dir.mkdir()
    text = "".join(json.dumps(r) + "\n" for r in rows) + tail
    (run_dir / "metrics.jsonl").write_text(text)


ROWS = [{"step": s, "tokens_seen": s * 2048, "train/loss": 8.0 - s / 100, "train/lr": 1e-3,
         "perf/tokens_per_sec": 2e4} for s in (10, 20, 30)]
ROWS.insert(2, {"step": 20, "tokens_seen": 40960, "eval/loss": 7.5, "eval/accuracy": 0.1,
                "eval/perplexity": 1808.0})


def test_report_prints_the_fall_and_writes_a_png(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, ROWS, tail='{"step": 40, "tokens_')  # a run killed mid-write: torn last line
    assert app_main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "train/loss 7.900 (step 10) -> 7.700 (step 30)" in out
    assert "eval/accuracy 0.100" in out
    png = run / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_report_refuses_a_broken_line_and_a_missing_run(tmp_path, one_line_error):
    run = tmp_path / "run"
    write_run(run, ROWS[:1], tail="not json\n" + json.dumps(ROWS[1]) + "\n")
    assert app_main(["report", str(run)]) == 2
    one_line_error("metrics.jsonl: line 2: not valid JSON")
    assert app_main(["report", str(tmp_path / "nope")]) == 2
    one_line_error("no metrics.jsonl")
