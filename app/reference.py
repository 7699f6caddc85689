"""Reference logits: the final model's output on a small fixed batch, written at the end of
training (RUN_DIR/reference.pt) so that `app export` can check the model it writes gives the same.
"""
from __future__ import annotations

from pathlib import Path

import torch

from app.rundir import REFERENCE
from data_tools.errors import UserError
from data_tools.output import writing

# How far the exported model's logits may be from the run's, relative to the logits' scale (at
# least 1). The export recomputes in fp32 from the fp32 master weights; a bf16 or fp16 run's
# reference was computed with low-precision weights and arithmetic (bf16 keeps 8 bits of mantissa:
# 4e-3 relative per operation, compounded over the layers). A wrong weight moves logits by their
# own scale, far past these.
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2}


@torch.no_grad()
def record(engine, run_dir: Path, *, seq_len: int, step: int, vocab_size: int,
           device: torch.device, precision: str, is_main: bool) -> None:
    """Every rank runs the forward (ZeRO-3 gathers parameters in it); the main rank writes the
    logits of the tokenizer's `vocab_size` tokens (an export drops the model's padding rows)."""
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab_size, (2, min(16, seq_len)), generator=gen)
    mask = torch.ones_like(ids)
    engine.eval()
    logits = engine(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    engine.train()
    if is_main:
        with writing(run_dir / REFERENCE):
            torch.save({"input_ids": ids, "attention_mask": mask,
                        "logits": logits[..., :vocab_size].float().cpu(), "step": step,
                        "precision": precision}, run_dir / REFERENCE)


@torch.no_grad()
def compare(run_dir: Path, model_dir: Path, step: int, objective: str
            ) -> tuple[float, float] | None:
    """(max |logits difference|, tolerance) between the model saved in `model_dir` and the run's
    reference (None when the run left none for checkpoint step `step`)."""
    path = run_dir / REFERENCE
    if not path.is_file():
        return None
    try:
        ref = torch.load(path, map_location="cpu")
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise UserError(f"{path}: corrupt or truncated ({e})") from None
    if int(ref["step"]) != step:
        return None
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    auto = AutoModelForMaskedLM if objective == "mlm" else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir).eval()
    logits = model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"]).logits
    diff = float((logits.float() - ref["logits"]).abs().max())
    scale = max(1.0, float(ref["logits"].abs().max()))
    return diff, TOLERANCE[ref.get("precision", "fp32")] * scale
