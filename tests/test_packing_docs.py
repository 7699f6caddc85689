"""--packing doc-packed: whole documents side by side in a window, each attending only to itself
(app/data/packing.py, app.models.attention.document_attention), and real-token accounting in every
packing."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_data import CLS, PAD, SEP, random_docs, write_dataset
from transformers import AttentionInterface

from app.data import packing
from app.data.loader import (
    DataSpec,
    MixtureSpec,
    TokenWindows,
    build_eval_loader,
    build_train_loader,
    dataset_stats,
)
from app.data.masking import IGNORE_INDEX
from app.models.attention import check_packed_attention, document_attention, varlen_kwargs
from app.models.build import build_model
from app.models.presets import build_config
from app.settle import Phase, settle_schedule
from app.telemetry import figures as telemetry
from app.telemetry import flops
from app.trainer import EvalSet, eval_figures, real_tokens, token_sums
from data_tools.errors import UserError
from tests.helpers import check, run_app, script_ranks, train_losses

SEQ = 64


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory) -> Path:
    """Short documents (some longer than SEQ, so truncated) in two train shards, and a val split."""
    rng = np.random.default_rng(1)
    train = [random_docs(rng, 40, 2, 30), random_docs(rng, 25, 2, 90)]
    val = [random_docs(rng, 30, 2, 40) + random_docs(rng, 3, 70, 90)]
    return write_dataset(tmp_path_factory.mktemp("docs") / "ds", {"train": train, "val": val})


def spec(root: Path, packing_: str = "doc-packed", **kw) -> DataSpec:
    args = {"dataset_dir": root, "split": "train", "seq_len": SEQ, "objective": "mlm",
            "packing": packing_, "seed": 3}
    args.update(kw)
    return DataSpec(**args)


def take(loader, count: int) -> list[dict[str, torch.Tensor]]:
    return list(itertools.islice(iter(loader), count))


def unmasked(batch: dict[str, np.ndarray]) -> np.ndarray:
    return np.where(batch["labels"] != IGNORE_INDEX, batch["labels"], batch["input_ids"])


# -- layout ---------------------------------------------------------------------------------------

def test_each_document_is_laid_out_as_doc_lays_it_out(short_docs):
    packed, doc = TokenWindows(spec(short_docs)), TokenWindows(spec(short_docs, "doc"))
    plan = packed.plan
    assert sorted(plan.documents.tolist()) == list(range(doc.num_samples))  # each exactly once
    assert packed.num_samples == plan.windows < doc.num_samples
    seen = 0
    for w in range(plan.windows):
        batch = packed._packed_batch(np.array([w]), np.array([w]))  # window w itself
        ids, pos, did = unmasked(batch)[0], batch["position_ids"][0], batch["document_ids"][0]
        at, sizes = 0, []
        for place, d in enumerate(plan.window(w).tolist(), start=1):
            want, length = packing.doc_sample(doc.stream, d, SEQ, pad_id=PAD, eod_id=SEP,
                                              cls_id=CLS, bert_layout=True)
            assert ids[at:at + length].tolist() == want[:length].tolist()
            assert ids[at] == CLS and ids[at + length - 1] == SEP  # [SEP] kept on truncation
            assert pos[at:at + length].tolist() == list(range(length))
            assert (did[at:at + length] == place).all()
            at += length
            sizes.append(length)
        assert batch["tokens"][0, 0] == at <= SEQ
        slots = packing.window_docs(SEQ) + 1  # the documents, the padding, then empty ones
        assert batch["doc_lengths"][0].tolist() == sizes + [SEQ - at] + [0] * (slots - 1 -
                                                                               len(sizes))
        assert (did[at:] == 0).all() and (ids[at:] == PAD).all()
        assert (batch["labels"][0, at:] == IGNORE_INDEX).all()  # padding: no loss
        seen += at
    assert seen == plan.real_tokens


def test_the_plan_is_a_pure_function_of_the_seed_and_small(short_docs):
    lengths = np.random.default_rng(0).integers(1, SEQ + 1, size=5000)
    a = packing.pack_plan(lengths, SEQ, seed=3, max_docs=8)
    b = packing.pack_plan(lengths, SEQ, seed=3, max_docs=8)
    c = packing.pack_plan(lengths, SEQ, seed=4, max_docs=8)
    assert np.array_equal(a.documents, b.documents) and np.array_equal(a.starts, b.starts)
    assert not np.array_equal(a.documents, c.documents)
    sums = np.add.reduceat(lengths[a.documents], a.starts[:-1])
    assert sums.max() <= SEQ and np.diff(a.starts).max() == a.max_docs <= 8
    assert a.real_tokens / (a.windows * SEQ) > 0.95  # best fit leaves little padding
    assert a.documents.nbytes + a.starts.nbytes <= 16 * lengths.size + 16 * a.windows


def test_masked_positions_fit_the_width_with_many_documents(tmp_path):
    """Each document of a window may add a masked position (at least one per document): the
    width of mlm_positions grows with the plan's most documents, so none is lost."""
    rng = np.random.default_rng(2)
    root = write_dataset(tmp_path / "ds", {"train": [random_docs(rng, 200, 1, 4)]})
    s = spec(root, seq_len=32)
    batch = take(build_train_loader(s, micro_batch=4, global_batch=4, dp_rank=0, dp_size=1,
                                    consumed_samples=0, num_workers=0), 3)
    ds = TokenWindows(s)
    assert ds.max_docs == 2 and ds.plan.max_docs == 2  # the cap: max(2, seq_len // 16)
    for b, positions in zip(batch, range(0, 12, 4)):
        labels = ds.batch(list(range(positions, positions + 4)))["labels"]
        assert (b["mlm_labels"] != IGNORE_INDEX).sum() == (labels != IGNORE_INDEX).sum()


def test_decoders_are_refused(short_docs):
    with pytest.raises(UserError, match="doc-packed: for MLM"):
        spec(short_docs, objective="clm")


# -- the math per document ---------------------------------------------------------------------

# ModernBERT with a 16-token window (8 each side) in its local layers: windows of 64 tokens hold
# documents longer than it, so the sliding window and the documents both cut the attention (a
# larger init than its own, or the window would hardly move the loss).
MODELS = {"bert-tiny": {}, "roberta-tiny": {},
          "modernbert-tiny": {"local_attention": 16, "initializer_range": 0.2}}


# transformers builds a model whose attention is named flash* only with a flash kernel at hand:
# the reference is built as SDPA, then named (the name is looked up at each forward)
BUILT_AS = {"flash_varlen_reference": "sdpa"}


@functools.cache  # a pure function of its arguments: `doc` with sdpa is every family's reference
def eval_loss(root: Path, mode: str, attn: str, model: str = "bert-tiny") -> tuple[float, float]:
    """(eval loss, predicted tokens) of one fixed model over the whole val split (computed once
    for each set of arguments: the sdpa `doc` loss serves both of the tests comparing with it)."""
    config = build_config(model, vocab_size=500, attn_implementation=BUILT_AS.get(attn, attn),
                          special_ids={"pad_token_id": PAD, "cls_token_id": CLS,
                                       "sep_token_id": SEP}, overrides=MODELS[model])
    model = build_model(config, seed=0, for_training=True).eval()
    model.config._attn_implementation = attn  # read by every layer at each forward
    loader = build_eval_loader(spec(root, mode, split="val"), micro_batch=3, dp_rank=0,
                               dp_size=1, max_samples=None, num_workers=0)
    sums = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for batch in loader:
            real_tokens(batch, SEQ)
            sums += token_sums(model(**batch).logits, batch["mlm_labels"], "mlm")
    return float(sums[0] / sums[1]), float(sums[1])


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("attn", ["sdpa", "eager", "flex"])
def test_eval_loss_of_packed_documents_equals_doc(short_docs, attn, model):
    doc, doc_tokens = eval_loss(short_docs, "doc", attn, model)
    packed, packed_tokens = eval_loss(short_docs, "doc-packed", attn, model)
    assert packed_tokens == doc_tokens  # the same masked tokens of the same documents
    assert abs(packed - doc) <= 1e-5 * doc


def test_document_attention_is_block_diagonal():
    ids = torch.tensor([[1, 1, 2, 2, 2, 0]])
    mask = document_attention(ids, "sdpa", torch.float32)[0, 0]
    assert mask.shape == (6, 6) and mask.dtype == torch.bool
    assert mask[0, :2].all() and not mask[0, 2:].any() and not mask[2, :2].any()
    assert mask[5].tolist() == [False] * 5 + [True]  # padding: no empty softmax row
    additive = document_attention(ids, "eager", torch.float32)[0, 0]
    assert additive[0, 1] == 0 and additive[0, 2] == torch.finfo(torch.float32).min
    with pytest.raises(UserError, match="not a mask"):
        document_attention(ids, "flash_attention_2", torch.bfloat16)
    local = document_attention(torch.tensor([[1] * 5 + [2]]), "sdpa", torch.float32, window=2)
    assert local[0, 0, 0].tolist() == [True] * 3 + [False] * 3  # |i - j| <= 2, same document
    assert local[0, 0, 4].tolist() == [False, False, True, True, True, False]


def test_models_without_the_plumbing_are_refused_at_start_up():
    gpt = build_config("gpt-tiny", vocab_size=500, special_ids={})
    with pytest.raises(UserError, match="not supported for gpt2 models"):
        check_packed_attention(gpt)
    for name in MODELS:
        for attn in ("sdpa", "eager", "flash_attention_2", "flex"):
            check_packed_attention(build_config(name, vocab_size=500, special_ids={},
                                                attn_implementation=attn))


def test_varlen_lengths_cover_each_window():
    """flash-attention's cumulative lengths: each document, then the window's padding, as one
    sequence of the flattened batch; zero lengths (empty sequences) fill the width."""
    lengths = torch.tensor([[3, 2, 1, 0], [4, 2, 0, 0]])
    got = varlen_kwargs(lengths, 6)
    assert got["cu_seq_lens_q"].dtype == torch.int32 and got["cu_seq_lens_k"] is got[
        "cu_seq_lens_q"]
    assert got["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 6, 10, 12, 12, 12]
    assert got["max_length_q"] == got["max_length_k"] == 6


def varlen_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     sliding_window=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                     max_length_q=None, max_length_k=None, **kwargs):
    """flash-attention's variable-length call as transformers makes it (the batch flattened, one
    sequence per segment of `cu_seq_lens`, flash's window of sliding_window - 1 each side), in
    plain SDPA: what `--attn flash_attention_2` computes, on a CPU."""
    assert attention_mask is None and cu_seq_lens_q is cu_seq_lens_k
    b, h, s, d = query.shape
    assert max_length_q == max_length_k == s and cu_seq_lens_q[-1] == b * s
    q, k, v = (x.transpose(1, 2).reshape(b * s, h, d) for x in (query, key, value))
    out = torch.zeros_like(q)
    bounds = cu_seq_lens_q.tolist()
    for start, end in zip(bounds, bounds[1:]):
        at = torch.arange(end - start)
        mask = (None if sliding_window is None
                else (at[:, None] - at[None]).abs() <= sliding_window - 1)
        if end > start:
            out[start:end] = F.scaled_dot_product_attention(
                *(x[start:end].transpose(0, 1) for x in (q, k, v)), attn_mask=mask,
                scale=scaling).transpose(0, 1)
    return out.view(b, s, h, d), None


@pytest.mark.parametrize("model", list(MODELS))
def test_the_varlen_call_of_flash_attention_gives_doc_s_loss(short_docs, model):
    """The flash path (SparseHead.packed_inputs with an attention named flash*: no mask, the
    lengths as kwargs down to every layer's attention) through each family's real forward."""
    AttentionInterface.register("flash_varlen_reference", varlen_reference)
    doc, doc_tokens = eval_loss(short_docs, "doc", "sdpa", model)
    packed, packed_tokens = eval_loss(short_docs, "doc-packed", "flash_varlen_reference", model)
    assert packed_tokens == doc_tokens
    assert abs(packed - doc) <= 1e-5 * doc


# -- order, resume, mixtures, ranks --------------------------------------------------------------

def test_resume_mid_run_gives_the_tail_exactly(short_docs):
    kw = {"micro_batch": 2, "global_batch": 4, "dp_rank": 1, "dp_size": 2}
    s = spec(short_docs)
    full = take(build_train_loader(s, consumed_samples=0, num_workers=0, **kw), 40)
    resumed = take(build_train_loader(s, consumed_samples=4 * 13, num_workers=1, **kw), 27)
    for a, b in zip(full[13:], resumed):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # 40 micro batches of 2 cross epochs (the plan has fewer windows): masks differ by epoch
    windows = TokenWindows(s).num_samples
    assert 40 * 4 > 2 * windows


def test_a_mixture_of_packed_sources(short_docs, tmp_path):
    rng = np.random.default_rng(7)
    other = write_dataset(tmp_path / "other", {"train": [random_docs(rng, 50, 2, 12)]})
    mix = MixtureSpec(sources=(spec(short_docs), spec(other, seed=11)), names=("a", "b"),
                      weights=(0.5, 0.5))
    batches = take(build_train_loader(mix, micro_batch=4, global_batch=4, dp_rank=0, dp_size=1,
                                      consumed_samples=0, num_workers=0), 6)
    again = take(build_train_loader(mix, micro_batch=4, global_batch=4, dp_rank=0, dp_size=1,
                                    consumed_samples=12, num_workers=0), 3)
    for a, b in zip(batches[3:], again):
        assert all(torch.equal(a[k], b[k]) for k in a)
    slots = max(TokenWindows(s).max_docs for s in mix.sources)
    assert batches[0]["mlm_positions"].shape[1] == int(0.15 * SEQ) + slots
    for b in batches:  # positions restart at each document, ids number them
        starts = b["position_ids"] == 0
        assert ((b["document_ids"] > 0) & starts).sum() == (b["document_ids"].amax(1)).sum()


RANK_SCRIPT = '''
import os, sys, itertools, torch
sys.path.insert(0, {repo!r})
from app.data.loader import DataSpec, build_train_loader
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
spec = DataSpec({data!r}, "train", {seq}, "mlm", "doc-packed", seed=3)
loader = build_train_loader(spec, micro_batch=2, global_batch=8, dp_rank=rank, dp_size=world,
                            consumed_samples=16, num_workers=1)
torch.save(list(itertools.islice(iter(loader), 10)), os.path.join({out!r}, f"rank{{rank}}.pt"))
# the loader's worker told to stop now; left to interpreter exit, multiprocessing SIGTERMs it and
# the rank waits out its WORKER_TERM_GRACE_S (30 s, app/data/loader.py) before it can exit
del loader
'''


@pytest.mark.slow
@pytest.mark.multirank
def test_two_ranks_read_the_one_rank_stream_of_windows(short_docs, tmp_path):
    """Two real rank processes (a loader worker each; forked with the environment DeepSpeed's
    launcher gives its ranks) read together exactly what one rank reads: a window is a sample,
    cut by ranks like any other."""
    repo = str(Path(__file__).resolve().parent.parent)
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT.format(repo=repo, data=str(short_docs), seq=SEQ,
                                         out=str(tmp_path)))
    script_ranks(script, repo)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    one = take(build_train_loader(spec(short_docs), micro_batch=2, global_batch=8, dp_rank=0,
                                  dp_size=1, consumed_samples=16, num_workers=0), 20)
    for g in range(5):
        got = ranks[0][2 * g:2 * g + 2] + ranks[1][2 * g:2 * g + 2]
        for a, b in zip(one[4 * g:4 * g + 4], got):
            assert all(torch.equal(a[k], b[k]) for k in a)


# -- real tokens ---------------------------------------------------------------------------------

def test_an_eval_with_no_token_to_predict_has_no_loss():
    """Before: lone [SEP] documents (whitespace-only ones, before prepare counted them as
    empty) gave eval loss 0 / max(0, 1) = 0.0 and "best eval loss 0.0": a perfect model. A set
    with no token to predict is left out; with none, no eval figures at all."""
    a, b = EvalSet("a", 0.5, list), EvalSet("b", 0.5, list)
    assert eval_figures([a], [[0.0, 0.0, 0.0]], "mlm") == {}
    mixed = eval_figures([a, b], [[0.0, 0.0, 0.0], [6.0, 3.0, 1.0]], "mlm")
    assert mixed["eval/loss"] == 2.0 and "eval/a/loss" not in mixed
    assert mixed["eval/b/loss"] == 2.0 and mixed["eval/accuracy"] == pytest.approx(1 / 3)


def test_stats_count_real_tokens_per_sample(short_docs):
    concat = dataset_stats(spec(short_docs, "concat"))
    doc = dataset_stats(spec(short_docs, "doc"))
    packed = dataset_stats(spec(short_docs))
    assert concat["real_tokens_per_sample"] == SEQ
    lengths = [TokenWindows(spec(short_docs, "doc")).batch([p])["tokens"][0, 0]
               for p in range(doc["num_samples"])]
    assert doc["real_tokens_per_sample"] == pytest.approx(np.mean(lengths))
    assert packed["num_samples"] * packed["real_tokens_per_sample"] == pytest.approx(
        sum(lengths))
    assert doc["real_tokens_per_sample"] < packed["real_tokens_per_sample"] <= SEQ
    # the tokens a real token attends to: the window; its document (the same in both layouts)
    span = float(np.sum(np.square(lengths, dtype=np.float64)) / np.sum(lengths))
    assert concat["attention_span"] == SEQ
    assert doc["attention_span"] == pytest.approx(span)
    assert packed["attention_span"] == pytest.approx(span) and span < 0.75 * SEQ


def test_mfu_counts_attention_per_document():
    shape = flops.ModelShape.from_config(build_config("bert-tiny", vocab_size=500,
                                                      special_ids={}))
    window = flops.flops_breakdown(shape, 512, 0.15)
    docs = flops.flops_breakdown(shape, 512, 0.15, attention_span=128.0)
    assert docs["attention"] == window["attention"] / 4  # len^2 per document, not S^2
    assert docs["matmuls"] == window["matmuls"] and docs["head"] == window["head"]
    assert flops.flops_per_token(shape, 512, 0.15, 128.0) == sum(docs.values())


def test_a_batch_hands_over_its_real_tokens(short_docs):
    for mode, want in (("doc", None), ("doc-packed", None), ("concat", 2 * SEQ)):
        batch = take(build_train_loader(spec(short_docs, mode), micro_batch=2, global_batch=2,
                                        dp_rank=0, dp_size=1, consumed_samples=0,
                                        num_workers=0), 1)[0]
        expected = want if want is not None else int(batch["tokens"].sum())
        assert real_tokens(batch, SEQ) == expected and "tokens" not in batch
        if mode != "concat":
            assert expected < 2 * SEQ


def test_interval_counts_real_tokens_and_padding():
    shape = telemetry.RunShape(global_batch=4, seq_len=100, world_size=2, flops_per_token=1e9,
                               peak_tflops=10.0)
    rows = [[2.0, 0.0, 1.0, 1, 1, 1, 0, 300.0], [2.0, 0.0, 1.0, 1, 1, 1, 0, 500.0]]
    f = telemetry.interval(rows, 2, shape)  # 2 steps x 4 samples x 100 = 800 slots, 800 real
    assert f["perf/tokens_per_sec"] == 400.0 and f["data/padding_pct"] == 0.0
    rows[1][-1] = 100.0
    f = telemetry.interval(rows, 2, shape)
    assert f["perf/tokens_per_sec"] == 200.0 and f["data/padding_pct"] == 50.0
    assert f["perf/mfu"] == pytest.approx(200.0 * 1e9 / 2 / 1e12 / 10.0)
    assert f["perf/samples_per_sec"] == 4.0


@pytest.mark.slow
def test_a_packed_run_logs_padding_and_stops_at_its_real_tokens(mlm_dataset, tmp_path):
    """`app train --packing doc-packed`: --max-tokens counts real tokens (the dataset's mean a
    window), every log interval has data/padding_pct, and the run exports like any other."""
    run = tmp_path / "run"
    stats = dataset_stats(DataSpec(mlm_dataset, "train", 128, "mlm", "doc-packed", seed=5))
    per_step = 4 * stats["real_tokens_per_sample"]
    check(run_app("train", "--data", mlm_dataset, "--out", run, "--model", "bert-tiny",
                  "--seq-len", "128", "--micro-batch", "4", "--packing", "doc-packed",
                  "--max-tokens", str(int(6.5 * per_step)), "--log-every", "2", "--seed", "5",
                  "--eval-every", "0", "--save-every", "0", "--wandb", "disabled"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "perf/tokens_per_sec" in r]
    assert [r["step"] for r in logged] == [2, 4, 6, 7]  # ceil(6.5 steps of real tokens)
    assert all(0 <= r["data/padding_pct"] < 25 for r in logged)
    # real_tokens_seen: the real tokens of the steps' windows exactly; tokens_seen: the windows
    windows = take(build_train_loader(DataSpec(mlm_dataset, "train", 128, "mlm", "doc-packed",
                                               seed=5), micro_batch=4, global_batch=4,
                                      dp_rank=0, dp_size=1, consumed_samples=0,
                                      num_workers=0), 7)
    real = np.cumsum([int(b["tokens"].sum()) for b in windows])
    assert [r["real_tokens_seen"] for r in logged] == [real[s - 1] for s in (2, 4, 6, 7)]
    assert [r["tokens_seen"] for r in logged] == [s * 4 * 128 for s in (2, 4, 6, 7)]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["real_tokens_seen"] == real[-1]
    assert any("eval/loss" in r for r in rows)


@pytest.mark.slow
def test_a_packed_run_resumes_exactly(mlm_dataset, tmp_path):
    """6 steps straight vs 3, stop, resume (dropout on, a loader worker): the same losses."""
    common = ["--data", mlm_dataset, "--model", "bert-tiny", "--packing", "doc-packed",
              "--seq-len", "128", "--micro-batch", "4", "--max-steps", "6", "--grad-accum", "2",
              "--dropout", "0.1", "--log-every", "1", "--eval-every", "3", "--eval-samples", "8",
              "--num-workers", "1", "--wandb", "disabled"]
    check(run_app("train", *common, "--out", tmp_path / "straight"))
    check(run_app("train", *common, "--out", tmp_path / "split", "--stop-at-step", "3"))
    assert "resumed from" in check(run_app("train", *common, "--out", tmp_path / "split")).stderr
    straight, split = train_losses(tmp_path / "straight"), train_losses(tmp_path / "split")
    assert sorted(split) == sorted(straight) == list(range(1, 7))
    for step in straight:
        assert split[step] == pytest.approx(straight[step], abs=1e-6), step
    seen = [{r["step"]: r["real_tokens_seen"] for r in map(json.loads, (tmp_path / d
                                                                       / "metrics.jsonl")
                                                           .read_text().splitlines())
             if "train/loss" in r} for d in ("straight", "split")]
    assert seen[0] == seen[1] and sorted(seen[0]) == list(range(1, 7))  # carried over exactly
    assert 0 < seen[0][6] <= 6 * 8 * 128


def test_a_phase_spends_the_token_budget_from_the_real_tokens_seen():
    """--max-tokens after a --seq-len phase: the steps left are the budget minus the
    checkpoint's real tokens, at this phase's real tokens a step; a checkpoint from before the
    count takes its window tokens at this phase's real share."""
    cfg = SimpleNamespace(max_steps=10_000, max_tokens=100_000, seq_len=128, warmup_steps=1,
                          lr_decay="cosine", min_lr_ratio=0.1, decay_fraction=0.2,
                          decay_shape="linear")
    phase = Phase(step=10, tokens_seen=40_960, real_tokens_seen=20_000, old_seq_len=64,
                  consumed_samples=640, position=320)
    total, _, _ = settle_schedule(cfg, 8, phase, real_tokens_per_sample=100.0)
    assert total == 10 + 100  # (100,000 - 20,000) / (8 x 100)
    old = dataclasses.replace(phase, real_tokens_seen=None)
    total, _, _ = settle_schedule(cfg, 8, old, real_tokens_per_sample=100.0)
    assert total == 10 + math.ceil((100_000 - 40_960 * 100 / 128) / 800)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["roberta-tiny", "modernbert-tiny"])
def test_roberta_and_modernbert_train_packed(mlm_dataset, tmp_path, model):
    """`app train --packing doc-packed` with the other encoder families: the start-up accepts
    them, the loss falls, the counters count real tokens."""
    run = tmp_path / model
    check(run_app("train", "--data", mlm_dataset, "--out", run, "--model", model,
                  "--seq-len", "128", "--micro-batch", "8", "--packing", "doc-packed",
                  "--max-steps", "16", "--log-every", "4", "--lr", "2e-3", "--seed", "5",
                  "--eval-every", "0", "--save-every", "0", "--wandb", "disabled"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 4 and losses[-1] < 0.9 * losses[0]
    last = [r for r in rows if "real_tokens_seen" in r][-1]
    assert 0 < last["real_tokens_seen"] <= last["tokens_seen"] == 16 * 8 * 128
    assert any("eval/loss" in r for r in rows)
