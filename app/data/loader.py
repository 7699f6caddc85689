"""Training and eval samples from a dataset directory, and the loaders that feed them.

A sample is made in three steps, each in its own module: the split's shards read as one token stream
(app.data.stream), cut into samples by the packing (app.data.packing: "concat" windows across
documents, "doc", one document per sample, or "doc-packed", whole documents side by side in a
window by a plan made once per split), then, for MLM, masked (app.data.masking; "doc-packed"
masks each document as "doc" would). Which
sample a stream position reads is the order (app.data.order): a keyed permutation per epoch. A
weighted mixture of datasets (MixtureSpec, MixedWindows) first picks the source and its own position
(app.data.mixture), then reads that source like a lone dataset.

Labels: MLM, see app.data.masking (IGNORE_INDEX off the selected positions); CLM, labels = input_ids
(Hugging Face causal LMs shift internally) with IGNORE_INDEX on padding.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from app.data import packing
from app.data.masking import EVAL_STREAM, IGNORE_INDEX, TRAIN_STREAM, Masker, mlm_slots, sample_keys
from app.data.mixture import Mixture
from app.data.order import (
    GOLDEN,
    Permutation,
    check_batch_geometry,
    check_rank,
    eval_positions,
    mix64_np,
    rank_positions,
)
from app.data.stream import TokenStream
from app.runtime.device import cpu_share
from data_tools.errors import UserError
from data_tools.indexed import ShardChanged
from data_tools.manifest import MANIFEST, load_manifest, special_ids

OBJECTIVES = ("mlm", "clm")


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
    """"concat": windows cut across documents; "doc": one document per sample; "doc-packed":
    whole documents side by side in a window (MLM)."""
    seed: int = 0
    """Keys the sample order (with the epoch) and the MLM masks (with the sample position)."""
    mask_prob: float = 0.15
    """Share of non-special tokens selected for MLM."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dataset_dir", Path(self.dataset_dir))
        if self.objective not in OBJECTIVES:
            raise UserError(f"objective {self.objective!r}: expected one of "
                            f"{', '.join(OBJECTIVES)}")
        if self.packing not in packing.PACKINGS:
            raise UserError(f"packing {self.packing!r}: expected one of "
                            f"{', '.join(packing.PACKINGS)}")
        if self.seq_len < 2:
            raise UserError(f"seq_len {self.seq_len}: must be at least 2")
        if not 0.0 < self.mask_prob < 1.0:
            raise UserError(f"mask_prob {self.mask_prob}: must be between 0 and 1 (exclusive)")
        if self.packing == "doc-packed" and self.objective != "mlm":
            raise UserError("--packing doc-packed: for MLM encoders (a decoder would need a "
                            "block-causal mask); use --packing doc or concat with objective "
                            f"{self.objective}")


@dataclass(frozen=True)
class MixtureSpec:
    """A weighted mixture: one DataSpec per source (its directory and its own seed; the sample
    geometry shared), the sources' names and weights."""

    sources: tuple[DataSpec, ...]
    names: tuple[str, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        first = self.sources[0]
        for s in self.sources[1:]:
            if (s.split, s.seq_len, s.objective, s.packing, s.mask_prob) != (
                    first.split, first.seq_len, first.objective, first.packing, first.mask_prob):
                raise ValueError("the sources of a mixture must share the sample geometry")

    # the shared geometry, as a DataSpec has it (BatchLayout.of reads these)
    split = property(lambda self: self.sources[0].split)
    seq_len = property(lambda self: self.sources[0].seq_len)
    objective = property(lambda self: self.sources[0].objective)
    packing = property(lambda self: self.sources[0].packing)
    mask_prob = property(lambda self: self.sources[0].mask_prob)


def masker_for(spec: DataSpec, manifest: dict[str, Any]) -> Masker | None:
    """The MLM masking of this dataset (None for CLM)."""
    if spec.objective != "mlm":
        return None
    mask = manifest.get("mask_token_id")
    if mask is None:
        raise UserError(f"{spec.dataset_dir / MANIFEST}: key 'mask_token_id' is null: the "
                        f"tokenizer has no mask token, so this dataset cannot train MLM (use "
                        f"--objective clm)")
    return Masker(mask_token_id=int(mask), vocab_size=int(manifest["vocab_size"]),
                  special_ids=special_ids(spec.dataset_dir, manifest), mask_prob=spec.mask_prob)


_PLANS: dict[tuple, packing.PackPlan] = {}


def pack_plan_of(spec: DataSpec, stream: TokenStream, cls_id: int | None,
                 eval_order: bool) -> packing.PackPlan:
    """The "doc-packed" plan of a split (packing.pack_plan), made once a process: a pure function
    of the documents' lengths, seq_len and the seed (eval: the stored order). A window holds at
    most packing.window_docs(seq_len) documents: that bounds the masked positions of a
    window."""
    key = (str(spec.dataset_dir), spec.split, spec.seq_len, None if eval_order else spec.seed)
    if key not in _PLANS:
        lengths = packing.layout_lengths(stream, spec.seq_len, cls_id=cls_id, bert_layout=True)
        _PLANS[key] = packing.pack_plan(lengths, spec.seq_len, seed=key[3],
                                        max_docs=packing.window_docs(spec.seq_len))
    return _PLANS[key]


class TokenWindows(Dataset):
    """Map-style: item p (a position in the infinite sample stream) -> one sample dict.

    Position p reads sample `Permutation(num_samples, seed, p // num_samples)(p % num_samples)`;
    MLM masks are keyed by (seed, p), so each epoch masks afresh (dynamic masking). With
    `eval_order=True` the order is the identity and masks are keyed by the sample index on a
    separate random stream, so every eval pass sees the same samples with the same masks.
    """

    def __init__(self, spec: DataSpec, manifest: dict | None = None, *, eval_order: bool = False):
        self.spec = spec
        self.eval_order = eval_order
        manifest = manifest if manifest is not None else load_manifest(spec.dataset_dir)
        self.vocab_size = int(manifest["vocab_size"])
        self.eod_id = int(manifest["eod_token_id"])
        pad = manifest.get("pad_token_id")
        self.pad_id = int(pad) if pad is not None else self.eod_id  # padding is masked out anyway
        cls = manifest.get("cls_token_id")
        self.cls_id = int(cls) if cls is not None else None
        self.masker = masker_for(spec, manifest)
        self.stream = TokenStream(spec.dataset_dir, manifest, spec.split)
        self.num_samples = packing.count_samples(
            self.stream.num_tokens, self.stream.num_documents, spec.seq_len, spec.packing,
            dataset_dir=spec.dataset_dir, split=spec.split)
        self.plan = None
        if spec.packing == "doc-packed":
            self.plan = pack_plan_of(spec, self.stream, self.cls_id, eval_order)
            self.num_samples = self.plan.windows
        self._perm: Permutation | None = None

    @property
    def max_docs(self) -> int:
        """The most documents a sample holds (1 but with "doc-packed")."""
        return self.plan.max_docs if self.plan is not None else 1

    @property
    def shards(self):
        return self.stream.shards

    def __len__(self) -> int:
        return self.num_samples

    def sample_index(self, position: int) -> int:
        """Which sample stream position `position` reads."""
        epoch, offset = divmod(position, self.num_samples)
        if self.eval_order:
            return offset
        if self._perm is None or self._perm.epoch != epoch:
            self._perm = Permutation(self.num_samples, self.spec.seed, epoch)
        return self._perm(offset)

    def __getitem__(self, position: int) -> dict[str, torch.Tensor]:
        """The sample at `position` (int64 tensors); for a corrupt one (ids past the vocabulary)
        `{"error": ...}`, which the loader raises as one line in the training process
        (app.data.loader.BatchLayout)."""
        batch = self.batch([position])
        return batch if "error" in batch else {k: torch.from_numpy(v[0]) for k, v in batch.items()}

    def __getitems__(self, positions: list[int]) -> dict[str, Any]:
        """DataLoader's batched fetch: the micro batch at once (`batch`)."""
        return self.batch(positions)

    def batch(self, positions) -> dict[str, Any]:
        """The samples at `positions` as [len, seq_len] int64 arrays (`input_ids`,
        `attention_mask`, `labels`), MLM masking vectorised over them (row r is masked exactly
        as that sample alone); `{"error": ...}` when one is corrupt, or a shard was cut short
        under the run (raised as one line in the training process, as a corrupt sample is)."""
        try:
            return self._batch(positions)
        except ShardChanged as e:
            return {"error": str(e)}

    def _batch(self, positions) -> dict[str, Any]:
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if positions.size and positions.min() < 0:
            raise IndexError(f"stream position {int(positions.min())} is negative")
        # one index at a time: for a micro batch, Python ints beat numpy's per-call overhead
        indices = np.array([self.sample_index(p) for p in positions.tolist()], dtype=np.int64)
        if self.plan is not None:
            return self._packed_batch(positions, indices)
        seq_len = self.spec.seq_len
        ids = np.empty((positions.size, seq_len), dtype=np.int64)
        lengths = np.full(positions.size, seq_len, dtype=np.int64)
        for row, index in enumerate(indices.tolist()):
            if self.spec.packing == "concat":
                ids[row], _ = packing.concat_sample(self.stream, index, seq_len)
            else:
                ids[row], lengths[row] = packing.doc_sample(
                    self.stream, index, seq_len, pad_id=self.pad_id, eod_id=self.eod_id,
                    cls_id=self.cls_id, bert_layout=self.masker is not None)
        if ids.max(initial=0) >= self.vocab_size:  # one vectorised check: rot found in training
            row = int(np.argmax((ids >= self.vocab_size).any(axis=1)))
            return {"error": self._corrupt(ids[row], int(indices[row]), int(positions[row]))}
        attention = (np.arange(seq_len) < lengths[:, None]).astype(np.int64)
        if self.masker is not None:
            keys = (sample_keys(self.spec.seed, indices, EVAL_STREAM) if self.eval_order
                    else sample_keys(self.spec.seed, positions, TRAIN_STREAM))
            ids, labels = self.masker.mask_batch(ids, lengths, keys)
        else:
            labels = np.where(attention == 1, ids, IGNORE_INDEX)
        return {"input_ids": ids, "attention_mask": attention, "labels": labels,
                "tokens": lengths.reshape(-1, 1)}

    def _packed_batch(self, positions: np.ndarray, windows: np.ndarray) -> dict[str, Any]:
        """"doc-packed": each window's documents laid out and masked one by one exactly as "doc"
        does (the masks keyed by (seed, position, document's place) in training, by the document
        on the eval stream, as "doc" keys its eval samples), then placed side by side
        (packing.place_documents)."""
        assert self.plan is not None  # batch() comes here only with a plan
        seq_len = self.spec.seq_len
        docs = [self.plan.window(int(w)) for w in windows.tolist()]
        owner = np.repeat(np.arange(len(docs)), [d.size for d in docs])
        flat = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
        ids = np.empty((flat.size, seq_len), dtype=np.int64)
        lengths = np.empty(flat.size, dtype=np.int64)
        for row, d in enumerate(flat.tolist()):
            ids[row], lengths[row] = packing.doc_sample(
                self.stream, d, seq_len, pad_id=self.pad_id, eod_id=self.eod_id,
                cls_id=self.cls_id, bert_layout=True)
        if ids.max(initial=0) >= self.vocab_size:
            row = int(np.argmax((ids >= self.vocab_size).any(axis=1)))
            return {"error": self._corrupt(ids[row], int(flat[row]), int(positions[owner[row]]),
                                           document=True)}
        place = np.arange(owner.size) - np.searchsorted(owner, owner)  # place in its window
        keys = (sample_keys(self.spec.seed, flat, EVAL_STREAM) if self.eval_order else
                mix64_np(sample_keys(self.spec.seed, positions[owner], TRAIN_STREAM)
                         + (place.astype(np.uint64) + np.uint64(1)) * np.uint64(GOLDEN)))
        assert self.masker is not None  # "doc-packed" is MLM's (app.data.packing)
        ids, labels = self.masker.mask_batch(ids, lengths, keys)
        return packing.place_documents(ids, labels, lengths, owner, len(docs), seq_len,
                                       pad_id=self.pad_id, ignore=IGNORE_INDEX)

    def _corrupt(self, ids: np.ndarray, index: int, position: int, document: bool = False) -> str:
        at = int(np.argmax(ids >= self.vocab_size))
        what = "document" if document else "sample"
        shard = (self.stream.shard_of_token(index * self.spec.seq_len + at)
                 if self.spec.packing == "concat" else self.stream.shard_of_document(index))
        return (f"{shard.prefix}.bin: token id {int(ids[at])} in {what} {index} (stream position "
                f"{position}) is not below the vocabulary size {self.vocab_size}: the shard is "
                f"corrupt (run `python -m data_tools inspect --verify`, and stage it again)")


class MixedWindows(Dataset):
    """Map-style, like TokenWindows: stream position p -> (source s, its position k) by the
    mixture (app.data.mixture), then source s's own TokenWindows at k (its order, epochs and masks,
    keyed by its own seed). O(1) per sample: two table lookups before the source's read."""

    def __init__(self, spec: MixtureSpec):
        self.spec = spec
        self.mixture = Mixture(spec.weights)
        self.sources = [TokenWindows(s) for s in spec.sources]
        self.max_docs = max(source.max_docs for source in self.sources)

    def __getitem__(self, position: int) -> dict[str, torch.Tensor]:
        s, k = self.mixture.locate(int(position))
        return self.sources[s][k]

    def sample_ids(self, positions: range) -> dict[str, list]:
        """The (source, sample) each position reads, as parallel lists."""
        sources, local = self.mixture.locate_many(np.asarray(positions))
        return {"samples": [self.sources[s].sample_index(k)
                            for s, k in zip(sources.tolist(), local.tolist())],
                "sources": [self.spec.names[s] for s in sources.tolist()]}


def windows(spec: DataSpec | MixtureSpec) -> TokenWindows | MixedWindows:
    """The train samples of a dataset, or of a mixture."""
    return MixedWindows(spec) if isinstance(spec, MixtureSpec) else TokenWindows(spec)


def batch_samples(spec: DataSpec | MixtureSpec, global_batch_index: int,
                  global_batch: int) -> dict[str, list]:
    """The sample ids a global batch reads, and for a mixture their sources (parallel lists):
    what skipped_batches.jsonl records."""
    start = global_batch_index * global_batch
    positions = range(start, start + global_batch)
    data = windows(spec)
    if isinstance(data, MixedWindows):
        return data.sample_ids(positions)
    return {"samples": [data.sample_index(p) for p in positions]}


def dataset_stats(spec: DataSpec, manifest: dict | None = None) -> dict[str, Any]:
    """num_samples and tokens of a split, for start-up printing: from dataset.json's counts,
    without opening a shard (the loaders open them); UserError if the split has no sample."""
    manifest = manifest if manifest is not None else load_manifest(spec.dataset_dir)
    split = manifest["splits"].get(spec.split)
    if split is None or split.get("tokens") is None or split.get("documents") is None:
        stream = TokenStream(spec.dataset_dir, manifest, spec.split)  # counts from the headers
        tokens, documents = stream.num_tokens, stream.num_documents
    else:
        tokens, documents = split["tokens"], split["documents"]
    n = packing.count_samples(tokens, documents, spec.seq_len, spec.packing,
                              dataset_dir=spec.dataset_dir, split=spec.split)
    per_epoch = n * spec.seq_len if spec.packing == "concat" else None
    n, real, span = real_tokens_per_sample(spec, manifest, n)
    return {"split": spec.split, "objective": spec.objective, "packing": spec.packing,
            "seq_len": spec.seq_len, "shards": len(manifest["splits"][spec.split]["shards"]),
            "documents": documents, "tokens": tokens, "num_samples": n,
            "sample_tokens_per_epoch": per_epoch, "real_tokens_per_sample": real,
            "attention_span": span,
            "dropped_tail_tokens": tokens - per_epoch if per_epoch is not None else None,
            "vocab_size": int(manifest["vocab_size"])}


def real_tokens_per_sample(spec: DataSpec, manifest: dict, num_samples: int
                           ) -> tuple[int, float, float]:
    """(samples, mean real tokens of a sample, attention span) of a split: seq_len and seq_len
    with "concat"; with "doc" and "doc-packed" the documents' laid-out tokens (read from the
    shards' index, O(documents)) over the samples ("doc-packed": the plan's windows), what
    --max-tokens counts; and the tokens a real token attends to on average, sum(len^2) /
    sum(len) over the laid-out documents (attention stays in a document), what MFU counts of
    attention (app.telemetry.flops)."""
    if spec.packing == "concat":
        return num_samples, float(spec.seq_len), float(spec.seq_len)
    stream = TokenStream(spec.dataset_dir, manifest, spec.split)
    cls = manifest.get("cls_token_id")
    cls = int(cls) if cls is not None else None
    if spec.packing == "doc-packed":
        plan = pack_plan_of(spec, stream, cls, eval_order=False)
        return (plan.windows, plan.real_tokens / plan.windows,
                plan.squared_tokens / max(plan.real_tokens, 1))
    lengths = packing.layout_lengths(stream, spec.seq_len, cls_id=cls,
                                     bert_layout=spec.objective == "mlm")
    span = float(np.square(lengths, dtype=np.float64).sum() / max(int(lengths.sum()), 1))
    return num_samples, float(lengths.mean()), span


class StreamSampler(Sampler[int]):
    """This rank's stream positions from `consumed_samples` on, forever, in O(1) memory, without
    the global batches in `skip`."""

    def __init__(self, consumed_samples: int, global_batch: int, dp_rank: int, dp_size: int,
                 skip: frozenset[int] = frozenset()):
        self.consumed_samples = consumed_samples
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        return rank_positions(self.consumed_samples, self.global_batch, self.dp_rank,
                              self.dp_size, self.skip)


def default_num_workers(local_world_size: int = 1) -> int:
    """Loader workers per rank: 2 when each rank has cores to spare, else fewer (0 = in-process).

    A sample costs ~0.15 ms to build but a worker's batch ~1 ms to hand over, so workers help
    only with idle cores and big batches; two cover a GPU step (docs/benchmarks.md, "loader").
    The cores are the rank's share of its affinity mask (`app.runtime.device.cpu_share`: not
    divided again where srun or numactl bound each rank to cores of its own).
    """
    share = cpu_share({"LOCAL_WORLD_SIZE": str(max(1, local_world_size))})
    return max(0, min(2, share.cores - 1))  # 0 on an accelerator: said at start (build.py)


class DataFault(UserError):
    """A batch the loader could not make: a corrupt sample, a shard cut short under the run
    (one line naming the shard; app.trainer saves first where it can)."""


@dataclass(frozen=True)
class BatchLayout:
    """What a micro batch hands to the model: arrays of a fixed width per sample.

    MLM: `input_ids`, `mlm_positions` and `mlm_labels` (the masked positions and their original
    tokens, padded to a fixed count with position 0 and IGNORE_INDEX): the model gathers those
    positions with static shapes, where indexing by a boolean mask would sync the host every
    step. CLM: `input_ids` and `labels`. `attention_mask` only with "doc" packing: in "concat"
    every token is attended to, and an all-ones mask costs the model a host sync to find out.
    "doc-packed": `position_ids`, `document_ids` and `doc_lengths` instead (the model makes its
    block-diagonal mask from the ids on the device, app.models.attention.document_attention, or
    with flash-attention its variable-length call from the lengths,
    app.models.attention.varlen_kwargs). "doc" and "doc-packed" add `tokens`, each sample's real
    tokens, which the trainer takes out for the telemetry.
    """

    keys: tuple[str, ...]
    widths: tuple[int, ...]

    @classmethod
    def of(cls, spec: DataSpec, max_docs: int = 1) -> "BatchLayout":
        """`max_docs`: the most documents of a sample ("doc-packed"): each may add one masked
        position to the bound (app.data.masking.mlm_slots)."""
        seq = spec.seq_len
        slots = mlm_slots(seq, spec.mask_prob) + max_docs - 1
        keys: tuple[str, ...]
        widths: tuple[int, ...]
        keys, widths = ((("input_ids", "mlm_positions", "mlm_labels"), (seq, slots, slots))
                        if spec.objective == "mlm" else (("input_ids", "labels"), (seq, seq)))
        if spec.packing == "doc":
            keys, widths = keys + ("attention_mask",), widths + (seq,)
        elif spec.packing == "doc-packed":
            keys = keys + ("position_ids", "document_ids", "doc_lengths")
            widths = widths + (seq, seq, packing.window_docs(seq) + 1)
        if spec.packing in packing.DOC_PACKINGS:  # each sample's real tokens: the telemetry's
            keys, widths = keys + ("tokens",), widths + (1,)
        return cls(keys, widths)

    def columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A micro batch of full-length [B, seq_len] arrays (TokenWindows.batch) in this layout:
        for MLM each row's selected positions in order, then padding (position 0, label
        IGNORE_INDEX)."""
        out = {k: np.asarray(v) for k, v in batch.items() if k in self.keys or k == "labels"}
        if "mlm_positions" in self.keys:
            labels = out.pop("labels")
            slots = self.widths[self.keys.index("mlm_positions")]
            r, c = np.nonzero(labels != IGNORE_INDEX)  # row-major: each row's positions in order
            slot = np.arange(r.size) - np.searchsorted(r, r)  # rank within its row
            out["mlm_positions"] = np.zeros((labels.shape[0], slots), dtype=np.int64)
            out["mlm_positions"][r, slot] = c
            out["mlm_labels"] = np.full((labels.shape[0], slots), IGNORE_INDEX, dtype=np.int64)
            out["mlm_labels"][r, slot] = labels[r, c]
        return out

    def pack(self, samples: list[dict[str, torch.Tensor]] | dict[str, np.ndarray]
             ) -> np.ndarray | str:
        """Collate a micro batch into one flat int32 array: each key's [batch, width] block in
        turn. A worker hands over one small numpy array, pickled through its pipe: ~1 ms on CPU,
        where a tensor (a shared-memory file and a descriptor per storage) took ~2-3 ms
        (docs/benchmarks.md, "loader"). Ids, positions and labels (-100) fit in int32. `samples`
        is a batch of arrays (TokenWindows' batched fetch) or a list of sample dicts (any other
        dataset). A corrupt sample makes the batch its error message instead (raised by
        `unpack`, in the training process: an exception raised in a worker would arrive wrapped
        in its traceback)."""
        if isinstance(samples, dict):
            batch = samples
        else:
            errors = [s["error"] for s in samples if "error" in s]
            batch = {"error": errors[0]} if errors else {
                k: np.stack([s[k].numpy() for s in samples]) for k in samples[0]}
        if "error" in batch:
            return batch["error"]
        columns = self.columns(batch)
        flat = np.concatenate([columns[k].ravel() for k in self.keys])
        return flat.astype(np.int32, copy=False)

    def pack_pinned(self, samples: list[dict[str, torch.Tensor]]) -> torch.Tensor | str:
        """As `pack`, as an int64 tensor: DataLoader's pinning thread pins it off the training
        thread, and nothing converts it afterwards (a conversion would lose the pinning)."""
        packed = self.pack(samples)
        return packed if isinstance(packed, str) else torch.from_numpy(packed.astype(np.int64))

    def unpack(self, packed: np.ndarray | torch.Tensor | str) -> dict[str, torch.Tensor]:
        """The micro batch as int64 tensors: contiguous views of the packed one (pinning kept)."""
        if isinstance(packed, str):
            raise DataFault(packed)
        if isinstance(packed, np.ndarray):
            packed = torch.from_numpy(packed).to(torch.int64)  # as embeddings and losses expect
        batch = packed.numel() // sum(self.widths)
        out, offset = {}, 0
        for key, width in zip(self.keys, self.widths):
            out[key] = packed[offset:offset + batch * width].view(batch, width)
            offset += batch * width
        return out


class MicroBatches:
    """Iterable of micro-batch dicts (int64 tensors) over a DataLoader of packed batches."""

    def __init__(self, loader: DataLoader, layout: BatchLayout):
        self.loader, self.layout = loader, layout

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        packed = iter(self.loader)  # now, not at the first next(): workers start here
        return (self.layout.unpack(p) for p in packed)


# How long a loader worker goes on serving after a SIGTERM: long enough for its rank to reach the
# step boundary where the ranks agree to stop (the save needs no data), short enough that a worker
# the loader itself terminates (a stuck one, at shutdown: torch sends SIGTERM) never hangs the
# rank's exit, which joins its workers.
WORKER_TERM_GRACE_S = 30


def ignore_stop_signals(worker_id: int) -> None:
    """A loader worker's first act: a scheduler signals every process of the job, and a worker
    that died of it would fail its rank's next batch before the rank could save. The rank alone
    answers the signal (app.faults.preemption): SIGUSR1 and SIGINT are ignored here, and a
    SIGTERM ends the worker only WORKER_TERM_GRACE_S later (an alarm with its default action)."""
    for s in (signal.SIGUSR1, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, _term_later)


def _term_later(signum, frame) -> None:
    left = signal.alarm(WORKER_TERM_GRACE_S)
    if left:  # an earlier SIGTERM's alarm stands: a second one does not move the end
        signal.alarm(left)


def _loader(dataset: Dataset, sampler: Iterable[int], micro_batch: int, num_workers: int,
            pin_memory: bool, prefetch_factor: int) -> MicroBatches:
    layout = BatchLayout.of(dataset.spec, dataset.max_docs)
    extra = {}
    if num_workers > 0:
        extra = {"persistent_workers": True, "prefetch_factor": prefetch_factor,
                 "worker_init_fn": ignore_stop_signals}
    # A private generator: DataLoader draws its workers' base seed from it on every iter(),
    # which would otherwise advance the global torch RNG (dropout) and break exact resume.
    generator = torch.Generator().manual_seed(0)
    return MicroBatches(DataLoader(dataset, batch_size=micro_batch, sampler=sampler,
                                   num_workers=num_workers,
                                   collate_fn=layout.pack_pinned if pin_memory else layout.pack,
                                   pin_memory=pin_memory, drop_last=False, generator=generator,
                                   **extra), layout)


def build_train_loader(spec: DataSpec | MixtureSpec, *, micro_batch: int, global_batch: int,
                       dp_rank: int, dp_size: int, consumed_samples: int, num_workers: int,
                       pin_memory: bool = False, prefetch_factor: int = 4,
                       manifest: dict | None = None,
                       skip: frozenset[int] = frozenset()) -> MicroBatches:
    """Infinite iterator of this rank's micro batches, starting at global sample `consumed_samples`.

    Global batch g = stream positions [g*GBS, (g+1)*GBS); rank r takes the contiguous slice
    [g*GBS + r*GBS/dp, g*GBS + (r+1)*GBS/dp), split into micro batches in order. The epoch
    boundary is crossed inside a batch like any other position. A mixture's stream is cut the
    same way: the mixture decides what each position reads (MixedWindows).
    """
    check_batch_geometry(global_batch, micro_batch, dp_size, consumed_samples)
    check_rank(dp_rank, dp_size)
    dataset = TokenWindows(spec, manifest) if isinstance(spec, DataSpec) else windows(spec)
    sampler = StreamSampler(consumed_samples, global_batch, dp_rank, dp_size, skip)
    return _loader(dataset, sampler, micro_batch, num_workers, pin_memory, prefetch_factor)


def build_eval_loader(spec: DataSpec, *, micro_batch: int, dp_rank: int, dp_size: int,
                      max_samples: int | None, num_workers: int, pin_memory: bool = False,
                      prefetch_factor: int = 4, manifest: dict | None = None) -> MicroBatches:
    """One deterministic pass over (up to `max_samples` of) the split, same masks every time.

    Samples in stored order (identity; the val split is already a sample of the corpus). Every
    rank gets the same number of micro batches (collectives in eval never wait on a rank that ran
    out); where the sample count does not divide, the last ones are filler without labels, so
    every validation sample is counted exactly once.
    """
    check_batch_geometry(micro_batch * dp_size, micro_batch, dp_size)
    check_rank(dp_rank, dp_size)
    if max_samples is not None and max_samples < 1:
        raise UserError(f"eval max_samples {max_samples}: must be at least 1")
    dataset = TokenWindows(spec, manifest, eval_order=True)
    total = dataset.num_samples if max_samples is None else min(max_samples, dataset.num_samples)
    positions = eval_positions(total, micro_batch, dp_rank, dp_size)
    return _loader(EvalPass(dataset, total), positions, micro_batch, num_workers, pin_memory,
                   prefetch_factor)


class EvalPass(Dataset):
    """Positions of an eval pass over the first `total` samples: those past the end read a sample
    again (the shapes stay equal) with every label ignored, so no sample counts twice."""

    def __init__(self, samples: TokenWindows, total: int):
        self.samples, self.total, self.spec = samples, total, samples.spec
        self.max_docs = samples.max_docs

    def __getitem__(self, position: int) -> dict[str, torch.Tensor]:
        sample = self.samples[int(position) % self.total]
        if position >= self.total:
            sample["labels"] = torch.full_like(sample["labels"], IGNORE_INDEX)
        return sample

    def __getitems__(self, positions: list[int]) -> dict[str, Any]:
        at = np.asarray(positions, dtype=np.int64)
        batch = self.samples.batch(at % self.total)
        if "error" not in batch:
            batch["labels"][at >= self.total] = IGNORE_INDEX
        return batch
