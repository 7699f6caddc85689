"""Input formats: Parquet, Arrow (a Hugging Face `save_to_disk` directory and a plain IPC file),
zstd and gzip JSON lines give the very shards the same texts give as JSONL; empty documents are
counted, not written; every bad file is one line naming the file (and row, line or key)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_tools.__main__ import main as data_tools_main
from data_tools.manifest import load_manifest
from tests.test_prepare import shard_bytes, walk_order


def prepare(*argv) -> int:
    return data_tools_main(["prepare", *map(str, argv)])


@pytest.fixture(scope="module")
def texts(stdlib_dir) -> list[str]:
    """Real documents, two empty ones, and one beyond the BMP (a 4-byte UTF-8 character)."""
    docs = [p.read_text(encoding="utf-8") for p in walk_order(stdlib_dir / "json")]
    return docs[:3] + [""] + docs[3:] + ["caf\u00e9 \U0001f600 done", ""]


def write_jsonl(path: Path, texts: list[str], opener=open) -> Path:
    with opener(path, "wb") as f:
        f.write("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts))
                .encode())
    return path


def write_zst(path: Path, texts: list[str]) -> Path:
    """Two frames, as `zstd -T` or pzstd write them."""
    raw = write_jsonl(path.with_suffix(".tmp"), texts).read_bytes()
    half = len(raw) // 2
    path.write_bytes(zstandard.ZstdCompressor(level=3).compress(raw[:half]) +
                     zstandard.ZstdCompressor(write_checksum=True).compress(raw[half:]))
    return path


def write_hf_dir(path: Path, texts: list[str]) -> Path:
    """What `datasets.Dataset.save_to_disk` leaves: arrow stream files listed in state.json,
    plus the cache file a later `.map()` writes beside them (not part of the dataset)."""
    path.mkdir()
    table = pa.table({"id": list(range(len(texts))), "text": pa.array(texts, pa.large_string())})
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    for name, (a, b) in zip(names, [(0, 4), (4, len(texts))]):
        with pa.OSFile(str(path / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table.slice(a, b - a), max_chunksize=3)
    with pa.OSFile(str(path / "cache-0123.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table.slice(0, 2))
    (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                 "_split": "train"}))
    (path / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return path


def write_arrow_file(path: Path, texts: list[str]) -> Path:
    table = pa.table({"text": texts})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=5)
    return path


def test_every_format_gives_the_shards_of_jsonl(tmp_path, texts, wordpiece_tokenizer, capsys):
    src = tmp_path / "src"
    src.mkdir()
    inputs = {
        "jsonl": write_jsonl(src / "c.jsonl", texts),
        "parquet": src / "c.parquet",
        "jsonl.zst": write_zst(src / "c.jsonl.zst", texts),
        "json.gz": write_jsonl(src / "c.json.gz", texts, gzip.open),
        "hf": write_hf_dir(src / "hf", texts),
        "arrow": write_arrow_file(src / "c.arrow", texts),
    }
    pq.write_table(pa.table({"text": texts, "n": list(range(len(texts)))}), inputs["parquet"],
                   row_group_size=4)
    common = ["--tokenizer", wordpiece_tokenizer, "--val-fraction", "0.2", "--shard-tokens",
              "20000", "--workers", "1"]
    for kind, path in inputs.items():
        assert prepare("--input", path, "--out", tmp_path / kind, *common) == 0, kind
    assert "2 empty documents skipped" in capsys.readouterr().out
    assert prepare("--input", inputs["parquet"], "--out", tmp_path / "w2", *common[:-2],
                   "--workers", "2") == 0
    want = shard_bytes(tmp_path / "jsonl")
    assert len(want) >= 4  # train and val, more than one shard
    for kind in [*inputs, "w2"]:
        assert shard_bytes(tmp_path / kind) == want, kind
        source = load_manifest(tmp_path / kind)["source"]
        assert (source["documents"], source["empty_documents"]) == (len(texts) - 2, 2), kind
    m = load_manifest(tmp_path / "hf")
    assert m["source"]["files"] == 2  # the listed arrow files, not the cache file
    # A directory walk finds every format by the default --include, in sorted order.
    assert prepare("--input", src, "--out", tmp_path / "all", *common) == 0
    assert load_manifest(tmp_path / "all")["source"]["files"] == 2 + 5


def test_empty_documents_take_no_index(tmp_path, texts, wordpiece_tokenizer):
    """With or without empty documents in between, the same documents go to the same split."""
    args = ["--tokenizer", wordpiece_tokenizer, "--val-fraction", "0.3", "--workers", "1"]
    full = write_jsonl(tmp_path / "full.jsonl", texts)
    (tmp_path / "dir").mkdir()
    write_jsonl(tmp_path / "dir" / "b.jsonl", [t for t in texts if t])
    (tmp_path / "dir" / "a.txt").write_text("")  # an empty text file is an empty document
    assert prepare("--input", full, "--out", tmp_path / "a", *args) == 0
    assert prepare("--input", tmp_path / "dir", "--out", tmp_path / "b", *args) == 0
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")
    assert load_manifest(tmp_path / "b")["source"]["empty_documents"] == 1


def test_tokenizer_reads_parquet(tmp_path, texts):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": texts}), path)
    assert data_tools_main(["tokenizer", "--input", str(path), "--text-key", "body", "--out",
                            str(tmp_path / "tok"), "--vocab-size", "300"]) == 0
    assert (tmp_path / "tok" / "tokenizer.json").is_file()


def _bad_inputs(d: Path) -> dict[str, tuple[Path, list[str]]]:
    """name -> (input, what the one error line must say)."""
    pq.write_table(pa.table({"body": ["a"]}), d / "nokey.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), d / "int.parquet")
    pq.write_table(pa.table({"text": ["a", "b", None]}), d / "null.parquet")
    pq.write_table(pa.table({"text": ["x" * 5000] * 20}), d / "good.parquet", row_group_size=5)
    good = (d / "good.parquet").read_bytes()
    (d / "cut.parquet").write_bytes(good[:len(good) // 2])
    lines = write_jsonl(d / "l.tmp", ["some text"] * 400).read_bytes()
    z = zstandard.ZstdCompressor().compress(lines)
    (d / "cut.jsonl.zst").write_bytes(z[:len(z) - 20])
    (d / "plain.jsonl.zst").write_text('{"text": "not compressed"}\n')
    (d / "cut.json.gz").write_bytes(gzip.compress(lines)[:-30])
    write_arrow_file(d / "good.arrow", ["y" * 5000] * 20)
    arrow = (d / "good.arrow").read_bytes()
    (d / "cut.arrow").write_bytes(arrow[:len(arrow) // 2])
    (d / "array.json.gz").write_bytes(gzip.compress(b'[\n{"text": "a"}\n]\n'))
    write_hf_dir(d / "hf_missing", ["a", "b", "c", "d", "e"])
    (d / "hf_missing" / "data-00001-of-00002.arrow").unlink()
    (d / "dd" / "train").mkdir(parents=True)
    (d / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    return {
        "no column": (d / "nokey.parquet", ["no column 'text'", "columns: body", "--text-key"]),
        "not a string": (d / "int.parquet", ["column 'text' is int64, not a string"]),
        "null": (d / "null.parquet", ["row 3", "column 'text' is null"]),
        "cut parquet": (d / "cut.parquet", ["corrupt Parquet file"]),
        "cut zst": (d / "cut.jsonl.zst", ["corrupt zstd file", "truncated"]),
        "not zst": (d / "plain.jsonl.zst", ["corrupt zstd file"]),
        "cut gz": (d / "cut.json.gz", ["corrupt gzip file", "at line"]),
        "cut arrow": (d / "cut.arrow", ["corrupt Arrow file"]),
        "json array": (d / "array.json.gz", [":1:", "malformed JSON", "read as JSON lines"]),
        "hf missing file": (d / "hf_missing", ["state.json", "data-00001-of-00002.arrow",
                                               "missing"]),
        "dataset dict": (d / "dd", ["DatasetDict", "train, test", str(d / "dd" / "train")]),
    }


def test_bad_inputs_are_one_line(tmp_path, wordpiece_tokenizer, one_line_error):
    src = tmp_path / "src"
    src.mkdir()
    for name, (path, needles) in _bad_inputs(src).items():
        out = tmp_path / "out"
        assert prepare("--input", path, "--tokenizer", wordpiece_tokenizer, "--out", out,
                       "--workers", "1") == 2, name
        one_line_error(str(path), *needles)
        assert not out.exists(), name
