"""`python -m data_tools adopt PREFIX... --tokenizer DIR --out DIR`: a dataset directory for
Megatron `.bin/.idx` shards that already exist (made by Megatron-LM's `preprocess_data.py`, or
by `prepare --dtype-code megatron`), so `train` and `stage` take them without re-tokenizing.

Each shard is checked (the format and index against the .bin, one dtype for all, a dtype that
holds the tokenizer's ids, every id below its vocabulary), placed in --out as `train_NNNNN`
(`val_NNNNN` for `--val`), and recorded in dataset.json with a copy of the tokenizer, as prepare
records its own. Either uint16 code (DeepSpeed's 6, Megatron's 8) is kept as it is.

Placing: a hard link where the filesystem allows it (no copy; the dataset stays valid whatever
happens to the original names, and `stage` copies it like any file); across filesystems (or
where hard links are not allowed) a symbolic link to the absolute path, said in the summary,
since the dataset then lasts only as long as the originals; `--copy` always copies. Each file is
read once: checksum and id range in one pass (with `--copy`, the copy in the same pass). The
directory appears whole: written in a temporary sibling and renamed (docs/design.md, "Outputs").
"""
from __future__ import annotations

import argparse
import errno
import os
import shlex
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from data_tools import manifest as mf
from data_tools import output
from data_tools.cli import config_flags, from_args
from data_tools.errors import UserError
from data_tools.indexed import FormatError, IndexedShard, bin_path, idx_path
from data_tools.prepare import is_dataset_file
from data_tools.tokenizer_info import TokenizerInfo

KIND, COMMAND = "dataset", "data_tools adopt"
# Errors that mean "no hard link here" (another filesystem, not allowed), not a failed write.
_NO_HARD_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}
_EOD_CHUNK = 1 << 20  # documents checked at a time


@dataclass
class AdoptConfig:
    """`python -m data_tools adopt` settings. Field names are the flags with '-' for '_'."""

    prefix: list[str]
    """Megatron shards: PATH for PATH.bin + PATH.idx (PATH.bin or PATH.idx name it too)."""
    tokenizer: Path
    """The Hugging Face tokenizer directory the shards were made with."""
    out: Path
    """Dataset directory to write."""
    val: list[str] = field(default_factory=list)
    """Shards for the val split (the PREFIX shards are the train split)."""
    copy: bool = False
    """Copy the shards instead of linking them."""
    overwrite: bool = False
    """Replace a dataset already in --out (only a dataset: nothing else is ever removed)."""

    def __post_init__(self) -> None:
        self.tokenizer, self.out = Path(self.tokenizer), Path(self.out)

    def command(self) -> str:
        parts = ["python", "-m", "data_tools", "adopt", *self.prefix, "--tokenizer",
                 str(self.tokenizer), "--out", str(self.out)]
        parts += (["--val", *self.val] if self.val else []) + ["--copy"] * self.copy
        return shlex.join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prefix", nargs="+", metavar="PREFIX",
                   help="Megatron shards: PATH for PATH.bin + PATH.idx (PATH.bin or PATH.idx "
                        "name it too, so a glob like data/part* works); the train split")
    add = config_flags(p, AdoptConfig)
    add("tokenizer", type=Path, required=True, metavar="DIR")
    add("out", type=Path, required=True, metavar="DIR")
    add("val", nargs="+", default=[], metavar="PREFIX")
    add("copy", action="store_true")
    add("overwrite", action="store_true")


# -- the shards ------------------------------------------------------------------------------


def shard_prefixes(args: list[str], where: str) -> list[Path]:
    """Distinct prefixes in the order first named. `X.bin` and `X.idx` both name X (what a
    shell glob gives); a shard named twice otherwise is refused."""
    forms: dict[Path, set[str]] = {}
    order: list[Path] = []
    for arg in args:
        p = Path(arg)
        form = p.suffix if p.suffix in (".bin", ".idx") else ""
        prefix = p.with_suffix("") if form else p
        if not bin_path(prefix).is_file() or not idx_path(prefix).is_file():
            missing = bin_path(prefix) if not bin_path(prefix).is_file() else idx_path(prefix)
            raise UserError(f"{where} {arg}: no such shard ({missing} is missing)")
        seen = forms.setdefault(bin_path(prefix).resolve(), set())
        if form in seen or "" in seen or (seen and not form):
            raise UserError(f"{where} {arg}: the shard {prefix} is named twice")
        if not seen:
            order.append(prefix)
        seen.add(form)
    return order


def open_shard(prefix: Path) -> IndexedShard:
    try:
        shard = IndexedShard(prefix)
        shard.check_consistency()
    except FormatError as e:
        raise UserError(f"shard {prefix}: {e}") from None
    return shard


def check_dtype(shards: list[IndexedShard], tok: TokenizerInfo) -> np.dtype:
    """The one token dtype of all shards, if it is a dataset's and holds every id."""
    first = shards[0]
    for s in shards[1:]:
        if s.dtype != first.dtype:
            raise UserError(f"shards of different dtypes: {first.prefix} is {first.dtype}, "
                            f"{s.prefix} is {s.dtype}")
    if first.dtype.name not in mf.TOKEN_DTYPES:
        raise UserError(f"shard {first.prefix}: dtype {first.dtype} (a dataset holds uint16 or "
                        f"int32 ids, Megatron's two choices)")
    if np.iinfo(first.dtype).max < tok.vocab_size - 1:
        raise UserError(f"shard {first.prefix}: {first.dtype} cannot hold the ids of the "
                        f"tokenizer {tok.directory} (vocabulary {tok.vocab_size})")
    return first.dtype


def unterminated(shard: IndexedShard, eod: int) -> int:
    """Documents that do not end with the end-of-document token (Megatron writes it only with
    --append-eod); read through the memory map, a chunk of documents at a time."""
    doc_idx, sizes, pointers = shard.doc_idx, shard.sizes, shard.pointers
    tokens, itemsize = shard.tokens, shard.dtype.itemsize
    count = 0
    for start in range(0, len(doc_idx) - 1, _EOD_CHUNK):
        bounds = np.asarray(doc_idx[start:start + _EOD_CHUNK + 1], dtype=np.int64)
        last_seq = bounds[1:][bounds[1:] > bounds[:-1]] - 1  # documents with a sequence
        ends = pointers[last_seq] // itemsize + sizes[last_seq].astype(np.int64) - 1
        count += int((sizes[last_seq] == 0).sum())
        ends = ends[sizes[last_seq] > 0]
        count += int((tokens[ends] != eod).sum())
    return count


# -- placing and recording -------------------------------------------------------------------


def place(src: Path, dst: Path, copy: bool, dtype: np.dtype | None, bar: tqdm
          ) -> tuple[str, str, int | None, int | None]:
    """Link (or copy) `src` to `dst`: (how, checksum, smallest id, largest id)."""
    how = "copy"
    with output.writing(dst):
        if copy:
            with open(dst, "wb") as out:
                digest, lo, hi = mf.checksum_and_range(src, dtype, copy_to=out,
                                                       progress=bar.update)
            return how, digest, lo, hi
        try:
            os.link(src, dst)
            how = "hard link"
        except OSError as e:
            if e.errno not in _NO_HARD_LINK:
                raise
            os.symlink(src.resolve(), dst)
            how = "symlink"
    return (how, *mf.checksum_and_range(src, dtype, progress=bar.update))


def adopt_shard(shard: IndexedShard, dst: Path, cfg: AdoptConfig, tok: TokenizerInfo,
                bar: tqdm) -> dict[str, Any]:
    """Place one shard as `dst` (a prefix) and return its dataset.json entry."""
    how, bin_sum, lo, hi = place(bin_path(shard.prefix), bin_path(dst), cfg.copy, shard.dtype,
                                 bar)
    if hi is not None and hi >= tok.vocab_size:
        raise UserError(f"shard {shard.prefix}: token id {hi} is not below the vocabulary size "
                        f"{tok.vocab_size} of the tokenizer {tok.directory} (made with another "
                        f"tokenizer?)")
    if lo is not None and lo < 0:
        raise UserError(f"shard {shard.prefix}: negative token id {lo}")
    _, idx_sum, _, _ = place(idx_path(shard.prefix), idx_path(dst), cfg.copy, None, bar)
    return {"name": dst.name, "documents": max(shard.num_doc_idx - 1, 0),
            "sequences": len(shard), "tokens": shard.num_tokens,
            "bin_bytes": shard.bin_bytes, "idx_bytes": idx_path(shard.prefix).stat().st_size,
            "bin_checksum": bin_sum, "idx_checksum": idx_sum,
            "source": str(Path(os.path.abspath(shard.prefix))), "placed": how}


def adopt_into(tmp: Path, cfg: AdoptConfig, tok: TokenizerInfo,
               shards: dict[str, list[IndexedShard]], dtype: np.dtype) -> dict[str, Any]:
    """Fill the new dataset directory `tmp`; dataset.json last."""
    total = sum(s.bin_bytes + idx_path(s.prefix).stat().st_size
                for split in shards.values() for s in split)
    splits = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="adopt", dynamic_ncols=True) as bar:
        for name, split in shards.items():
            entries = [adopt_shard(s, tmp / f"{name}_{i:05d}", cfg, tok, bar)
                       for i, s in enumerate(split)]
            splits[name] = mf.split_entry(entries)
    tok_files = tok.copy_to(tmp / mf.TOKENIZER_DIR)
    codes = sorted({s.code for split in shards.values() for s in split})
    m = mf.new_manifest(
        dtype.name, tok.manifest_fields(tmp, tok_files), splits,
        dtype_code={6: "deepspeed", 8: "megatron"}.get(codes[0], "both")
        if len(codes) == 1 else "mixed",
        command=cfg.command(), created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    mf.write_manifest(tmp, m)
    return m


# -- the command -----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    cfg = from_args(AdoptConfig, args)
    tok = TokenizerInfo(cfg.tokenizer)
    prefixes = {"train": shard_prefixes(cfg.prefix, "PREFIX"),
                "val": shard_prefixes(cfg.val, "--val")}
    both = {bin_path(p).resolve() for p in prefixes["train"]} & \
        {bin_path(p).resolve() for p in prefixes["val"]}
    if both:
        raise UserError(f"--val: {sorted(both)[0].with_suffix('')} is also a train shard (PREFIX)")
    shards = {name: [open_shard(p) for p in ps] for name, ps in prefixes.items()}
    dtype = check_dtype(shards["train"] + shards["val"], tok)
    if not sum(s.num_tokens for s in shards["train"]):
        raise UserError("the train shards hold no tokens")
    inputs = [("PREFIX" if name == "train" else "--val", bin_path(p))
              for name, ps in prefixes.items() for p in ps] + [("--tokenizer", cfg.tokenizer)]
    if output.claim(cfg.out, KIND, COMMAND, overwrite=cfg.overwrite, inputs=inputs,
                    recognise=lambda d: (d / mf.MANIFEST).is_file()):
        strangers = [p.name for p in cfg.out.iterdir() if not is_dataset_file(p)]
        if strangers:
            raise UserError(f"--out {cfg.out}: holds {strangers[0]}, which no dataset command "
                            f"wrote; choose another directory (nothing was changed)")
    with output.new_dir(cfg.out, KIND, COMMAND) as tmp:
        m = adopt_into(tmp, cfg, tok, shards, dtype)
    _report(cfg, m, shards, tok)
    return 0


def _report(cfg: AdoptConfig, m: dict[str, Any], shards: dict[str, list[IndexedShard]],
            tok: TokenizerInfo) -> None:
    entries = [s for split in m["splits"].values() for s in split["shards"]]
    hows = sorted({s["placed"] for s in entries})
    split_text = ", ".join(f"{k} {v['documents']} docs / {v['tokens']} tokens"
                           for k, v in m["splits"].items())
    print(f"adopted {len(entries)} shard{'s' * (len(entries) != 1)} ({split_text}) into "
          f"{cfg.out}: "
          f"{' and '.join(h + 's' if h != 'copy' else 'copies' for h in hows)}; {m['dtype']}, "
          f"vocabulary {m['vocab_size']}, tokenizer {m['tokenizer']['fingerprint']}", flush=True)
    if "symlink" in hows:
        print("note: some shards are on another filesystem (or cannot be hard-linked) and are "
              "symbolic links: the dataset lasts only as long as the originals; --copy makes "
              "it independent", file=sys.stderr, flush=True)
    open_ends = sum(unterminated(s, tok.eod_token_id) for split in shards.values()
                    for s in split)
    if open_ends:
        print(f"warning: {open_ends} of {m['documents']} documents do not end with the "
              f"end-of-document token (id {tok.eod_token_id}; Megatron's --append-eod writes "
              f"it): packing joins them without a separator", file=sys.stderr, flush=True)
