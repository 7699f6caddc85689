"""--attn flex (app/flex.py): PyTorch's FlexAttention with BlockMasks, against SDPA on the same
masks; where a step runs SDPA instead (attention dropout, no backward on CPU), the same numbers
as --attn sdpa."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    bidirectional_mask_function,
    causal_mask_function,
    sliding_window_bidirectional_mask_function,
)

from app import flex
from app.config import TrainConfig
from app.models.attention import document_attention
from app.models.build import build_model
from app.models.presets import attention_dropout, build_config
from app.plan.command import add_arguments as plan_arguments
from app.runtime.device import Device, choose_attention, flex_backward, flex_compiled, flex_why
from data_tools.errors import UserError
from tests.helpers import check, run_app, train_losses

CPU = Device(name="cpu", backend="gloo", pin_memory=False, bf16_supported=True,
             fp16_supported=False)
GPU = Device(name="cuda", backend="nccl", pin_memory=True, bf16_supported=True,
             fp16_supported=True, model="NVIDIA H100 80GB HBM3")


def documents(batch: int, seq: int, seed: int) -> torch.Tensor:
    """[batch, seq] document ids from 1 in runs of random lengths, padding (0) at the end."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        row, doc = [], 1
        while len(row) < seq - 7:
            row += [doc] * int(torch.randint(1, 40, (), generator=g))
            doc += 1
        rows.append((row[:seq - 7] + [0] * 7))
    return torch.tensor(rows)


def qkv(batch: int, heads: int, seq: int, dim: int = 16, kv_heads: int | None = None,
        seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, h, seq, dim, generator=g)
                 for h in (heads, kv_heads or heads, kv_heads or heads))


@pytest.mark.parametrize("seq", [128, 100, 200])  # one block, less than one, a block and a part
@pytest.mark.parametrize("window", [None, 5])
def test_flex_document_mask_gives_sdpas_attention(seq, window):
    """FlexAttention (eager, forward) with the documents' BlockMask: SDPA's output with the
    boolean mask `--attn sdpa` trains with (document_attention), row for row."""
    ids = documents(3, seq, seed=seq)
    q, k, v = qkv(3, 2, seq)
    mask = flex.document_block_mask(ids, window)
    assert isinstance(mask, BlockMask) and mask.shape == (3, 1, seq, seq)
    dense = document_attention(ids, "sdpa", torch.float32, window=window)
    assert torch.equal(flex.dense_mask(mask), dense)
    with torch.no_grad():
        got = flex_attention(q, k, v, block_mask=mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_documents_block_mask_skips_tiles_between_documents():
    """Two documents of 128 tokens in a 256-token window: the two off-diagonal 128 x 128 tiles
    hold no pair, so the BlockMask (what the fused kernel visits) has half the tiles, each full
    (no mask_mod evaluated inside it)."""
    ids = torch.tensor([[1] * 128 + [2] * 128])
    mask = flex.document_block_mask(ids)
    assert mask.full_kv_num_blocks.tolist() == [[[1, 1]]]
    assert mask.kv_num_blocks.tolist() == [[[0, 0]]]  # no partial tile
    assert mask.sparsity() == pytest.approx(50.0)


def test_the_attention_function_runs_flex_without_grad_and_sdpa_on_a_cpu_backward():
    """The registered function: without a gradient FlexAttention's output; with one on CPU
    (torch has no FlexAttention backward there) SDPA on the same mask, bit for bit the output
    and gradients of transformers' SDPA function with the dense mask; with attention dropout
    SDPA again, drawing the same random numbers."""
    module = torch.nn.Module()
    ids = documents(2, 96, seed=1)
    mask = flex.document_block_mask(ids)
    dense = document_attention(ids, "sdpa", torch.float32)
    q, k, v = qkv(2, 4, 96)
    with torch.no_grad():
        out, _ = flex.flex_attention_forward(module, q, k, v, mask, scaling=0.3)
        ref, _ = sdpa_attention_forward(module, q, k, v, dense, scaling=0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grads = []
    for fn, m in ((flex.flex_attention_forward, mask), (sdpa_attention_forward, dense)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(5)
        out, _ = fn(module, *leaves, m, dropout=0.2, scaling=0.3)
        out.square().sum().backward()
        grads.append([out.detach()] + [t.grad for t in leaves])
    for got, want in zip(*grads):
        assert torch.equal(got, want)


def test_grouped_query_heads_and_no_mask():
    """Fewer key/value heads than query heads (Llama's grouping), and no mask (full attention)."""
    q, k, v = qkv(2, 4, 64, kv_heads=2)
    with torch.no_grad():
        out, _ = flex.flex_attention_forward(torch.nn.Module(), q, k, v, None)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_a_dense_mask_is_refused():
    q, k, v = qkv(1, 2, 8)
    with pytest.raises(ValueError, match="expected a BlockMask"):
        flex.flex_attention_forward(torch.nn.Module(), q, k, v, torch.ones(1, 1, 8, 8).bool())


def test_transformers_masks_become_block_masks_with_padding_and_no_host_read():
    """The mask interface: full bidirectional attention without padding is no mask; padding and
    the families' mask functions (causal, sliding window) become BlockMasks of the same pairs."""
    assert flex.flex_mask(2, 16, 16, mask_function=bidirectional_mask_function) is None
    pad = torch.ones(2, 16, dtype=torch.long)
    pad[1, 10:] = 0
    keep = pad.bool()[:, None, None, :]
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    window = (torch.arange(16)[:, None] - torch.arange(16)).abs() <= 3
    cases = [(bidirectional_mask_function, pad, keep.expand(2, 1, 16, 16)),
             (causal_mask_function, None, causal[None, None]),
             (causal_mask_function, pad, causal & keep),
             (sliding_window_bidirectional_mask_function(3), pad, window & keep)]
    for fn, padding, want in cases:
        mask = flex.flex_mask(2, 16, 16, mask_function=fn, attention_mask=padding)
        assert torch.equal(flex.dense_mask(mask), want)
    assert torch.equal(flex.dense_mask(flex.causal_block_mask(pad, 16, "cpu")), causal & keep)
    assert flex.causal_block_mask(None, 16, "cpu") is flex.causal_block_mask(None, 16, "cpu")


@pytest.mark.parametrize("name", ["bert-tiny", "roberta-tiny", "modernbert-tiny", "gpt-tiny",
                                  "llama-tiny"])
def test_every_family_builds_with_flex_and_gives_sdpas_logits(name):
    """Each preset family with --attn flex: the training model's eval logits (FlexAttention,
    eager) equal SDPA's, with padding; ModernBERT's sliding windows shorter than the input."""
    overrides = {"local_attention": 16} if name.startswith("modernbert") else {}
    ids = torch.randint(5, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    pad = torch.ones(2, 48, dtype=torch.long)
    pad[1, 30:] = 0
    logits = {}
    for attn in ("sdpa", "flex"):
        config = build_config(name, vocab_size=500, special_ids={"pad_token_id": 0},
                              attn_implementation=attn, overrides=overrides)
        model = build_model(config, seed=0, for_training=True).eval()
        with torch.no_grad():
            logits[attn] = model(input_ids=ids, attention_mask=pad).logits * pad[..., None]
    torch.testing.assert_close(logits["flex"], logits["sdpa"], rtol=1e-5, atol=1e-5)


def test_the_device_table_and_the_start_up_line():
    """Compiled on CUDA only; no backward on CPU; the reason names what runs where."""
    assert flex_compiled("cuda") and not flex_compiled("cpu")
    assert flex_backward("cuda") and not flex_backward("cpu")
    assert choose_attention("flex", GPU, "bf16", "doc-packed") == (
        "flex", "as asked; FlexAttention (compiled) with block masks")
    name, why = choose_attention("flex", CPU, "fp32", "doc-packed")
    assert name == "flex" and "no FlexAttention backward on cpu" in why
    assert "no attention dropout (0.1 here; --dropout 0" in flex_why("cuda", 0.1)
    bert = build_config("bert-tiny", vocab_size=500, special_ids={})
    assert attention_dropout(bert) == 0.1
    assert attention_dropout(build_config("gpt-tiny", vocab_size=500, special_ids={},
                                          dropout=0.0)) == 0.0


def test_flex_is_an_attn_choice_of_train_and_plan():
    assert TrainConfig(data=Path("d"), out=Path("o"), attn="flex").attn == "flex"
    with pytest.raises(UserError, match="expected one of auto, sdpa, eager, "
                                        "flash_attention_2, flex"):
        TrainConfig(data=Path("d"), out=Path("o"), attn="flexx")
    parser = argparse.ArgumentParser()
    plan_arguments(parser)
    assert parser.parse_args(["--model", "bert-120m", "--attn", "flex"]).attn == "flex"


# -- training runs --------------------------------------------------------------------------------

def train(data, out, *args: str) -> dict[int, float]:
    check(run_app("train", "--data", data, "--out", out, "--seq-len", "128", "--micro-batch",
                  "4", "--seed", "9", "--log-every", "1", "--eval-every", "0", "--max-steps", "6",
                  "--precision", "fp32", "--eval-samples", "16", "--wandb", "disabled",
                  "--num-workers", "0", *args))
    return train_losses(out)


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [None, "0"])
def test_doc_packed_flex_trains_sdpas_losses(mlm_dataset, tmp_path, dropout):
    """The acceptance check's run (bert-tiny, doc-packed, seq 128 x micro 4, 6 steps, fp32):
    --attn flex trains the losses of --attn sdpa (the same SDPA call on CPU, the same masks)
    and evaluates within 1e-5 of it (eval runs FlexAttention itself); config.json says flex.
    With the preset's attention dropout and without."""
    extra = ["--model", "bert-tiny", "--packing", "doc-packed"]
    extra += ["--dropout", dropout] if dropout else []
    runs = {a: tmp_path / a for a in ("sdpa", "flex")}
    losses = {a: train(mlm_dataset, run, *extra, "--attn", a) for a, run in runs.items()}
    assert sorted(losses["flex"]) == sorted(losses["sdpa"]) == list(range(1, 7))
    for step, loss in losses["sdpa"].items():
        assert abs(losses["flex"][step] - loss) <= 1e-4 * abs(loss), step
    config = json.loads((runs["flex"] / "config.json").read_text())["model"]
    assert config["attention"] == "flex" and "FlexAttention (eager) in eval" in \
        config["attention_why"]
    evals = [[r["eval/loss"] for r in map(json.loads, (run / "metrics.jsonl").open())
              if "eval/loss" in r] for run in runs.values()]
    assert evals[0] and evals[1] == pytest.approx(evals[0], rel=1e-5)


@pytest.mark.slow
def test_concat_gpt_flex_trains_sdpas_losses(clm_dataset, tmp_path):
    """A causal LM (gpt-tiny, concat packing) with --attn flex: its causal BlockMask trains the
    losses of SDPA's causal kernel."""
    losses = {a: train(clm_dataset, tmp_path / a, "--model", "gpt-tiny", "--attn", a)
              for a in ("sdpa", "flex")}
    assert sorted(losses["flex"]) == list(range(1, 7))
    for step, loss in losses["sdpa"].items():
        assert abs(losses["flex"][step] - loss) <= 1e-5 * abs(loss), step
