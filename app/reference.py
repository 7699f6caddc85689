"""Reference logits: the final model's output on a small fixed batch, written at the end of
training (RUN_DIR/reference.pt) so that `app export` can check the model it writes gives the same.
"""
from __future__ import annotations

from pathlib import Path

import torch

from app.rundir import REFERENCE
from data_tools.errors import UserError
from data_tools.output import writing

LOGITS_TOLERANCE = 1e-4


@torch.no_grad()
def record(engine, run_dir: Path, *, seq_len: int, step: int, device: torch.device,
           is_main: bool) -> None:
    """Every rank runs the forward (ZeRO-3 gathers parameters in it); the main rank writes."""
    vocab = engine.module.config.vocab_size
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (2, min(16, seq_len)), generator=gen)
    mask = torch.ones_like(ids)
    engine.eval()
    logits = engine(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    engine.train()
    if is_main:
        with writing(run_dir / REFERENCE):
            torch.save({"input_ids": ids, "attention_mask": mask, "logits": logits.float().cpu(),
                        "step": step}, run_dir / REFERENCE)


@torch.no_grad()
def max_difference(run_dir: Path, model_dir: Path, step: int, objective: str) -> float | None:
    """Max |logits difference| between the model saved in `model_dir` and the run's reference
    (None when the run left none for checkpoint step `step`)."""
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
    return float((logits.float() - ref["logits"]).abs().max())
