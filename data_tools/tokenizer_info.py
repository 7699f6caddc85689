"""A tokenizer directory as a dataset sees it: vocabulary size, end-of-document and other special
ids, token dtype, and the files that make the dataset's own copy (docs/design.md, "Datasets").
"""
from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from data_tools import manifest as mf
from data_tools.errors import UserError
from data_tools.indexed import token_dtype
from data_tools.schema import check_regular, read_regular

# What a tokenizer directory may hold that belongs to the tokenizer (copied into the dataset).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt", "*.model",
                   "chat_template.*")
# What transformers may also read from it (the fallback: which tokenizer class).
ALSO_READ = ("config.json",)


class TokenizerInfo:
    """What a dataset needs from a tokenizer directory: its backend, special ids, vocab, kind.

    Read from tokenizer.json and tokenizer_config.json / special_tokens_map.json directly, since
    importing transformers costs seconds; only a directory without those falls back to it.
    """

    _NAMES = ("sep", "eos", "pad", "mask", "cls", "bos", "unk")

    def __init__(self, directory: Path):
        if not directory.exists():
            raise UserError(f"{directory}: no such tokenizer directory")
        if not directory.is_dir():
            raise UserError(f"{directory}: not a directory (expected a tokenizer directory)")
        self.directory = directory
        _check_regular_files(directory)
        from tokenizers import Tokenizer

        tok_json = directory / "tokenizer.json"
        config = self._read_config(directory)
        tokens = {n: _token_content(config.get(f"{n}_token")) for n in self._NAMES}
        max_len = config.get("model_max_length")
        if tok_json.is_file():
            raw = read_regular(tok_json)
            try:
                self.backend_json = raw.decode("utf-8")
                backend = Tokenizer.from_str(self.backend_json)
            except Exception as e:  # noqa: BLE001 - any failure means a corrupt file
                raise UserError(f"{tok_json}: corrupt tokenizer file ({_first_line(e)})") from None
        if not tok_json.is_file() or not (tokens["sep"] or tokens["eos"]):
            fast = self._load_with_transformers(directory)  # e.g. a vocab.txt-only BERT dir
            backend = fast.backend_tokenizer
            self.backend_json = backend.to_str()
            tokens = {n: getattr(fast, f"{n}_token", None) for n in self._NAMES}
            max_len = getattr(fast, "model_max_length", None)
        ids = {n: (backend.token_to_id(t) if t else None) for n, t in tokens.items()}
        model = json.loads(self.backend_json).get("model", {})
        self.kind = str(model.get("type") or "unknown").lower()
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(backend.get_vocab_size(with_added_tokens=True),
                              max(vocab.values(), default=-1) + 1)
        self.model_max_length = _int_or_none(max_len)
        first, second = ("sep", "eos") if self.kind == "wordpiece" else ("eos", "sep")
        eod = ids[first] if ids[first] is not None else ids[second]
        if eod is None:
            raise UserError(f"{directory}: the tokenizer has neither a sep nor an eos token to end "
                            f"each document with")
        self.eod_token_id = int(eod)
        self.special_ids = {f"{n}_token_id": _int_or_none(ids[n])
                            for n in ("pad", "mask", "cls", "bos", "unk")}
        added = json.loads(self.backend_json).get("added_tokens") or []
        self.special_token_ids = sorted({int(t["id"]) for t in added
                                         if t.get("special") and isinstance(t.get("id"), int)})
        self.dtype = token_dtype(self.vocab_size)
        self.files = self._read_files()

    @staticmethod
    def _read_config(directory: Path) -> dict[str, Any]:
        """Special tokens and model_max_length from the transformers side files, if present."""
        config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            path = directory / name
            if not path.is_file():
                continue
            raw = read_regular(path)
            try:
                data = json.loads(raw.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise UserError(f"{path}: corrupt JSON ({_first_line(e)})") from None
            if not isinstance(data, dict):
                raise UserError(f"{path}: expected a JSON object")
            config.update({k: v for k, v in data.items() if v is not None})
        return config

    @staticmethod
    def _load_with_transformers(directory: Path):
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any failure here means an unusable directory
            raise UserError(f"{directory}: not a loadable tokenizer directory "
                            f"({_first_line(e)})") from None
        if not getattr(tok, "is_fast", False):
            raise UserError(f"{directory}: only fast (tokenizers-backed) tokenizers are supported")
        return tok

    def _read_files(self) -> dict[str, bytes]:
        """The tokenizer's own files (not a model's weights next to them), held in memory."""
        files = {}
        for f in sorted(self.directory.iterdir()):
            if f.is_file() and any(fnmatch.fnmatch(f.name, g) for g in TOKENIZER_FILES):
                files[f.name] = read_regular(f)
        files.setdefault("tokenizer.json", self.backend_json.encode("utf-8"))
        return files

    @property
    def fingerprint(self) -> str:
        """What the dataset's copy hashes to (`manifest.tokenizer_fingerprint`)."""
        h = mf.new_hasher()
        h.update(self.files["tokenizer.json"])
        return mf.format_digest(h)

    def manifest_fields(self, dataset_dir: Path, files: list[dict[str, Any]]) -> dict[str, Any]:
        """dataset.json's tokenizer half: vocabulary, special ids, and the entry of the copy in
        `dataset_dir` (made by `copy_to`, listed as `files`)."""
        return {"vocab_size": self.vocab_size, "eod_token_id": self.eod_token_id,
                **self.special_ids, "special_token_ids": self.special_token_ids,
                "model_max_length": self.model_max_length,
                "tokenizer": {"dir": mf.TOKENIZER_DIR,
                              "fingerprint": mf.tokenizer_fingerprint(dataset_dir /
                                                                      mf.TOKENIZER_DIR),
                              "kind": self.kind, "source": str(self.directory), "files": files}}

    def copy_to(self, dest: Path) -> list[dict[str, Any]]:
        """Write the tokenizer's files into the dataset (so it is self-contained); list them."""
        dest.mkdir(parents=True)
        for name, data in self.files.items():
            (dest / name).write_bytes(data)
        return [{"name": f.name, "bytes": f.stat().st_size, "checksum": mf.file_checksum(f)}
                for f in sorted(dest.iterdir()) if f.is_file()]


def _check_regular_files(directory: Path) -> None:
    """Refuse, naming it, a file of the directory that the tokenizer is read from (ours or
    transformers') but that is not a regular file (data_tools.schema.open_regular): a FIFO
    would hang the read, a device read without end, and a directory or FIFO named vocab.txt
    would otherwise be passed over for a tokenizer without its vocabulary."""
    try:
        entries = sorted(directory.iterdir())
    except OSError as e:
        raise UserError(f"{directory}: cannot list the directory ({e.strerror})") from None
    for f in entries:
        if f.name in ALSO_READ or any(fnmatch.fnmatch(f.name, g) for g in TOKENIZER_FILES):
            check_regular(f, missing=f"{f}: a link to nothing (a dangling symbolic link)")


def _token_content(value) -> str | None:
    """A special token as written by transformers: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _int_or_none(v) -> int | None:
    return int(v) if isinstance(v, (int, np.integer)) and v < 1 << 62 else None
