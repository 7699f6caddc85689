"""`python -m data_tools COMMAND`: tokenizer | prepare | adopt | inspect | stage."""
from __future__ import annotations

import sys

from data_tools.errors import run_cli

# command -> (module exposing `add_arguments(parser)` and `run(args) -> int`, help)
COMMANDS = {
    "tokenizer": ("data_tools.tokenizer",
                  "train a WordPiece (BERT) or byte-level BPE (GPT) tokenizer"),
    "prepare": ("data_tools.prepare", "pretokenize a corpus into Megatron .bin/.idx shards"),
    "adopt": ("data_tools.adopt", "a dataset for existing Megatron .bin/.idx shards "
                                  "(linked or copied, checked, no re-tokenizing)"),
    "inspect": ("data_tools.inspection", "summarise, decode and verify a dataset directory"),
    "stage": ("data_tools.stage", "copy a dataset to node-local disk, verified and resumable"),
}


def main(argv=None) -> int:
    return run_cli("python -m data_tools", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
