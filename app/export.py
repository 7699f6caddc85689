"""`python -m app export RUN_DIR --out DIR`: a run's weights, config and tokenizer in Hugging Face
format (safetensors), loadable with `AutoModelForMaskedLM/CausalLM.from_pretrained(DIR)`.

Weights come from the checkpoint as fp32: ZeRO 1-3 partitions are consolidated by DeepSpeed's own
zero_to_fp32; ZeRO-0 checkpoints hold the whole module. The export is written to a temporary
directory and renamed into place, so DIR is either complete or absent. When the run left its
reference logits (RUN_DIR/reference.pt) for the same step, the exported model is checked against
them.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from app import checkpoint
from app.model import build_model, config_from_dict
from app.trainer import REFERENCE
from data_tools.errors import UserError
from data_tools.manifest import TOKENIZER_DIR, read_json

RUN_CONFIG = "config.json"
LOGITS_TOLERANCE = 1e-4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                        help="a run directory of app train")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="directory to write (config.json, model.safetensors, tokenizer)")
    parser.add_argument("--tag", help="checkpoint tag to export (default: the latest)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def run(args: argparse.Namespace) -> int:
    run_dir, out = args.run_dir, args.out
    run_config = read_run_config(run_dir)
    ckpt_dir = run_dir / checkpoint.CHECKPOINTS
    tag = args.tag or checkpoint.latest_tag(ckpt_dir)
    if tag is None or not (ckpt_dir / tag).is_dir():
        raise UserError(f"{ckpt_dir}: no checkpoint {'tag ' + tag if tag else 'to export'}")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise UserError(f"--out {out}: exists and is not empty (use --overwrite to replace it)")
    model_cfg = config_from_dict(run_config["model"]["config"])
    model_cfg._attn_implementation = "sdpa"
    model = build_model(model_cfg)
    state_dict = consolidated_state_dict(ckpt_dir, tag, int(run_config.get("zero_stage", 0)))
    load_weights(model, state_dict, where=ckpt_dir / tag)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(run_dir, run_config, tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"exported {tag} of {run_dir} -> {out} ({run_config['model']['preset']}, "
          f"{run_config['model']['objective']})", file=sys.stderr)
    diff = check_reference(run_dir, out, tag, run_config["model"]["objective"])
    if diff is not None:
        print(f"check: max |logits - training logits| = {diff:.2e}", file=sys.stderr)
        if diff > LOGITS_TOLERANCE:
            raise UserError(f"{out}: exported model's logits differ from the run's by {diff:.2e}")
    return 0


def read_run_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / RUN_CONFIG
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    data = read_json(path, missing=f"{run_dir}: no {RUN_CONFIG} (not a run directory of app "
                                   f"train)")
    for key in ("model",):
        if key not in data:
            raise UserError(f"{path}: missing key '{key}'")
    return data


def consolidated_state_dict(ckpt_dir: Path, tag: str, stage: int) -> dict[str, torch.Tensor]:
    """fp32 weights of the whole model from one checkpoint tag."""
    tag_dir = ckpt_dir / tag
    if stage > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    files = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise UserError(f"{tag_dir}: no mp_rank_*_model_states.pt (incomplete checkpoint)")
    module = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
    return {k: v.float() for k, v in module.items()}


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

    candidates = [run_dir / TOKENIZER_DIR,
                  Path(run_config.get("data", {}).get("source", "")) / TOKENIZER_DIR]
    for tok_dir in candidates:
        if (tok_dir / "tokenizer.json").is_file():
            AutoTokenizer.from_pretrained(tok_dir).save_pretrained(out)
            return
    raise UserError(f"{run_dir}: no tokenizer (looked in {', '.join(map(str, candidates))})")


@torch.no_grad()
def check_reference(run_dir: Path, out: Path, tag: str, objective: str) -> float | None:
    """Max |logits difference| between the exported model and the run's final logits."""
    path = run_dir / REFERENCE
    if not path.is_file():
        return None
    ref = torch.load(path, map_location="cpu")
    if checkpoint.tag_for(int(ref["step"])) != tag:
        return None
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    auto = AutoModelForMaskedLM if objective == "mlm" else AutoModelForCausalLM
    model = auto.from_pretrained(out).eval()
    logits = model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"]).logits
    return float((logits.float() - ref["logits"]).abs().max())
