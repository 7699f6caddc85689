"""Seconds each test file took in a whole-suite run, read back by tests/conftest.py to hand the
heaviest files to the pytest-xdist workers first: with whole files a worker (`--dist loadfile`),
a long file left for last keeps one worker busy while the other waits (xdist's own order is most
tests first, and the longest files here have few tests). Stale figures only cost balance.

    python -m pytest --junitxml=run.xml ...; python tests/file_seconds.py run.xml
"""
from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

STORE = Path(__file__).with_name("file_seconds.json")


def load() -> dict[str, float]:
    """test file name (test_x.py) -> seconds; empty where there is no store."""
    try:
        return json.loads(STORE.read_text())
    except (OSError, ValueError):
        return {}


def main(junit: str) -> int:
    seconds: collections.Counter[str] = collections.Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.test_x[.TestClass]
        name = next((p for p in parts if p.startswith("test_")), parts[-1]) + ".py"
        seconds[name] += float(case.get("time") or 0)
    STORE.write_text(json.dumps({k: round(v, 1) for k, v in seconds.most_common()}, indent=0)
                     + "\n")
    print(f"{STORE}: {len(seconds)} files, {sum(seconds.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
