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

Each function returns (token ids as int64, length): positions >= length are padding.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from app.data.stream import TokenStream
from data_tools.errors import UserError

PACKINGS = ("concat", "doc")


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
