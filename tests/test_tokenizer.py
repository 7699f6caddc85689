"""`data_tools tokenizer`: the saved directory loads offline through AutoTokenizer with its special
tokens, WordPiece keeps a BERT post-processor (fill-mask works), byte-level BPE is lossless, and
bad input is one line, exit 2."""
from __future__ import annotations

import gzip
import json

import pytest
from transformers import AutoTokenizer

from data_tools.__main__ import main as data_tools_main

CODE = "def Parse(Value):\n    return Value.strip()  # naïve\n"


def test_wordpiece_loads_offline_with_bert_special_tokens(wordpiece_tokenizer):
    tok = AutoTokenizer.from_pretrained(wordpiece_tokenizer, local_files_only=True)
    assert len(tok) == 2000
    assert [tok.pad_token, tok.unk_token, tok.cls_token, tok.sep_token, tok.mask_token] == \
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert [tok.pad_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id] == [0, 2, 3, 4]
    ids = tok(CODE)["input_ids"]
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
    assert tok(CODE, add_special_tokens=False)["input_ids"] == ids[1:-1]
    # Case is kept by default: code is case-sensitive.
    assert "Parse" in tok.decode(ids, skip_special_tokens=True)
    assert tok.model_max_length == 512


def test_wordpiece_serves_the_fill_mask_pipeline(wordpiece_tokenizer):
    from transformers import BertConfig, BertForMaskedLM, pipeline

    tok = AutoTokenizer.from_pretrained(wordpiece_tokenizer, local_files_only=True)
    model = BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=64))
    fill = pipeline("fill-mask", model=model, tokenizer=tok, device="cpu")
    out = fill(f"def parse(value): return {tok.mask_token}.strip()", top_k=3)
    assert len(out) == 3 and all("token_str" in o for o in out)


def test_bpe_is_byte_level_and_lossless(bpe_tokenizer):
    tok = AutoTokenizer.from_pretrained(bpe_tokenizer, local_files_only=True)
    assert len(tok) == 2000
    assert tok.eos_token == tok.bos_token == tok.unk_token == "<|endoftext|>"
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id != tok.eos_token_id
    text = CODE + "\t\x00 émoji 🐍 \u4e2d\u6587\n"
    ids = tok(text)["input_ids"]
    assert tok.unk_token_id not in ids  # every byte has a symbol
    assert tok.decode(ids) == text
    assert tok.model_max_length == 1024


def test_lowercase_flag_and_jsonl_input(tmp_path):
    corpus = tmp_path / "c.jsonl.gz"
    with gzip.open(corpus, "wt") as f:
        for i in range(200):
            f.write(json.dumps({"body": f"Hello World number {i} MixedCase"}) + "\n")
    out = tmp_path / "tok"
    assert data_tools_main(["tokenizer", "--input", str(corpus), "--out", str(out),
                            "--text-key", "body", "--vocab-size", "200", "--lowercase"]) == 0
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok.decode(tok("MixedCase HELLO")["input_ids"], skip_special_tokens=True) == \
        "mixedcase hello"


def test_existing_output_is_refused_unless_overwrite(stdlib_dir, tmp_path,
                                                     one_line_error):
    out = tmp_path / "tok"
    args = ["tokenizer", "--input", str(stdlib_dir / "json"), "--include", "*.py",
            "--out", str(out), "--vocab-size", "300"]
    assert data_tools_main(args) == 0
    first = (out / "tokenizer.json").read_bytes()
    assert data_tools_main(args + ["--vocab-size", "400"]) == 2
    one_line_error(str(out), "--overwrite")
    assert (out / "tokenizer.json").read_bytes() == first
    assert data_tools_main(args + ["--vocab-size", "400", "--overwrite"]) == 0
    assert (out / "tokenizer.json").read_bytes() != first


def test_overwrite_never_replaces_a_directory_it_did_not_make(stdlib_dir, tmp_path,
                                                              one_line_error):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ["tokenizer", "--input", str(stdlib_dir / "json"), "--include", "*.py",
            "--out", str(out), "--vocab-size", "300"]
    for extra in ([], ["--overwrite"]):
        assert data_tools_main(args + extra) == 2
        one_line_error(str(out), "not a tokenizer directory")
        assert (out / "keep.txt").read_text() == "mine" and len(list(out.iterdir())) == 1


@pytest.mark.parametrize("extra,needles", [
    (["--vocab-size", "100", "--kind", "bpe"], ["--vocab-size 100", "at least"]),
    (["--vocab-size", "3"], ["--vocab-size 3"]),
    (["--min-frequency", "0"], ["--min-frequency"]),
])
def test_bad_flags(tmp_path, stdlib_dir, one_line_error, extra, needles):
    rc = data_tools_main(["tokenizer", "--input", str(stdlib_dir / "json"), "--include", "*.py",
                          "--out", str(tmp_path / "t"), *extra])
    assert rc == 2
    one_line_error(*needles)
    assert not (tmp_path / "t").exists()


def test_malformed_jsonl_names_file_and_line(tmp_path, one_line_error):
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "fine"}\n{oops\n')
    assert data_tools_main(["tokenizer", "--input", str(src), "--out", str(tmp_path / "t")]) == 2
    one_line_error(f"{src}:3", "malformed JSON")
    assert not (tmp_path / "t").exists()


def test_missing_input_and_empty_corpus(tmp_path, one_line_error):
    assert data_tools_main(["tokenizer", "--input", str(tmp_path / "nope"),
                            "--out", str(tmp_path / "t")]) == 2
    one_line_error(str(tmp_path / "nope"), "no such file")
    (tmp_path / "empty.txt").write_text("")
    assert data_tools_main(["tokenizer", "--input", str(tmp_path / "empty.txt"),
                            "--out", str(tmp_path / "t")]) == 2
    one_line_error("empty corpus")
    assert not (tmp_path / "t").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".t.")]  # no temp dir left
