"""`data_tools prepare`: format, split, determinism across workers, interop, bad input."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from data_tools.indexed import IndexedShard
from data_tools.manifest import load_manifest, shard_prefixes


def _documents(dataset: Path, split: str) -> list[np.ndarray]:
    m = load_manifest(dataset)
    return [np.array(doc) for p in shard_prefixes(dataset, m, split) for doc in IndexedShard(p)]


def test_fixture_datasets_hold_the_tokenized_corpus(mlm_dataset, clm_dataset, stdlib_dir):
    files = sorted(stdlib_dir.rglob("*.py"))
    for dataset in (mlm_dataset, clm_dataset):
        m = load_manifest(dataset)
        tok = Tokenizer.from_file(str(dataset / "tokenizer" / "tokenizer.json"))
        docs = _documents(dataset, "train") + _documents(dataset, "val")
        assert m["splits"]["val"]["documents"] >= 1
        assert len(docs) == m["documents"] == sum(1 for f in files if f.stat().st_size)
        assert all(d[-1] == m["eod_token_id"] for d in docs)
