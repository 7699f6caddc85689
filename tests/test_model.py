"""Presets: every one builds (geometry checked on the meta device), tiny ones run forward."""
import pytest
import torch

from app.models.build import build_model, count_parameters
from app.models.presets import (
    PRESETS,
    build_config,
    config_from_dict,
    max_positions,
    objective_of,
    parse_overrides,
)
from data_tools.errors import UserError

SPECIAL = {"pad_token_id": 0}
# Published sizes with their vocabularies (BERT 30,522; RoBERTa 50,265; ModernBERT 50,368;
# GPT-2 50,257), within 3%.
EXPECTED_PARAMS = {"bert-120m": (30522, 110e6), "bert-350m": (30522, 335e6),
                   "roberta-base": (50265, 125e6), "roberta-large": (50265, 355e6),
                   "modernbert-base": (50368, 149e6), "modernbert-large": (50368, 395e6),
                   "gpt-125m": (50257, 124e6), "gpt-350m": (50257, 355e6)}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds(name):
    vocab = EXPECTED_PARAMS.get(name, (1000, None))[0]
    config = build_config(name, vocab_size=vocab, special_ids=SPECIAL, dropout=0.0)
    assert config.vocab_size == vocab and objective_of(config) == PRESETS[name].objective
    with torch.device("meta"):  # geometry without allocating hundreds of MB
        model = build_model(config)
    n = count_parameters(model)
    if name in EXPECTED_PARAMS:
        assert n == pytest.approx(EXPECTED_PARAMS[name][1], rel=0.03)
    else:
        assert n < 2e6  # tiny presets stay tiny


@pytest.mark.parametrize("name", [n for n in sorted(PRESETS) if n.endswith("tiny")])
def test_tiny_presets_run_forward_backward_with_checkpointing(name):
    config = build_config(name, vocab_size=300, special_ids=SPECIAL, dropout=0.1)
    model = build_model(config, gradient_checkpointing=True, seed=0)
    ids = torch.randint(1, 300, (2, 16))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.logits.shape == (2, 16, 300)
    assert model.config._attn_implementation == "sdpa"


def test_same_seed_same_weights():
    config = build_config("bert-tiny", vocab_size=100, special_ids=SPECIAL)
    a, b = build_model(config, seed=3), build_model(config, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


def test_overrides_dropout_and_round_trip():
    config = build_config("gpt-tiny", vocab_size=500, special_ids={"eos_token_id": 2},
                          overrides=parse_overrides(["n_layer=3", "n_positions=256"]),
                          dropout=0.0)
    assert (config.n_layer, max_positions(config), config.resid_pdrop, config.attn_pdrop) == \
        (3, 256, 0.0, 0.0)
    again = config_from_dict(config.to_dict())
    assert again.n_layer == 3 and type(again) is type(config)


@pytest.mark.parametrize("kw,match", [
    (dict(name="bert-huge"), "unknown preset"),
    (dict(overrides={"num_layerz": 3}), "no field 'num_layerz'"),
    (dict(overrides={"vocab_size": 10}), "token ids go up to 99"),
])
def test_bad_model_settings(kw, match):
    settings = dict(name="bert-tiny", vocab_size=100, special_ids=SPECIAL) | kw
    with pytest.raises(UserError, match=match):
        build_config(**settings)
    with pytest.raises(UserError, match="KEY=VALUE"):
        parse_overrides(["layers"])


def masked_positions(labels: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-length labels as the loader hands them over: positions and labels, padded."""
    pos = torch.zeros(labels.size(0), slots, dtype=torch.long)
    out = torch.full((labels.size(0), slots), -100, dtype=torch.long)
    for row, p, o in zip(labels, pos, out):
        chosen = (row != -100).nonzero().flatten()
        p[:len(chosen)], o[:len(chosen)] = chosen, row[chosen]
    return pos, out


@pytest.mark.parametrize("name", ["bert-tiny", "roberta-tiny", "modernbert-tiny"])
def test_sparse_mlm_head_gives_the_same_loss_and_gradients(name):
    config = build_config(name, vocab_size=500, special_ids=SPECIAL, dropout=0.0)
    dense = build_model(config, seed=1)
    sparse = build_model(config, seed=1, for_training=True)
    ids = torch.randint(1, 500, (3, 32))
    labels = torch.where(torch.rand(3, 32) < 0.15, ids, torch.full_like(ids, -100))
    pos, mlm_labels = masked_positions(labels, 32 * 15 // 100 + 1 + 4)
    a = dense(input_ids=ids, labels=labels).loss
    b = sparse(input_ids=ids, mlm_positions=pos, mlm_labels=mlm_labels).loss
    torch.testing.assert_close(a, b)
    a.backward()
    b.backward()
    for p, q in zip(dense.parameters(), sparse.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    # without positions it is the plain model (eval, export); no masked token: loss 0, not NaN
    torch.testing.assert_close(sparse(input_ids=ids).logits, dense(input_ids=ids).logits)
    none = torch.full_like(mlm_labels, -100)
    assert sparse(input_ids=ids, mlm_positions=pos, mlm_labels=none).loss.item() == 0.0


def test_mlm_by_architecture_and_long_context():
    """Every encoder with a masked-LM head trains as MLM (not only model_type "bert"); RoBERTa
    gives its first pad id + 1 positions to its offset, ModernBERT takes 8,192 tokens."""
    from transformers import BertConfig, LlamaConfig, ModernBertConfig, RobertaConfig

    assert [objective_of(c()) for c in (BertConfig, RobertaConfig, ModernBertConfig,
                                        LlamaConfig)] == ["mlm", "mlm", "mlm", "clm"]
    assert objective_of(BertConfig(is_decoder=True)) == "clm"
    for pad in (0, 1, 5):
        rob = build_config("roberta-tiny", vocab_size=300, special_ids={"pad_token_id": pad})
        assert max_positions(rob) == 1024 and rob.max_position_embeddings == 1024 + pad + 1
    mb = build_config("modernbert-tiny", vocab_size=300,
                      special_ids={"pad_token_id": 0, "cls_token_id": 2, "sep_token_id": 3})
    assert max_positions(mb) == 8192 and mb.layer_types[0] == "full_attention"
    assert (mb.cls_token_id, mb.sep_token_id, mb.bos_token_id, mb.eos_token_id) == (2, 3, 2, 3)
    # ids the dataset does not give are not left pointing outside the vocabulary (50,281)
    bare = build_config("modernbert-tiny", vocab_size=300, special_ids=SPECIAL)
    assert bare.cls_token_id is None and bare.pad_token_id == 0
    model = build_model(bare, seed=0)
    ids = torch.randint(1, 300, (1, 1100))  # past BERT's 512 and RoBERTa's 1,024 positions
    assert model(input_ids=ids).logits.shape == (1, 1100, 300)
