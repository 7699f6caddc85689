"""`python -m app export RUN_DIR --out DIR`: a run's weights, config and tokenizer in Hugging Face
format (safetensors), loadable with `AutoModelForMaskedLM/CausalLM.from_pretrained(DIR)`.

Weights and config come from the run's files as fp32 (app.checkpoint.weights, which
`--init-from RUN_DIR` reads too: this module is the command only). The export is written to a
temporary directory and renamed into place, so DIR is either complete or absent.
When the run left its reference logits for the same step (app.reference), the exported model is
checked against them before it is put in place.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from app import reference, rundir
from app.checkpoint import manifest, tags
from app.checkpoint.weights import config_from_run, run_weights
from app.models.build import build_model
from data_tools import output
from data_tools.errors import UserError

KIND, COMMAND = "model export", "app export"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                        help="a run directory of app train")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="directory to write (config.json, model.safetensors, tokenizer)")
    parser.add_argument("--tag", help="checkpoint tag to export (default: the latest)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def run(args: argparse.Namespace) -> int:
    run_dir, out = args.run_dir, args.out
    run_config = rundir.read_run_config(run_dir)
    output.claim(out, KIND, COMMAND, overwrite=args.overwrite, inputs=[("RUN_DIR", run_dir)])
    ckpt_dir = run_dir / rundir.CHECKPOINTS
    tag = args.tag or tags.latest_tag(ckpt_dir)
    if tag is None or not (ckpt_dir / tag).is_dir():
        names = tags.all_tags(ckpt_dir) if ckpt_dir.is_dir() else []
        what = f"no checkpoint tag {tag}" if args.tag else (
            f"no '{tags.LATEST}' naming a checkpoint" if names else "no checkpoint to export")
        raise UserError(f"{ckpt_dir}: {what}" + (f"; its tags: {', '.join(names)}: pass one "
                                                 f"with --tag" if names else ""))
    weights = run_weights(ckpt_dir, tag)  # verified against its manifest (check_tag)
    print(step_note(run_dir, tag), file=sys.stderr)
    model = build_model(config_from_run(run_dir, run_config))
    load_weights(model, weights, where=ckpt_dir / tag)
    vocab = int(run_config["data"].get("vocab_size") or model.config.vocab_size)
    if model.config.vocab_size > vocab:  # the tokenizer's size: drop the tensor-core padding
        model.resize_token_embeddings(vocab, mean_resizing=False)
    objective = run_config["model"]["objective"]
    with output.new_dir(out, KIND, COMMAND) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(run_dir, run_config, tmp)
        # every file's size and checksum, as a checkpoint tag's: --init-from verifies it
        manifest.write(tmp, manifest.own_entries(tmp, 0))
        # checked before the export is in place
        checked = reference.compare(run_dir, tmp, tags.step_of(tag), objective)
        if checked is not None:
            diff, tolerance = checked
            print(f"check: max |logits - training logits| = {diff:.2e} (tolerance "
                  f"{tolerance:.1e})", file=sys.stderr)
            if diff > tolerance:
                raise UserError(f"{run_dir}: the exported model's logits differ from the run's "
                                f"by {diff:.2e} (tolerance {tolerance:.1e}); nothing was written "
                                f"to {out}")
    print(f"exported {tag} of {run_dir} -> {out} ({run_config['model']['preset']}, "
          f"{objective})", file=sys.stderr)
    return 0


def last_step(run_dir: Path) -> int | None:
    """The last step the run reached, by summary.json or metrics.jsonl (a run that crashed after
    a resume has logged past its old summary); None when it has neither."""
    summary = rundir.read_summary(run_dir)
    steps = [summary["steps"]] if summary is not None else []
    if (run_dir / rundir.METRICS).is_file():
        steps += [r["step"] for r in rundir.read_metrics(run_dir)]
    return max(steps, default=None)


def step_note(run_dir: Path, tag: str) -> str:
    """Which step is exported, and whether the run went further without a checkpoint: a
    12-step run whose last save was at step 5 exports step 5's weights, and should say so."""
    step = tags.step_of(tag)
    line = f"exporting {tag}" + (f" (step {step})" if step is not None else "")
    last = last_step(run_dir)
    if step is not None and last is not None and last > step:
        line += f"; the run reached step {last}: the steps after {step} are not in this export"
        if not tags.tags_after(run_dir / rundir.CHECKPOINTS, tag):
            line += " (no checkpoint holds them)"
    return line


def load_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], where: Path) -> None:
    """Strict load, except for tied weights (saved once, under either name)."""
    result = model.load_state_dict(state_dict, strict=False)
    tied_keys = getattr(model, "_tied_weights_keys", None) or {}
    tied = set(tied_keys) | (set(tied_keys.values()) if isinstance(tied_keys, dict) else set())
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise UserError(f"{where}: weights do not fit the run's model (missing "
                        f"{missing[:3]}, unexpected {result.unexpected_keys[:3]})")
    model.tie_weights()


def save_tokenizer(run_dir: Path, run_config: dict[str, Any], out: Path) -> None:
    """The run's copy of the dataset tokenizer (or the dataset's), saved through transformers."""
    from transformers import AutoTokenizer

    candidates = [run_dir / rundir.TOKENIZER_DIR,
                  Path(run_config.get("data", {}).get("source", "")) / rundir.TOKENIZER_DIR]
    for tok_dir in candidates:
        if (tok_dir / "tokenizer.json").is_file():
            AutoTokenizer.from_pretrained(tok_dir).save_pretrained(out)
            return
    raise UserError(f"{run_dir}: no tokenizer (looked in {', '.join(map(str, candidates))})")
