"""Packing: how a token stream becomes samples of `seq_len` tokens (docs/design.md, "Samples").

- "concat" (default; RoBERTa full-sentences for MLM, GPT style for CLM): documents back to back
  with their end-of-document tokens kept; sample w is tokens [w*seq_len, (w+1)*seq_len) of the
  stream (a window may span two shards, so small shards lose nothing); the tail < seq_len is
  dropped. Every token is attended to.
- "doc" (the paper's layout): sample d is document d alone, truncated to seq_len and padded.
  MLM (`bert_layout`): [CLS] first when the tokenizer has one (unless the document already
  starts with it), and a truncated document keeps its end-of-document token ([SEP]) last, BERT's
  layout. CLM: plain truncation (a forced EOS would teach the model to stop mid-text). Padding
  is not attended to.
- "doc-packed" (padding-free documents, MLM): whole documents, each laid out exactly as "doc" lays
  it out, placed side by side in windows of seq_len tokens without being cut (ModernBERT's and
  Krell et al.'s packing). A window is a sample: the order, mixtures, ranks and resume treat it
  like any other. Attention stays inside each document (the loader hands over per-token document
  ids, which the model turns into a block-diagonal mask, app.models.attention.document_attention,
  and each window's document lengths, from which flash-attention's variable-length call is summed,
  app.models.attention.varlen_kwargs) and position ids restart at each document, so each
  document's math is that of "doc". Which
  documents share a window is the plan (`PackPlan`): best fit over a keyed shuffle of the
  documents, computed once per split in O(documents), two int arrays.

Each function returns (token ids as int64, length): positions >= length are padding.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.data.order import Permutation
from app.data.stream import TokenStream
from data_tools.errors import UserError

PACKINGS = ("concat", "doc", "doc-packed")
DOC_PACKINGS = ("doc", "doc-packed")
"""The packings that lay out one document at a time (and pad): their samples hold fewer real
tokens than seq_len."""


def count_samples(tokens: int, documents: int, seq_len: int, packing: str, *,
                  dataset_dir: Path, split: str) -> int:
    """Samples in a split of `tokens` tokens in `documents` documents; UserError if none."""
    n = tokens // seq_len if packing == "concat" else documents
    if n == 0:
        raise UserError(f"{dataset_dir}: split '{split}' has {tokens} tokens in {documents} "
                        f"documents: not one sample of seq_len {seq_len} with packing "
                        f"'{packing}'")
    return n


def concat_sample(stream: TokenStream, index: int, seq_len: int) -> tuple[np.ndarray, int]:
    return stream.tokens(index * seq_len, (index + 1) * seq_len).astype(np.int64), seq_len


def doc_sample(stream: TokenStream, index: int, seq_len: int, *, pad_id: int, eod_id: int,
               cls_id: int | None, bert_layout: bool) -> tuple[np.ndarray, int]:
    """Document `index` laid out in seq_len tokens (see the module docstring)."""
    out = np.full(seq_len, pad_id, dtype=np.int64)
    doc, full = stream.document(index, seq_len)
    if not bert_layout:  # CLM: truncate
        out[:doc.size] = doc
        return out, int(doc.size)
    head = 0
    if cls_id is not None and not (doc.size and int(doc[0]) == cls_id):
        out[0] = cls_id
        head = 1
    body = doc[:seq_len - head]
    out[head:head + body.size] = body
    length = head + body.size
    if full + head > seq_len:  # truncated: keep [SEP]/EOD last, as BERT does
        out[length - 1] = eod_id
    return out, length


def window_docs(seq_len: int) -> int:
    """The most documents a "doc-packed" window of seq_len tokens holds (the plan's cap): it
    bounds a window's masked positions and the width of its `doc_lengths`."""
    return max(2, seq_len // 16)


PLAN_EPOCH = -1
"""The order key of the plan's shuffle: apart from every epoch's order of the windows."""


def layout_lengths(stream: TokenStream, seq_len: int, *, cls_id: int | None,
                   bert_layout: bool) -> np.ndarray:
    """Each document's length as `doc_sample` lays it out (int64, one a document), vectorised
    over each shard's index: the document's tokens, plus [CLS] when it does not start with one,
    at most seq_len."""
    out = [np.zeros(0, dtype=np.int64)]
    for shard in stream.shards:
        doc_idx = np.asarray(shard.doc_idx, dtype=np.int64)
        if doc_idx.size < 2:
            continue
        ends = np.concatenate([[0], np.cumsum(np.asarray(shard.sizes, dtype=np.int64))])
        full = ends[doc_idx[1:]] - ends[doc_idx[:-1]]
        head = np.zeros_like(full)
        if bert_layout and cls_id is not None:
            head[:] = 1
            filled = np.nonzero(full > 0)[0]
            first = np.asarray(shard.pointers, dtype=np.int64)[doc_idx[:-1][filled]]
            head[filled] = np.asarray(shard.tokens[first // shard.dtype.itemsize]) != cls_id
        out.append(np.minimum(head + full, seq_len))
    return np.concatenate(out)


@dataclass(frozen=True)
class PackPlan:
    """Which documents each window of "doc-packed" holds: window w is
    `documents[starts[w]:starts[w + 1]]`, in that order: ~5 bytes a document (int32 ids, int64
    window starts)."""

    documents: np.ndarray
    starts: np.ndarray
    real_tokens: int
    """The laid-out tokens of every document (the windows' tokens that are not padding)."""
    squared_tokens: float
    """The sum of the documents' squared lengths: the query-key pairs of attention confined to
    each document (app.telemetry.flops, the attention span)."""
    max_docs: int
    """The most documents of one window (MLM's masked-position width depends on it)."""

    @property
    def windows(self) -> int:
        return int(self.starts.size - 1)

    def window(self, w: int) -> np.ndarray:
        return self.documents[self.starts[w]:self.starts[w + 1]]


def pack_plan(lengths: np.ndarray, seq_len: int, *, seed: int | None,
              max_docs: int) -> PackPlan:
    """Best fit of the documents, in a keyed shuffle (`seed`; None: stored order), into windows
    of `seq_len` tokens: each goes to the open window with the least room that holds it, else
    to a new one; a window closes when full or at `max_docs` documents. O(documents): the open
    windows are kept by their room, and the bits of an int say which rooms have one."""
    n = int(lengths.size)
    order = (np.arange(n, dtype=np.int64) if seed is None or n == 0
             else Permutation(n, seed, PLAN_EPOCH).take(np.arange(n)))
    by_room: list[list[int]] = [[] for _ in range(seq_len + 1)]
    rooms, assign = 0, np.empty(n, dtype=np.int64)
    count: list[int] = []
    for i, length in enumerate(_in_chunks(lengths, order)):
        fits = rooms >> length
        if fits:
            room = length + (fits & -fits).bit_length() - 1
            w = by_room[room].pop()
            if not by_room[room]:
                rooms &= ~(1 << room)
        else:
            room, w = seq_len, len(count)
            count.append(0)
        assign[i] = w
        count[w] += 1
        left = room - length
        if left > 0 and count[w] < max_docs:
            by_room[left].append(w)
            rooms |= 1 << left
    grouped = np.argsort(assign, kind="stable")  # by window, shuffled order within
    starts = np.concatenate([[0], np.cumsum(np.bincount(assign, minlength=len(count)))])
    documents = order[grouped].astype(np.int32 if n < 2**31 else np.int64)
    return PackPlan(documents=documents, starts=starts.astype(np.int64),
                    real_tokens=int(lengths.sum()),
                    squared_tokens=float(np.square(lengths, dtype=np.float64).sum()),
                    max_docs=max(count, default=1))


def _in_chunks(lengths: np.ndarray, order: np.ndarray, chunk: int = 1 << 20):
    """lengths[order] as Python ints, a million at a time (a list of them all would take ~36
    bytes a document)."""
    for start in range(0, order.size, chunk):
        yield from lengths[order[start:start + chunk]].tolist()


def place_documents(ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray, owner: np.ndarray,
                    windows: int, seq_len: int, *, pad_id: int, ignore: int
                    ) -> dict[str, np.ndarray]:
    """Laid-out documents (rows of `ids`/`labels`, the first `lengths[r]` tokens real; row r
    belongs to window `owner[r]`, rows of a window in order) side by side in `windows` windows:
    `input_ids`, `labels`, `position_ids` (restarting at each document), `document_ids` (1, 2,
    ... by place in the window, 0 on padding), `doc_lengths` (each window's documents' lengths in
    order, then its padding's, then zeros: window_docs(seq_len) + 1 wide, what flash-attention's
    variable-length kernels take: app.models.attention.varlen_kwargs) and `tokens` (each window's
    real tokens)."""
    real = np.arange(seq_len) < lengths[:, None]
    rows, cols = np.nonzero(real)  # row-major: each window's documents in order
    window = owner[rows]
    at = np.arange(rows.size) - np.searchsorted(window, window)  # column in the window
    place = np.arange(owner.size) - np.searchsorted(owner, owner)
    out = {"input_ids": np.full((windows, seq_len), pad_id, dtype=np.int64),
           "labels": np.full((windows, seq_len), ignore, dtype=np.int64),
           "position_ids": np.zeros((windows, seq_len), dtype=np.int64),
           "document_ids": np.zeros((windows, seq_len), dtype=np.int64)}
    out["input_ids"][window, at] = ids[rows, cols]
    out["labels"][window, at] = labels[rows, cols]
    out["position_ids"][window, at] = cols
    out["document_ids"][window, at] = place[rows] + 1
    tokens = np.bincount(owner, weights=lengths, minlength=windows).astype(np.int64)
    out["doc_lengths"] = np.zeros((windows, window_docs(seq_len) + 1), dtype=np.int64)
    out["doc_lengths"][owner, place] = lengths
    out["doc_lengths"][np.arange(windows), np.bincount(owner, minlength=windows)] = \
        seq_len - tokens
    out["tokens"] = tokens.reshape(-1, 1)
    return out
