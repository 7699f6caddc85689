"""Encoder recipes (docs/recipes.md): RoBERTa and ModernBERT trained as MLM and exported, warm
starts (--init-from), warmup-stable-decay, sequence-length phases (--resume with a new
--seq-len)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline

from app.__main__ import main
from app.checkpoint.train_state import phase_position
from tests.helpers import TINY, check, metrics, run_app


def train_rows(run) -> list[dict]:
    return [r for r in metrics(run) if "train/loss" in r]


def one_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ": error: " in ln]
    assert len(lines) == 1, err
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("name,cls", [("roberta-tiny", "RobertaForMaskedLM"),
                                      ("modernbert-tiny", "ModernBertForMaskedLM")])
def test_each_encoder_family_trains_as_mlm_and_exports(name, cls, mlm_dataset, tmp_path):
    run, out = tmp_path / "run", tmp_path / "hf"
    check(run_app("train", "--data", mlm_dataset, "--out", run, *TINY, "--model", name,
                  "--max-steps", "12", "--log-every", "4", "--lr", "2e-3"))
    assert json.loads((run / "config.json").read_text())["model"]["objective"] == "mlm"
    rows = train_rows(run)
    assert rows[-1]["train/loss"] < 0.9 * rows[0]["train/loss"]
    assert "eval/accuracy" in metrics(run)[-1]  # the MLM figure: masked positions scored
    check(run_app("export", run, "--out", out))
    model = AutoModelForMaskedLM.from_pretrained(out).eval()
    assert type(model).__name__ == cls
    ref = torch.load(run / "reference.pt")
    with torch.no_grad():
        got = model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"]).logits
    torch.testing.assert_close(got, ref["logits"], rtol=0, atol=1e-4)
    tok = AutoTokenizer.from_pretrained(out)
    answers = pipeline("fill-mask", model=model, tokenizer=tok)(f"def {tok.mask_token}(self):")
    assert answers and all(tok.mask_token not in a["sequence"] for a in answers)


@pytest.mark.slow
def test_init_from_starts_near_the_exports_loss_and_refuses_a_mismatch(
        mlm_dataset, clm_dataset, tmp_path, capsys):
    source, hf, warm = tmp_path / "src", tmp_path / "hf", tmp_path / "warm"
    check(run_app("train", "--data", mlm_dataset, "--out", source, *TINY, "--max-steps", "60",
                  "--log-every", "20", "--eval-samples", "64", "--lr", "3e-3"))
    check(run_app("export", source, "--out", hf))
    eval_loss = [r["eval/loss"] for r in metrics(source) if "eval/loss" in r][-1]
    # the first loss over 4 micro batches of 16 against the eval loss over 64 samples: one micro
    # batch of 4 alone differs from it by 10 % now and then (masking and sampling noise). One
    # step (64 samples, 16 of TINY's steps): only its loss, taken before any update, is read;
    # nor is its end-of-run eval (8 samples)
    proc = check(run_app("train", "--data", mlm_dataset, "--out", warm, *TINY, "--init-from",
                         hf, "--seed", "8", "--max-steps", "1", "--log-every", "1", "--lr", "1e-5",
                         "--micro-batch", "16", "--grad-accum", "4", "--eval-samples", "8"))
    assert "init: weights from" in proc.stderr and "fresh optimizer" in proc.stderr
    first = train_rows(warm)[0]
    vocab = json.loads((mlm_dataset / "dataset.json").read_text())["vocab_size"]
    assert first["step"] == 1 and first["train/loss"] < 0.85 * math.log(vocab)
    assert abs(first["train/loss"] - eval_loss) <= 0.1 * eval_loss, (first, eval_loss)
    # the run directory itself (its latest checkpoint, with its trained padding rows of the
    # vocabulary, which the export drops): the same weights, about the same first loss
    check(run_app("train", "--data", mlm_dataset, "--out", tmp_path / "warm2", *TINY,
                  "--init-from", source, "--seed", "8", "--max-steps", "1", "--lr", "1e-5",
                  "--micro-batch", "16", "--grad-accum", "4", "--eval-samples", "8"))
    assert train_rows(tmp_path / "warm2")[0]["train/loss"] == pytest.approx(first["train/loss"],
                                                                            rel=0.01)
    # another geometry, another tokenizer, ZeRO-3: one line each, nothing trained
    base = ["train", "--data", str(mlm_dataset), *TINY, "--init-from", str(hf), "--max-steps", "1"]
    assert main([*base, "--out", str(tmp_path / "a"), "--model-arg", "num_hidden_layers=3"]) == 2
    one_error(capsys, "--init-from", "num_hidden_layers is 2")
    assert main([*base, "--out", str(tmp_path / "b"), "--model", "roberta-tiny"]) == 2
    one_error(capsys, "--init-from", "a bert model")
    assert main([*base, "--out", str(tmp_path / "c"), "--zero", "3"]) == 2
    one_error(capsys, "--init-from", "ZeRO-3")
    other = ["train", "--data", str(clm_dataset), *TINY, "--init-from", str(hf),
             "--objective", "mlm", "--max-steps", "1", "--out", str(tmp_path / "d")]
    assert main(other) == 2
    one_error(capsys, "--init-from")
    assert not any((tmp_path / n / "metrics.jsonl").exists() for n in "abcd")


@pytest.mark.slow
def test_wsd_holds_the_peak_and_resumes_exactly(mlm_dataset, tmp_path):
    flags = [*TINY, "--max-steps", "12", "--log-every", "1", "--lr", "1e-3", "--lr-decay", "wsd",
             "--decay-fraction", "0.25", "--warmup-steps", "2", "--dropout", "0",
             "--eval-samples", "8"]  # the evals: not read
    whole, split = tmp_path / "whole", tmp_path / "split"
    check(run_app("train", "--data", mlm_dataset, "--out", whole, *flags))
    check(run_app("train", "--data", mlm_dataset, "--out", split, *flags, "--stop-at-step", "6"))
    check(run_app("train", "--data", mlm_dataset, "--out", split, *flags, "--resume", "auto"))
    lr = {r["step"]: r["train/lr"] for r in train_rows(whole)}
    assert [lr[s] for s in range(3, 10)] == [1e-3] * 7  # stable: the decay is the last 3 steps
    assert lr[10] > lr[11] > lr[12] and lr[12] < 0.5e-3
    again = {r["step"]: (r["train/lr"], r["train/loss"]) for r in train_rows(split)}
    assert again == {r["step"]: (r["train/lr"], r["train/loss"]) for r in train_rows(whole)}


def test_phase_position_maps_window_tokens_and_keeps_documents():
    # 80 samples of 64 tokens = 5,120 tokens = 40 samples of 128, already a whole batch of 8
    assert phase_position(80, old_seq_len=64, new_seq_len=128, packing="concat",
                          global_batch=8) == 40
    # 30 x 128 = 3,840 tokens = 7.5 samples of 512: sample 8, rounded up to a batch of 16
    assert phase_position(30, old_seq_len=128, new_seq_len=512, packing="concat",
                          global_batch=16) == 16
    assert phase_position(48, old_seq_len=128, new_seq_len=32, packing="concat",
                          global_batch=8) == 192
    # one document a sample: the same documents whatever the length
    assert phase_position(30, old_seq_len=128, new_seq_len=512, packing="doc",
                          global_batch=16) == 30


@pytest.mark.slow
def test_a_sequence_length_phase_continues_the_run(mlm_dataset, tmp_path):
    run = tmp_path / "run"
    flags = ["--data", mlm_dataset, "--out", run, "--micro-batch", "4", "--eval-samples", "8",
             "--wandb", "disabled", "--num-workers", "0", "--max-steps", "8", "--log-every", "1",
             "--save-every", "2"]
    check(run_app("train", *flags, "--seq-len", "32", "--stop-at-step", "5"))
    proc = check(run_app("train", *flags, "--seq-len", "64", "--resume", "auto"))
    # 5 steps x 4 samples x 32 tokens = 640 tokens = 10 samples of 64: sample 12 (3 batches)
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("phase:"))
    assert "--seq-len 32 -> 64 at step 5" in line and "sample 20 of the 32-token stream" in line
    assert "maps to sample 12 of the 64-token stream" in line
    assert "step 6 trains global batch 3 (samples 12-15" in line
    rows = {r["step"]: r for r in train_rows(run)}
    assert sorted(rows) == list(range(1, 9))
    assert [rows[s]["consumed_samples"] for s in (5, 6, 8)] == [20, 16, 24]
    assert [rows[s]["tokens_seen"] for s in (5, 6, 8)] == [640, 640 + 256, 640 + 3 * 256]
    assert json.loads((run / "summary.json").read_text())["tokens_seen"] == 640 + 3 * 256


def test_a_loaded_state_starts_a_phase_and_skips_only_its_own_batches(tmp_path):
    from app.checkpoint.train_state import TrainState
    from app.rundir import add_skipped, read_skipped

    saved = {"step": 10, "consumed_samples": 80, "tokens_seen": 5120, "global_batch": 8,
             "run_config": {"seq_len": 64, "packing": "concat"}}
    state = TrainState(facts={"global_batch": 8, "run_config": {"seq_len": 128,
                                                                "packing": "concat"}})
    state.load_state_dict(saved)
    assert (state.step, state.consumed_samples, state.tokens_seen, state.phase_step) == \
        (10, 40, 5120, 10)
    state.advance(8, 128)
    again = TrainState(facts=state.facts)  # a later resume of phase 2: nothing to map
    again.load_state_dict({**state.state_dict(), "run_config": state.facts["run_config"]})
    assert (again.consumed_samples, again.tokens_seen, again.phase_step) == (48, 6144, 10)
    for step, batch in ((4, 5), (12, 7)):  # batch 5 of phase 1's stream, batch 7 of phase 2's
        add_skipped(tmp_path, {"step": step, "global_batch": batch, "positions": [],
                               "reason": "spike"})
    assert read_skipped(tmp_path) == {5, 7} and read_skipped(tmp_path, since_step=10) == {7}
