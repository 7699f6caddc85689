"""`app export`: HF model dirs that from_pretrained loads, with the trained model's logits."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer, pipeline

from app.__main__ import main as app_main
from app.checkpoint import manifest
from tests.helpers import TINY, check, error_lines, flip, run_app

pytestmark = pytest.mark.slow


def export(run, out, capsys=None) -> int:
    try:
        return app_main(["export", str(run), "--out", str(out)])
    except SystemExit as e:
        return e.code


def reference_logits(run, model) -> tuple[torch.Tensor, torch.Tensor]:
    ref = torch.load(run / "reference.pt")
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"]).logits
    return logits, ref["logits"]


def test_mlm_export_loads_with_the_trained_logits_and_fills_masks(mlm_dataset, tmp_path,
                                                                  capsys):
    run, out = tmp_path / "run", tmp_path / "hf"
    check(run_app("train", "--data", mlm_dataset, "--out", run, *TINY, "--max-steps", "6",
                  "--log-every", "3"))
    assert export(run, out) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in
                                                                      out.iterdir()}
    model = AutoModelForMaskedLM.from_pretrained(out).eval()
    got, want = reference_logits(run, model)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert model.config.vocab_size == json.loads((mlm_dataset / "dataset.json").read_text())[
        "vocab_size"]
    fill = pipeline("fill-mask", model=str(out), tokenizer=str(out))
    tok = AutoTokenizer.from_pretrained(out)
    answers = fill(f"def main({tok.mask_token}):", top_k=3)
    assert len(answers) == 3 and all(tok.mask_token not in a["sequence"] for a in answers)
    assert manifest.verify(out)  # every file's size and checksum, as a checkpoint tag's
    # --init-from reads an export or a run as `app export` reads a tag: verified, one line
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    os.truncate(cut / "model.safetensors", (cut / "model.safetensors").stat().st_size // 2)
    bad = shutil.copytree(run, tmp_path / "bad")
    flip(bad / "checkpoints" / "global_step6" / "mp_rank_00_model_states.pt")
    for source, needle in ((cut, "model.safetensors"), (bad, "mp_rank_00_model_states.pt")):
        proc = run_app("train", "--data", mlm_dataset, "--out", tmp_path / f"o_{source.name}",
                       *TINY, "--max-steps", "2", "--init-from", source)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert [ln for ln in error_lines(proc.stderr) if needle in ln], proc.stderr[-2000:]
        assert not (tmp_path / f"o_{source.name}").exists()
    (run / "checkpoints" / "latest").unlink()  # tags there, none named: the message lists them
    assert app_main(["export", str(run), "--out", str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err
    assert "no 'latest' naming a checkpoint; its tags: global_step6: pass one with --tag" in err


def test_zero3_clm_export_loads_with_the_trained_logits(clm_dataset, tmp_path):
    run, out = tmp_path / "run", tmp_path / "hf"
    check(run_app("train", "--data", clm_dataset, "--out", run, *TINY, "--objective", "clm",
                  "--zero", "3", "--max-steps", "4", "--log-every", "2"))
    assert json.loads((run / "config.json").read_text())["zero_stage"] == 3
    assert export(run, out) == 0
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    got, want = reference_logits(run, model)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("import os\n", return_tensors="pt").input_ids
    more = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)
    assert more.shape[1] == ids.shape[1] + 4


def test_bad_export_inputs(capsys, tmp_path):
    assert export(tmp_path / "nope", tmp_path / "o") == 2
    assert "no such run directory" in capsys.readouterr().err
    run = tmp_path / "run"
    run.mkdir()
    assert export(run, tmp_path / "o") == 2
    assert "no config.json" in capsys.readouterr().err
    (run / "config.json").write_text(json.dumps({"model": {}}))
    assert export(run, tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "config.json: key 'model.preset' is missing" in err and "Traceback" not in err
    (run / "config.json").write_text(json.dumps({
        "model": {"preset": "bert-tiny", "objective": "mlm", "parameters": 1,
                  "config": {"model_type": "bert"}}, "run": {}}))
    assert export(run, tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "no checkpoint" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
