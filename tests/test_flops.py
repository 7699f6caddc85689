"""FLOPs per token (app.telemetry.flops) and the accelerator table (app.telemetry.hardware): the
MFU building blocks."""
from __future__ import annotations

import pytest
import torch
from transformers import BertConfig

from app.models.build import build_model
from app.models.presets import PRESETS, build_config
from app.telemetry import hardware
from app.telemetry.flops import ModelShape, flops_breakdown, flops_per_token, head_fraction, mfu
from data_tools.errors import UserError

BLOCKS = ("BertLayer", "RobertaLayer", "ModernBertEncoderLayer", "GPT2Block", "LlamaDecoderLayer")


def shape_of(name: str, vocab: int = 4096, **overrides) -> ModelShape:
    return ModelShape.from_config(build_config(name, vocab_size=vocab, special_ids={},
                                               overrides=overrides))


def test_bert_tiny_by_hand():
    # bert-tiny: d=128, L=2, 2 heads, f=512, V=4096; S=128; the MLM head on 15% of positions.
    shape = shape_of("bert-tiny")
    assert (shape.hidden, shape.layers, shape.heads, shape.intermediate, shape.vocab) == \
        (128, 2, 2, 512, 4096)
    terms = flops_breakdown(shape, 128, head_fraction("mlm", 0.15))
    # per block: Q, K, V, O 4 x 128 x 128 = 65,536; MLP 2 x 128 x 512 = 131,072 -> 196,608
    assert terms["matmuls"] == 6 * 2 * 196_608 == 2_359_296
    assert terms["attention"] == 12 * 2 * 128 * 128 == 393_216  # full S x S, PaLM's convention
    # head: (d*V + d*d) = 524,288 + 16,384 = 540,672 weights on 15% of the tokens
    assert terms["head"] == pytest.approx(6 * 0.15 * 540_672) == pytest.approx(486_604.8)
    assert flops_per_token(shape, 128, 0.15) == pytest.approx(3_239_116.8)


def test_gpt2_reads_attribute_map_and_default_inner():
    shape = shape_of("gpt-125m", vocab=50257)
    assert (shape.hidden, shape.layers, shape.heads, shape.intermediate) == (768, 12, 12, 3072)
    assert shape.layer_matmul_params == 12 * 768 * 768  # the classic 12 d^2 per block
    # causal LM: the head runs on every position
    assert flops_breakdown(shape, 1024, head_fraction("clm"))["head"] == 6 * 768 * 50257


def test_llama_gqa_and_gated_mlp():
    shape = shape_of("llama-tiny")
    assert shape.gated_mlp and shape.kv_heads == 2 and shape.kv_dim == 64
    d, f = 128, 352
    assert shape.layer_matmul_params == 2 * d * d + 2 * d * 64 + 3 * d * f


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_matmul_params_match_the_real_blocks(name):
    """The 6N term counts exactly the blocks' matrix weights of the real model."""
    config = build_config(name, vocab_size=1000, special_ids={})
    with torch.device("meta"):
        model = build_model(config)
    shape = ModelShape.from_config(config)
    blocks = [m for m in model.modules() if type(m).__name__ in BLOCKS]
    assert len(blocks) == shape.layers
    weights = sum(p.numel() for b in blocks for p in b.parameters() if p.dim() == 2)
    assert weights == shape.layers * shape.layer_matmul_params


def test_bad_shapes_are_user_errors():
    with pytest.raises(UserError, match="not divisible by 5 attention heads"):
        ModelShape.from_config(BertConfig(hidden_size=128, num_attention_heads=5))
    with pytest.raises(UserError, match="num_hidden_layers"):
        ModelShape.from_config(BertConfig(num_hidden_layers=0))
    with pytest.raises(UserError, match="seq-len"):
        flops_per_token(shape_of("bert-tiny"), 0)


def test_mfu():
    # 1,000 tokens/s x 1e12 FLOPs each on 2 devices of 1,000 TFLOP/s = 50%
    assert mfu(1_000, 1e12, 1_000, devices=2) == pytest.approx(0.5)


def test_accelerator_lookup_ignores_case_and_separators():
    assert hardware.lookup("h100 sxm").name == "H100-SXM"
    assert hardware.lookup("H100_NVL").memory_gb == 94
    assert hardware.lookup("a100-sxm4-80gb").name == "A100-80GB"


def test_unknown_accelerator_lists_the_names():
    with pytest.raises(UserError) as e:
        hardware.lookup("Z9000")
    assert "Z9000" in str(e.value) and "H100-SXM" in str(e.value) and "\n" not in str(e.value)


def test_peak_by_precision():
    h100 = hardware.lookup("H100-SXM")
    assert h100.peak_tflops("bf16") == 989.5  # dense: half the datasheet's sparsity figure
    assert h100.peak_tflops("fp32") == 494.5  # fp32 matmuls run as TF32 by default
    assert h100.peak_tflops("fp32", allow_tf32=False) == 67
    with pytest.raises(UserError, match="no bf16"):
        hardware.lookup("V100-32GB").peak_tflops("bf16")


@pytest.mark.parametrize("acc", hardware.ACCELERATORS, ids=lambda a: a.name)
def test_table_is_consistent(acc):
    assert acc.memory_gb > 0 and acc.fp32 > 0
    ladder = [v for v in (acc.bf16 or acc.fp16, acc.tf32, acc.fp32) if v]
    assert ladder == sorted(ladder, reverse=True)  # lower precision is never slower
    assert hardware.lookup(acc.name) is acc
