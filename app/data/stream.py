"""A split of a dataset as one logical token stream over its memory-mapped shards.

Opening reads only the shard headers: O(#shards), never O(#documents) or O(#tokens). Tokens and
documents are found through each shard's own memory-mapped .idx (Megatron's sizes/pointers/
doc_idx), lazily, in whichever process reads first (each loader worker maps its own).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from data_tools.errors import UserError
from data_tools.indexed import FormatError, IndexedShard
from data_tools.manifest import MANIFEST, shard_prefixes


class TokenStream:
    """The shards of one split, back to back: documents with their end-of-document tokens."""

    def __init__(self, dataset_dir: Path, manifest: dict[str, Any], split: str):
        where = Path(dataset_dir) / MANIFEST
        if split not in manifest["splits"]:
            raise UserError(f"{where}: no split '{split}' (has: "
                            f"{', '.join(sorted(manifest['splits']))})")
        self.shards: list[IndexedShard] = []
        entries = manifest["splits"][split]["shards"]
        for entry, prefix in zip(entries, shard_prefixes(dataset_dir, manifest, split)):
            try:
                shard = IndexedShard(prefix)
            except FormatError as e:
                raise UserError(str(e)) from None
            if shard.bin_bytes != entry["bin_bytes"]:  # O(1) guard; full check: inspect --verify
                raise UserError(f"{prefix}.bin: {shard.bin_bytes} bytes, {where} says "
                                f"{entry['bin_bytes']} (truncated or replaced; re-stage or "
                                f"run `python -m data_tools inspect --verify`)")
            self.shards.append(shard)
        tokens = np.array([s.num_tokens for s in self.shards], dtype=np.int64)
        docs = np.array([max(s.num_doc_idx - 1, 0) for s in self.shards], dtype=np.int64)
        self.token_starts = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        self.doc_starts = np.concatenate([[0], np.cumsum(docs)]).astype(np.int64)
        self.num_tokens = int(self.token_starts[-1])
        self.num_documents = int(self.doc_starts[-1])

    def shard_of_token(self, offset: int) -> IndexedShard:
        return self.shards[int(np.searchsorted(self.token_starts, offset, side="right")) - 1]

    def shard_of_document(self, d: int) -> IndexedShard:
        return self.shards[int(np.searchsorted(self.doc_starts, d, side="right")) - 1]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, crossing shard ends if needed."""
        pieces = []
        s = int(np.searchsorted(self.token_starts, start, side="right")) - 1
        while start < stop:
            local = start - int(self.token_starts[s])
            take = min(stop, int(self.token_starts[s + 1])) - start
            if take > 0:
                self.shards[s].check_extent(local + take)  # cut under the run: not a SIGBUS
                pieces.append(self.shards[s].tokens[local:local + take])
                start += take
            s += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def document(self, d: int, limit: int) -> tuple[np.ndarray, int]:
        """The first `limit` tokens of document d, and the document's full length."""
        s = int(np.searchsorted(self.doc_starts, d, side="right")) - 1
        shard = self.shards[s]
        local = d - int(self.doc_starts[s])
        first, last = (int(v) for v in shard.doc_idx[local:local + 2])  # sequences of the doc
        if last <= first:
            return np.zeros(0, dtype=shard.dtype), 0
        itemsize = shard.dtype.itemsize
        start = int(shard.pointers[first]) // itemsize
        end = int(shard.pointers[last - 1]) // itemsize + int(shard.sizes[last - 1])
        shard.check_extent(min(end, start + limit))  # cut under the run: not a SIGBUS
        return shard.tokens[start:min(end, start + limit)], end - start
