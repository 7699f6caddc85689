"""`python -m data_tools tokenizer`: train a tokenizer on the user's own corpus.

The corpus may be a new language (code, binaries), so no pretrained vocabulary fits. WordPiece is
BERT's (special tokens [PAD] [UNK] [CLS] [SEP] [MASK], a [CLS] A [SEP] post-processor so that
`pipeline("fill-mask")` works); BPE is GPT-2's byte-level one (`<|endoftext|>` as bos/eos/unk plus a
`<|pad|>` token). Neither lowercases or strips accents unless asked: case carries meaning in code.
The result is a Hugging Face directory that `AutoTokenizer.from_pretrained(DIR)` loads offline.

Reproducibility: byte-level BPE training gives the same tokenizer.json on every run; WordPiece
training does not (the `##` tokens get ids in hash-map order, which also breaks merge ties:
huggingface/tokenizers#1794). That is why a dataset keeps its own copy of the tokenizer.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from data_tools import output
from data_tools.corpus import DEFAULT_INCLUDE, Corpus
from data_tools.errors import UserError

WORDPIECE_SPECIALS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]",
                      "sep_token": "[SEP]", "mask_token": "[MASK]"}
EOT = "<|endoftext|>"
BPE_SPECIALS = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT, "pad_token": "<|pad|>"}
DEFAULT_MAX_LENGTH = {"wordpiece": 512, "bpe": 1024}
KIND, COMMAND = "tokenizer directory", "data_tools tokenizer"
_BATCH_CHARS = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="files or directories (recursive) of .txt, .jsonl(.gz/.zst), .json.gz, "
                        ".parquet, .arrow, Hugging Face save_to_disk directories")
    p.add_argument("--out", required=True, type=Path, help="tokenizer directory to write")
    p.add_argument("--kind", choices=("wordpiece", "bpe"), default="wordpiece",
                   help="wordpiece (BERT, MLM; default) or byte-level bpe (GPT, CLM)")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--min-frequency", type=int, default=2,
                   help="a merge or word piece must occur this often")
    p.add_argument("--text-key", default="text",
                   help="JSON key or Parquet/Arrow column holding the text")
    p.add_argument("--include", default=DEFAULT_INCLUDE,
                   help="comma-separated globs for directory walks; other patterns read as text")
    p.add_argument("--lowercase", action="store_true",
                   help="lowercase and strip accents (WordPiece)")
    p.add_argument("--model-max-length", type=int, default=None,
                   help="longest sequence the model takes (default 512 wordpiece, 1024 bpe)")
    p.add_argument("--strict", action="store_true", help="invalid UTF-8 is an error, not replaced")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")


def build(kind: str, vocab_size: int, min_frequency: int = 2, lowercase: bool = False):
    """An untrained `tokenizers.Tokenizer` and its trainer for `kind`."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    if kind == "wordpiece":
        specials = list(WORDPIECE_SPECIALS.values())
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
        tok.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=lowercase,
            lowercase=lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
        # Ids are fixed by the special-token order given to the trainer: [PAD]=0 ... [MASK]=4.
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
            continuing_subword_prefix="##", show_progress=False)
    elif kind == "bpe":
        specials = [EOT, BPE_SPECIALS["pad_token"]]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    else:
        raise UserError(f"--kind {kind!r}: expected wordpiece or bpe")
    return tok, trainer


def min_vocab_size(kind: str) -> int:
    """Special tokens, plus the 256 byte symbols for byte-level BPE."""
    return len(WORDPIECE_SPECIALS) + 1 if kind == "wordpiece" else 256 + 2 + 1


def train(corpus: Corpus, kind: str, vocab_size: int, min_frequency: int = 2,
          lowercase: bool = False):
    """Train on the corpus, streaming it (the trainer only keeps word counts)."""
    tok, trainer = build(kind, vocab_size, min_frequency, lowercase)
    with tqdm(total=corpus.input_bytes, unit="B", unit_scale=True, unit_divisor=1024,
              desc="reading corpus", dynamic_ncols=True) as bar:
        def texts() -> Iterator[list[str]]:  # the trainer takes an iterator of lists
            for batch in corpus.batches(_BATCH_CHARS):
                bar.update(batch.progress - bar.n)
                yield batch.texts
        tok.train_from_iterator(texts(), trainer=trainer)
    if corpus.stats.documents == 0:
        raise UserError(f"empty corpus: no documents in {len(corpus.files)} input file(s)")
    return tok


def wrap(tok, kind: str, model_max_length: int):
    """The transformers view of `tok`, with its special tokens set, ready for save_pretrained."""
    from transformers import PreTrainedTokenizerFast

    specials = WORDPIECE_SPECIALS if kind == "wordpiece" else BPE_SPECIALS
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length,
                                   clean_up_tokenization_spaces=False, **specials)


def save(fast, out: Path) -> None:
    """Write into a temporary sibling, then rename: a half-saved directory never sits at `out`."""
    with output.new_dir(out, KIND, COMMAND) as tmp:
        fast.save_pretrained(str(tmp))


def run(args: argparse.Namespace) -> int:
    out: Path = args.out
    output.claim(out, KIND, COMMAND, overwrite=args.overwrite,
                 inputs=[("--input", Path(p)) for p in args.input])
    lowest = min_vocab_size(args.kind)
    if args.vocab_size < lowest:
        raise UserError(f"--vocab-size {args.vocab_size}: a {args.kind} vocabulary needs at least "
                        f"{lowest} entries")
    if args.min_frequency < 1:
        raise UserError(f"--min-frequency {args.min_frequency}: must be at least 1")
    max_len = args.model_max_length or DEFAULT_MAX_LENGTH[args.kind]
    if max_len < 2:
        raise UserError(f"--model-max-length {max_len}: must be at least 2")
    corpus = Corpus(args.input, args.include, args.text_key, args.strict)
    tok = train(corpus, args.kind, args.vocab_size, args.min_frequency, args.lowercase)
    save(wrap(tok, args.kind, max_len), out)
    s = corpus.stats
    replaced = f", {s.replaced_chars} invalid UTF-8 sequences replaced" if s.replaced_chars else ""
    replaced += f", {s.empty_documents} empty documents skipped" if s.empty_documents else ""
    print(f"tokenizer: {args.kind}, vocabulary {tok.get_vocab_size(with_added_tokens=True)} "
          f"(asked {args.vocab_size}), trained on {s.documents} documents, {s.bytes / 1e6:.1f} MB "
          f"from {s.files} files{replaced} -> {out}")
    return 0
