"""Training and eval samples from a dataset directory's memory-mapped shards, and their loaders.

Layouts (`DataSpec.packing`):
- "concat" (default; RoBERTa full-sentences for MLM, GPT style for CLM): the split's shards are
  one logical token stream, documents back to back with their end-of-document tokens kept;
  sample w is tokens [w*seq_len, (w+1)*seq_len) of it (a window may span two shards, so small
  shards lose nothing), the tail < seq_len is dropped. attention_mask is all ones.
- "doc" (the paper's layout): sample d is document d alone, truncated to seq_len and padded.
  MLM: [CLS] first when the manifest has `cls_token_id` (unless the document already starts with
  it), and a truncated document keeps its end-of-document token ([SEP]) last, BERT's layout.
  CLM: plain truncation (a forced EOS would teach the model to stop mid-text).
  attention_mask is 1 on the document's tokens, 0 on padding.

Labels: MLM, see app.masking (-100 off the selected positions); CLM, labels = input_ids (Hugging
Face causal LMs shift internally) with -100 on padding.

Start-up reads only the shard headers: O(#shards), never O(#documents) or O(#tokens); a document
is found through the shard's own memory-mapped .idx (Megatron's sizes/pointers/doc_idx).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from app.masking import EVAL_STREAM, IGNORE_INDEX, TRAIN_STREAM, Masker, sample_rng
from app.order import Permutation, check_batch_geometry, eval_positions, rank_positions
from data_tools.errors import UserError
from data_tools.indexed import FormatError, IndexedShard
from data_tools.manifest import MANIFEST, TOKENIZER_DIR, load_manifest, shard_prefixes

OBJECTIVES = ("mlm", "clm")
PACKINGS = ("concat", "doc")


@dataclass(frozen=True)
class DataSpec:
    """What the loader needs to know; special token ids and vocab size come from dataset.json."""

    dataset_dir: Path
    """Dataset directory (with dataset.json), ideally on node-local disk."""
    split: str
    """Split name in dataset.json: "train" or "val"."""
    seq_len: int
    """Tokens per sample."""
    objective: str
    """"mlm" (BERT-like, masked) or "clm" (GPT-like, next token)."""
    packing: str = "concat"
    """"concat": windows cut across documents; "doc": one document per sample."""
    seed: int = 0
    """Keys the sample order (with the epoch) and the MLM masks (with the sample position)."""
    mask_prob: float = 0.15
    """Share of non-special tokens selected for MLM."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dataset_dir", Path(self.dataset_dir))
        if self.objective not in OBJECTIVES:
            raise UserError(f"objective {self.objective!r}: expected one of "
                            f"{', '.join(OBJECTIVES)}")
        if self.packing not in PACKINGS:
            raise UserError(f"packing {self.packing!r}: expected one of {', '.join(PACKINGS)}")
        if self.seq_len < 2:
            raise UserError(f"seq_len {self.seq_len}: must be at least 2")
        if not 0.0 < self.mask_prob < 1.0:
            raise UserError(f"mask_prob {self.mask_prob}: must be between 0 and 1 (exclusive)")


def _special_ids(dataset_dir: Path, manifest: dict[str, Any]) -> set[int]:
    """Ids MLM never selects or draws: the manifest's named ones and the tokenizer's specials."""
    ids = {manifest.get(k) for k in ("eod_token_id", "pad_token_id", "mask_token_id",
                                     "cls_token_id", "unk_token_id", "bos_token_id")}
    ids.update(manifest.get("special_token_ids") or [])
    tok_json = dataset_dir / manifest["tokenizer"].get("dir", TOKENIZER_DIR) / "tokenizer.json"
    if tok_json.is_file():
        try:
            with open(tok_json) as f:
                added = json.load(f).get("added_tokens") or []
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"{tok_json}: cannot read the tokenizer ({e})") from None
        ids.update(t["id"] for t in added if t.get("special") and isinstance(t.get("id"), int))
    return {int(i) for i in ids if isinstance(i, int)}


class TokenWindows(Dataset):
    """Map-style: item p (a position in the infinite sample stream) -> one sample dict.

    Position p reads sample `Permutation(num_samples, seed, p // num_samples)(p % num_samples)`;
    MLM masks are keyed by (seed, p), so each epoch masks afresh (dynamic masking). With
    `eval_order=True` the order is the identity and masks are keyed by the sample index on a
    separate random stream, so every eval pass sees the same samples with the same masks.
    Shards are memory-mapped lazily, in whichever process reads first (each loader worker).
    """

    def __init__(self, spec: DataSpec, manifest: dict | None = None, *, eval_order: bool = False):
        self.spec = spec
        self.eval_order = eval_order
        self.manifest = manifest if manifest is not None else load_manifest(spec.dataset_dir)
        where = f"{spec.dataset_dir / MANIFEST}"
        if spec.split not in self.manifest["splits"]:
            raise UserError(f"{where}: no split '{spec.split}' (has: "
                            f"{', '.join(sorted(self.manifest['splits']))})")
        self.vocab_size = int(self.manifest["vocab_size"])
        self.eod_id = int(self.manifest["eod_token_id"])
        pad = self.manifest.get("pad_token_id")
        self.pad_id = int(pad) if pad is not None else self.eod_id  # padding is masked out anyway
        cls = self.manifest.get("cls_token_id")
        self.cls_id = int(cls) if cls is not None else None
        self.masker = None
        if spec.objective == "mlm":
            mask = self.manifest.get("mask_token_id")
            if mask is None:
                raise UserError(f"{where}: key 'mask_token_id' is null: the tokenizer has no mask "
                                f"token, so this dataset cannot train MLM (use --objective clm)")
            self.masker = Masker(mask_token_id=int(mask), vocab_size=self.vocab_size,
                                 special_ids=_special_ids(spec.dataset_dir, self.manifest),
                                 mask_prob=spec.mask_prob)
        self.shards = []
        entries = self.manifest["splits"][spec.split]["shards"]
        for entry, prefix in zip(entries, shard_prefixes(spec.dataset_dir, self.manifest,
                                                         spec.split)):
            try:
                shard = IndexedShard(prefix)
            except FormatError as e:
                raise UserError(str(e)) from None
            if shard.bin_bytes != entry["bin_bytes"]:  # O(1) guard; full check: inspect --verify
                raise UserError(f"{prefix}.bin: {shard.bin_bytes} bytes, {where} says "
                                f"{entry['bin_bytes']} (truncated or replaced; re-stage or "
                                f"run `python -m data_tools inspect --verify`)")
            self.shards.append(shard)
        # O(#shards) bookkeeping from the headers only
        tokens = np.array([s.num_tokens for s in self.shards], dtype=np.int64)
        docs = np.array([max(s.num_doc_idx - 1, 0) for s in self.shards], dtype=np.int64)
        self.token_starts = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        self.doc_starts = np.concatenate([[0], np.cumsum(docs)]).astype(np.int64)
        self.num_tokens = int(self.token_starts[-1])
        self.num_documents = int(self.doc_starts[-1])
        if spec.packing == "concat":
            self.num_samples = self.num_tokens // spec.seq_len
        else:
            self.num_samples = self.num_documents
        if self.num_samples == 0:
            raise UserError(f"{spec.dataset_dir}: split '{spec.split}' has {self.num_tokens} "
                            f"tokens in {self.num_documents} documents: not one sample of seq_len "
                            f"{spec.seq_len} with packing '{spec.packing}'")
        self._perm: Permutation | None = None

    def __len__(self) -> int:
        return self.num_samples

    # -- order ------------------------------------------------------------------------------

    def sample_index(self, position: int) -> int:
        """Which sample stream position `position` reads."""
        epoch, offset = divmod(position, self.num_samples)
        if self.eval_order:
            return offset
        if self._perm is None or self._perm.epoch != epoch:
            self._perm = Permutation(self.num_samples, self.spec.seed, epoch)
        return self._perm(offset)

    # -- token access ---------------------------------------------------------------------------

    def _read_tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split's logical stream, crossing shard ends if needed."""
        pieces = []
        s = int(np.searchsorted(self.token_starts, start, side="right")) - 1
        while start < stop:
            local = start - int(self.token_starts[s])
            take = min(stop, int(self.token_starts[s + 1])) - start
            if take > 0:
                pieces.append(self.shards[s].tokens[local:local + take])
                start += take
            s += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _document(self, d: int, limit: int) -> tuple[np.ndarray, int]:
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
        return shard.tokens[start:min(end, start + limit)], end - start

    # -- samples --------------------------------------------------------------------------------

    def __getitem__(self, position: int) -> dict[str, torch.Tensor]:
        position = int(position)
        if position < 0:
            raise IndexError(f"stream position {position} is negative")
        index = self.sample_index(position)
        seq_len = self.spec.seq_len
        if self.spec.packing == "concat":
            ids = self._read_tokens(index * seq_len, (index + 1) * seq_len).astype(np.int64)
            length = seq_len
        else:
            ids, length = self._doc_sample(index)
        attention = np.zeros(seq_len, dtype=np.int64)
        attention[:length] = 1
        if self.masker is not None:
            key = (index, EVAL_STREAM) if self.eval_order else (position, TRAIN_STREAM)
            ids, labels = self.masker(ids, sample_rng(self.spec.seed, *key), length=length)
        else:
            labels = ids.copy()
            labels[length:] = IGNORE_INDEX
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(attention),
                "labels": torch.from_numpy(labels)}

    def _doc_sample(self, index: int) -> tuple[np.ndarray, int]:
        """Document `index` laid out in seq_len tokens (see the module docstring); (ids, length)."""
        seq_len = self.spec.seq_len
        out = np.full(seq_len, self.pad_id, dtype=np.int64)
        doc, full = self._document(index, seq_len)
        if self.masker is None:  # CLM: truncate
            out[:doc.size] = doc
            return out, int(doc.size)
        head = 0
        if self.cls_id is not None and not (doc.size and int(doc[0]) == self.cls_id):
            out[0] = self.cls_id
            head = 1
        body = doc[:seq_len - head]
        out[head:head + body.size] = body
        length = head + body.size
        if full + head > seq_len:  # truncated: keep [SEP]/EOD last, as BERT does
            out[length - 1] = self.eod_id
        return out, length

    def stats(self) -> dict[str, Any]:
        """Figures to print at start-up (derived from headers only)."""
        tokens_per_epoch = (self.num_samples * self.spec.seq_len if self.spec.packing == "concat"
                            else None)
        return {"split": self.spec.split, "objective": self.spec.objective,
                "packing": self.spec.packing, "seq_len": self.spec.seq_len,
                "shards": len(self.shards), "documents": self.num_documents,
                "tokens": self.num_tokens, "num_samples": self.num_samples,
                "sample_tokens_per_epoch": tokens_per_epoch,
                "dropped_tail_tokens": (self.num_tokens - tokens_per_epoch
                                        if tokens_per_epoch is not None else None),
                "vocab_size": self.vocab_size}


def dataset_stats(spec: DataSpec, manifest: dict | None = None) -> dict[str, Any]:
    """num_samples, tokens and layout of a split, for start-up printing."""
    return TokenWindows(spec, manifest).stats()


class StreamSampler(Sampler[int]):
    """This rank's stream positions from `consumed_samples` on, forever, in O(1) memory."""

    def __init__(self, consumed_samples: int, global_batch: int, dp_rank: int, dp_size: int):
        self.consumed_samples = consumed_samples
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __iter__(self) -> Iterator[int]:
        return rank_positions(self.consumed_samples, self.global_batch, self.dp_rank, self.dp_size)


def default_num_workers(local_world_size: int = 1) -> int:
    """Loader workers per rank: 2 when each rank has cores to spare, else fewer (0 = in-process).

    A sample costs ~0.15 ms to build but a worker's batch ~1 ms to hand over, so workers help
    only with idle cores and big batches; two cover a GPU step (docs/benchmarks.md, "loader").
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(0, min(2, (cores or 1) // max(1, local_world_size) - 1))


SAMPLE_KEYS = ("input_ids", "attention_mask", "labels")


def _pack(samples: list[dict[str, torch.Tensor]]) -> np.ndarray:
    """Collate a micro batch into one int32 [3, batch, seq_len] array.

    A worker hands over one small numpy array, pickled through the worker's pipe: ~1 ms on CPU,
    where a tensor (a shared-memory file and a passed descriptor per storage) took ~2-3 ms
    (docs/benchmarks.md, "loader"). Ids and labels (-100) fit in int32.
    """
    return np.stack([np.stack([s[k].numpy() for s in samples]) for k in SAMPLE_KEYS]
                    ).astype(np.int32, copy=False)


def _pack_pinned(samples: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """As `_pack`, as an int64 tensor: DataLoader's pinning thread pins it off the training
    thread, and nothing converts it afterwards (a conversion would lose the pinning)."""
    return torch.stack([torch.stack([s[k] for s in samples]) for k in SAMPLE_KEYS])


class MicroBatches:
    """Iterable of micro-batch dicts (int64 tensors) over a DataLoader of packed batches."""

    def __init__(self, loader: DataLoader):
        self.loader = loader

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        packed = iter(self.loader)  # now, not at the first next(): workers start here
        return (_unpack(p) for p in packed)


def _unpack(packed: np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
    if isinstance(packed, np.ndarray):
        packed = torch.from_numpy(packed).to(torch.int64)  # as embeddings and losses expect
    return dict(zip(SAMPLE_KEYS, packed.unbind(0)))  # views: pinning kept


def _loader(dataset: Dataset, sampler: Iterable[int], micro_batch: int, num_workers: int,
            pin_memory: bool, prefetch_factor: int) -> MicroBatches:
    if num_workers < 0:
        raise UserError(f"--num-workers {num_workers}: must be 0 or more")
    extra = {}
    if num_workers > 0:
        extra = {"persistent_workers": True, "prefetch_factor": prefetch_factor}
    # A private generator: DataLoader draws its workers' base seed from it on every iter(),
    # which would otherwise advance the global torch RNG (dropout) and break exact resume.
    generator = torch.Generator().manual_seed(0)
    return MicroBatches(DataLoader(dataset, batch_size=micro_batch, sampler=sampler,
                                   num_workers=num_workers,
                                   collate_fn=_pack_pinned if pin_memory else _pack,
                                   pin_memory=pin_memory, drop_last=False, generator=generator,
                                   **extra))


def build_train_loader(spec: DataSpec, *, micro_batch: int, global_batch: int, dp_rank: int,
                       dp_size: int, consumed_samples: int, num_workers: int,
                       pin_memory: bool = False, prefetch_factor: int = 4,
                       manifest: dict | None = None) -> MicroBatches:
    """Infinite iterator of this rank's micro batches, starting at global sample `consumed_samples`.

    Global batch g = stream positions [g*GBS, (g+1)*GBS); rank r takes the contiguous slice
    [g*GBS + r*GBS/dp, g*GBS + (r+1)*GBS/dp), split into micro batches in order. The epoch
    boundary is crossed inside a batch like any other position.
    """
    check_batch_geometry(global_batch, micro_batch, dp_size, consumed_samples)
    dataset = TokenWindows(spec, manifest)
    if not 0 <= dp_rank < dp_size:
        raise UserError(f"data-parallel rank {dp_rank} outside [0, {dp_size})")
    sampler = StreamSampler(consumed_samples, global_batch, dp_rank, dp_size)
    return _loader(dataset, sampler, micro_batch, num_workers, pin_memory, prefetch_factor)


def build_eval_loader(spec: DataSpec, *, micro_batch: int, dp_rank: int, dp_size: int,
                      max_samples: int | None, num_workers: int, pin_memory: bool = False,
                      prefetch_factor: int = 4, manifest: dict | None = None) -> MicroBatches:
    """One deterministic pass over (up to `max_samples` of) the split, same masks every time.

    Samples in stored order (identity; the val split is already a sample of the corpus); every
    rank gets the same number of micro batches, the last ones wrapping to the split's start, so
    a few samples may count twice when the sample count does not divide evenly.
    """
    check_batch_geometry(micro_batch * dp_size, micro_batch, dp_size)
    if not 0 <= dp_rank < dp_size:
        raise UserError(f"data-parallel rank {dp_rank} outside [0, {dp_size})")
    if max_samples is not None and max_samples < 1:
        raise UserError(f"eval max_samples {max_samples}: must be at least 1")
    dataset = TokenWindows(spec, manifest, eval_order=True)
    total = dataset.num_samples if max_samples is None else min(max_samples, dataset.num_samples)
    positions = eval_positions(total, micro_batch, dp_rank, dp_size)
    return _loader(dataset, _Wrapped(positions, total), micro_batch, num_workers, pin_memory,
                   prefetch_factor)


class _Wrapped:
    """positions modulo `total`, lazily (an eval pass over a huge split needs no list)."""

    def __init__(self, positions: range, total: int):
        self.positions, self.total = positions, total

    def __iter__(self) -> Iterator[int]:
        return (p % self.total for p in self.positions)

    def __len__(self) -> int:
        return len(self.positions)
