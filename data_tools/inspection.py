"""`python -m data_tools inspect DIR`: summarise, decode and verify a dataset directory.

`--verify` reads every byte once: each .bin is hashed and scanned for its largest token id in the
same pass (memory bounded by one chunk), so verifying costs one sequential read of the dataset.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from data_tools import manifest as mf
from data_tools import schema
from data_tools.errors import UserError
from data_tools.indexed import FormatError, IndexedShard
from data_tools.schema import check_regular


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=Path, help="dataset directory (holds dataset.json)")
    p.add_argument("--verify", action="store_true",
                   help="recompute checksums, check each .idx against its .bin, token ids < vocab")
    p.add_argument("--decode", type=int, default=0, metavar="N",
                   help="print the first N documents of the train split as text")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (for scripts)")


def summary(d: Path, m: dict[str, Any]) -> dict[str, Any]:
    splits = {}
    for name, split in m["splits"].items():
        shards = split["shards"]
        splits[name] = {
            "shards": len(shards),
            "documents": split.get("documents", sum(s.get("documents", 0) for s in shards)),
            "tokens": split.get("tokens", sum(s.get("tokens", 0) for s in shards)),
            "bytes": sum(s["bin_bytes"] + s["idx_bytes"] for s in shards)}
    tok = m["tokenizer"]
    return {"dir": str(d), "dtype": m["dtype"], "vocab_size": m["vocab_size"],
            "eod_token_id": m["eod_token_id"], "tokenizer_kind": tok.get("kind"),
            "tokenizer_fingerprint": tok.get("fingerprint"), "fingerprint": m.get("fingerprint"),
            "splits": splits, "input_bytes": m.get("input_bytes"),
            "output_bytes": m.get("output_bytes"),
            "size_reduction_pct": m.get("size_reduction_pct"),
            "created_at": m.get("created_at"), "command": m.get("command")}


def format_table(s: dict[str, Any]) -> str:
    rows = [("split", "shards", "documents", "tokens", "size")]
    for name, sp in s["splits"].items():
        rows.append((name, str(sp["shards"]), f"{sp['documents']:,}", f"{sp['tokens']:,}",
                     _human(sp["bytes"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"dataset {s['dir']}",
             f"  dtype {s['dtype']}, vocab {s['vocab_size']:,}, end-of-document id "
             f"{s['eod_token_id']}, tokenizer {s['tokenizer_kind']} ({s['tokenizer_fingerprint']})"]
    if s.get("input_bytes"):
        lines.append(f"  input {_human(s['input_bytes'])} -> output {_human(s['output_bytes'])} "
                     f"({s['size_reduction_pct']}% smaller)")
    for i, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  " + "  ".join(cells))
        if i == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _human(n: int | None) -> str:
    return "?" if n is None else tqdm.format_sizeof(n, "B")


# -- verify ----------------------------------------------------------------------------------


def verify(d: Path, m: dict[str, Any], show_progress: bool = True) -> list[str]:
    """Every problem found, one line each naming the file (empty: the dataset is intact)."""
    problems: list[str] = []
    files = mf.dataset_files(m)
    try:
        dtype = np.dtype(m["dtype"])
        vocab = int(m["vocab_size"])
    except (TypeError, ValueError):
        raise UserError(f"{d / mf.MANIFEST}: key 'dtype' or 'vocab_size' is not valid "
                        f"({m['dtype']!r}, {m['vocab_size']!r})") from None
    with tqdm(total=sum(f[1] for f in files), unit="B", unit_scale=True, desc="verify",
              disable=not show_progress, dynamic_ncols=True) as bar:
        for rel, size, checksum in files:
            path = d / rel
            is_shard = "/" not in rel  # shards sit at the top, tokenizer files below
            where = f"shard {rel.rsplit('.', 1)[0]}: {path}" if is_shard else str(path)
            if not path.is_file():
                kind = schema.not_regular(path.stat().st_mode) if path.exists() else None
                problems.append(f"{where}: " + (f"is {kind}, expected a regular file" if kind
                                                 else "missing"))
                continue
            actual = path.stat().st_size
            if actual != size:
                problems.append(f"{where}: {actual} bytes, dataset.json says {size} (truncated "
                                f"or replaced)")
                continue
            scan = dtype if is_shard and rel.endswith(".bin") else None
            digest, min_id, max_id = mf.checksum_and_range(path, scan, progress=bar.update)
            if digest != checksum:
                problems.append(f"{where}: checksum mismatch (corrupt): {digest}, dataset.json "
                                f"says {checksum}")
                continue
            if max_id is not None and max_id >= vocab:
                problems.append(f"{where}: token id {max_id} is not below the vocabulary size "
                                f"{vocab}")
            elif min_id is not None and min_id < 0:
                problems.append(f"{where}: negative token id {min_id}")
    for split in m["splits"].values():
        for s in split["shards"]:
            problems += _check_shard(d, s, dtype)
    tok_dir = d / m["tokenizer"].get("dir", mf.TOKENIZER_DIR)
    try:
        fp = mf.tokenizer_fingerprint(tok_dir)
        if fp != m["tokenizer"].get("fingerprint"):
            problems.append(f"{tok_dir / 'tokenizer.json'}: fingerprint {fp} does not match "
                            f"dataset.json's {m['tokenizer'].get('fingerprint')}")
    except UserError as e:
        problems.append(str(e))
    return problems


def _check_shard(d: Path, s: dict[str, Any], dtype: np.dtype) -> list[str]:
    prefix = d / s["name"]
    try:
        shard = IndexedShard(prefix)
        shard.check_consistency()
    except FormatError as e:
        return [f"shard {s['name']}: {e}"]
    out = []
    if shard.dtype != dtype:
        out.append(f"shard {s['name']}: dtype {shard.dtype}, dataset.json says {dtype}")
    documents = max(shard.num_doc_idx - 1, 0)  # Megatron may split a document in sequences
    if "documents" in s and documents != s["documents"]:
        out.append(f"shard {s['name']}: {documents} documents, dataset.json says {s['documents']}")
    if "tokens" in s and shard.num_tokens != s["tokens"]:
        out.append(f"shard {s['name']}: {shard.num_tokens} tokens, dataset.json says {s['tokens']}")
    return out


# -- decode ----------------------------------------------------------------------------------


def decode(d: Path, m: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The first n documents of train (then val) as text, with the ids' shard and index."""
    from tokenizers import Tokenizer

    tok_json = d / m["tokenizer"].get("dir", mf.TOKENIZER_DIR) / "tokenizer.json"
    check_regular(tok_json)  # a FIFO would hang the tokenizers library's read
    try:
        tok = Tokenizer.from_file(str(tok_json))
    except Exception as e:  # noqa: BLE001 - any failure means an unusable copy
        raise UserError(f"{tok_json}: cannot load the tokenizer ({e})") from None
    out: list[dict[str, Any]] = []
    for split in ("train", "val"):
        for prefix in mf.shard_prefixes(d, m, split):
            try:
                shard = IndexedShard(prefix)
            except FormatError as e:
                raise UserError(f"shard {prefix.name}: {e}") from None
            for i in range(len(shard)):
                if len(out) >= n:
                    return out
                ids = shard[i].tolist()
                out.append({"split": split, "shard": prefix.name, "index": i, "tokens": len(ids),
                            "text": tok.decode(ids, skip_special_tokens=False)})
    return out


def run(args: argparse.Namespace) -> int:
    if args.decode < 0:
        raise UserError(f"--decode {args.decode}: must be 0 or more")
    d: Path = args.dir
    m = mf.load_manifest(d)
    s = summary(d, m)
    docs = decode(d, m, args.decode) if args.decode else []
    problems = verify(d, m, show_progress=not args.json) if args.verify else []
    if args.json:
        if args.decode:
            s["decoded"] = docs
        if args.verify:
            s["verified"] = not problems
            s["problems"] = problems
        print(json.dumps(s, indent=2))
    else:
        print(format_table(s))
        for doc in docs:
            print(f"\n--- {doc['split']} document {doc['index']} of {doc['shard']} "
                  f"({doc['tokens']} tokens) ---")
            print(doc["text"])
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise UserError(f"verify failed: {problems[0]}{more}")
    if args.verify and not args.json:
        n_files = len(mf.dataset_files(m))
        print(f"OK: {n_files} files verified (checksums, index/bin structure, token ids < "
              f"{m['vocab_size']}, tokenizer fingerprint)")
    return 0
