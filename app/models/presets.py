"""Model presets and their `transformers` configs: the named geometries, the config of a preset
for a dataset's tokenizer with the user's overrides and their range checks, and what the app reads
off a config (the objective, the longest sequence, the attention's dropout).

Nothing is downloaded: a preset is a config dict; the vocabulary and special token ids come from
the dataset's tokenizer, and any config field can be overridden (`--model-arg key=value`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from dataclasses import field as default_of
from typing import Any, Mapping

from transformers import (
    AutoConfig,
    AutoModelForMaskedLM,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    ModernBertConfig,
    PretrainedConfig,
    RobertaConfig,
)

from data_tools.errors import UserError


@dataclass(frozen=True)
class Preset:
    """A named geometry: the `transformers` config class, its fields and its objective."""

    config_class: type
    objective: str
    """"mlm" (encoder, BERT-like) or "clm" (decoder, GPT-like)."""
    fields: Mapping[str, Any]
    ids: Mapping[str, str] = default_of(default_factory=dict)
    """Config fields that take the dataset's [CLS] or [SEP] id ("cls" or "sep"): an encoder
    family's own names for them (RoBERTa's <s> and </s> are its bos and eos)."""


def _bert(hidden: int, layers: int, heads: int) -> Preset:
    return Preset(BertConfig, "mlm", dict(hidden_size=hidden, num_hidden_layers=layers,
                                          num_attention_heads=heads, intermediate_size=4 * hidden,
                                          max_position_embeddings=512))


# Tokens of context of the RoBERTa presets (max_position_embeddings adds the pad id + 1).
ROBERTA_CONTEXT = 1024

def _roberta(hidden: int, layers: int, heads: int) -> Preset:
    """RoBERTa: BERT's geometry, one token type, 1,024 tokens of context. Its position ids start
    after the padding id, so build_config sizes max_position_embeddings from the pad id."""
    return Preset(RobertaConfig, "mlm", dict(hidden_size=hidden, num_hidden_layers=layers,
                                             num_attention_heads=heads, type_vocab_size=1,
                                             intermediate_size=4 * hidden,
                                             max_position_embeddings=ROBERTA_CONTEXT),
                  ids=dict(bos_token_id="cls", eos_token_id="sep"))


def _modernbert(hidden: int, layers: int, heads: int, glu: int) -> Preset:
    """ModernBERT (Warner et al. 2024): RoPE, pre-LN, no biases, GeGLU of width `glu`, global
    attention every third layer and a 128-token sliding window in the others, 8,192 positions."""
    return Preset(ModernBertConfig, "mlm", dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=glu, max_position_embeddings=8192, local_attention=128,
        global_attn_every_n_layers=3),
        ids=dict(bos_token_id="cls", eos_token_id="sep", cls_token_id="cls", sep_token_id="sep"))


def _gpt(hidden: int, layers: int, heads: int) -> Preset:
    return Preset(GPT2Config, "clm", dict(n_embd=hidden, n_layer=layers, n_head=heads,
                                          n_positions=1024))


PRESETS: dict[str, Preset] = {
    "bert-tiny": _bert(128, 2, 2),  # tests and the CPU demo
    "bert-120m": _bert(768, 12, 12),  # BERT-base geometry: the paper's small model
    "bert-350m": _bert(1024, 24, 16),  # BERT-large geometry: the paper's large model
    "roberta-tiny": _roberta(128, 2, 2),
    "roberta-base": _roberta(768, 12, 12),  # RoBERTa-base geometry (125M with its vocabulary)
    "roberta-large": _roberta(1024, 24, 16),  # RoBERTa-large geometry (355M)
    "modernbert-tiny": _modernbert(128, 3, 2, 192),
    "modernbert-base": _modernbert(768, 22, 12, 1152),  # ModernBERT-base (149M)
    "modernbert-large": _modernbert(1024, 28, 16, 2624),  # ModernBERT-large (395M)
    "gpt-tiny": _gpt(128, 2, 2),
    "gpt-125m": _gpt(768, 12, 12),  # GPT-2 small
    "gpt-350m": _gpt(1024, 24, 16),  # GPT-2 medium
    "llama-tiny": Preset(LlamaConfig, "clm", dict(
        hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)),
}

# Config fields that hold dropout probabilities, per model type (`--dropout` sets them all).
_DROPOUT_FIELDS = {
    "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "roberta": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "modernbert": ("attention_dropout", "embedding_dropout", "mlp_dropout"),
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "llama": ("attention_dropout",),
}
# The field among them that drops attention probabilities (--attn flex has no such dropout:
# app/flex.py runs those training steps through SDPA)
_ATTENTION_DROPOUT = {"bert": "attention_probs_dropout_prob",
                      "roberta": "attention_probs_dropout_prob", "modernbert": "attention_dropout",
                      "gpt2": "attn_pdrop", "llama": "attention_dropout"}


def attention_dropout(config: PretrainedConfig) -> float:
    """The probability the family's attention drops (0 for a family not listed)."""
    return float(getattr(config, _ATTENTION_DROPOUT.get(config.model_type, ""), 0.0) or 0.0)


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UserError(f"--model {name!r}: unknown preset (choose from {', '.join(PRESETS)})")
    return PRESETS[name]


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`key=value` strings to a dict; values read as JSON (numbers, true/false), else strings."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"--model-arg {item!r}: expected KEY=VALUE, e.g. num_hidden_layers=4")
        try:
            out[key] = json.loads(raw, parse_constant=_not_finite)
        except json.JSONDecodeError:
            out[key] = raw
        except ValueError:
            raise UserError(f"--model-arg {item}: not a finite number") from None
    return out


def _not_finite(name: str) -> Any:
    raise ValueError(name)


# Fields that count something (an int >= 1 when set) and names that hold probabilities.
_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "max_position_embeddings", "num_key_value_heads", "n_inner",
                "head_dim", "type_vocab_size")
_PROBABILITY_MARKS = ("dropout", "pdrop")


def check_config(config: PretrainedConfig, overrides: Mapping[str, Any]) -> None:
    """Ranges that `transformers` checks late or never (its config classes check types only):
    sizes at least 1, probabilities in [0, 1), heads dividing the width. UserError naming the
    --model-arg key."""
    amap = getattr(config, "attribute_map", {})

    def flag(field: str) -> str:
        names = [field, amap.get(field)] + [k for k, v in amap.items() if v == field]
        given = next((n for n in names if n in overrides), field)  # as the user spelled it
        return f"--model-arg {given}={getattr(config, field)!r}"

    for field in _SIZE_FIELDS:
        value = getattr(config, field, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{flag(field)}: must be a whole number, at least 1")
    for key, value in config.to_dict().items():
        if any(m in key for m in _PROBABILITY_MARKS) and isinstance(value, (int, float)) \
                and not isinstance(value, bool) and not 0.0 <= value < 1.0:
            raise UserError(f"{flag(key)}: a probability, must be in [0, 1)")
    heads = config.num_attention_heads
    if config.hidden_size % heads:
        raise UserError(f"{flag('hidden_size')}: not a multiple of num_attention_heads {heads}")
    kv = getattr(config, "num_key_value_heads", None)
    if kv and heads % kv:
        raise UserError(f"{flag('num_key_value_heads')}: does not divide num_attention_heads "
                        f"{heads}")


def padded_vocab(vocab_size: int, multiple: int) -> int:
    """The vocabulary rounded up to a multiple of `multiple`: the embedding and LM-head matrix
    products run on whole tensor-core tiles (Megatron pads to 128 for the same reason). The
    extra rows are never a target; an export keeps the tokenizer's size (app.export)."""
    return -(-vocab_size // multiple) * multiple


def build_config(name: str, *, vocab_size: int, special_ids: Mapping[str, int | None],
                 overrides: Mapping[str, Any] | None = None, dropout: float | None = None,
                 attn_implementation: str = "sdpa", pad_vocab_to: int = 1) -> PretrainedConfig:
    """The preset's config with the tokenizer's vocabulary (padded to `pad_vocab_to`) and ids,
    then the user's overrides (type-checked by the config class, range-checked by
    `check_config`)."""
    p = preset(name)
    overrides = dict(overrides or {})
    fields = dict(p.fields)
    fields["vocab_size"] = padded_vocab(vocab_size, pad_vocab_to)
    fields.update(_special_fields(p, special_ids, fields["vocab_size"]))
    if p.config_class is RobertaConfig:  # position ids run from pad + 1 (RobertaEmbeddings)
        fields["max_position_embeddings"] += int(fields.get("pad_token_id", 1)) + 1
    default = p.config_class(**fields)
    for key in _DROPOUT_FIELDS.get(default.model_type, ()):
        if dropout is not None:
            fields[key] = float(dropout)
    for key, value in overrides.items():
        if not hasattr(default, key):
            raise UserError(f"--model-arg {key}={value!r}: {default.model_type} configs have no "
                            f"field '{key}'")
        fields[default.attribute_map.get(key, key)] = value
    try:
        config = p.config_class(**fields)
    except Exception as e:  # noqa: BLE001 - transformers' strict field validation
        raise UserError(f"--model-arg: {str(e).strip().splitlines()[-1].strip()}") from None
    check_config(config, overrides)
    if int(config.vocab_size) < vocab_size:
        raise UserError(f"--model-arg vocab_size={config.vocab_size}: the dataset's token ids go "
                        f"up to {vocab_size - 1} (vocab_size {vocab_size} in dataset.json)")
    config._attn_implementation = attn_implementation
    return config


# Special-id fields of the configs: a preset's default one outside the vocabulary is cleared.
_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id")


def _special_fields(p: Preset, special_ids: Mapping[str, int | None],
                    vocab: int) -> dict[str, int | None]:
    """The dataset's ids as config fields: pad, bos and eos where given, [CLS] and [SEP]
    ("cls_token_id", "sep_token_id" in `special_ids`) under the family's names (`Preset.ids`);
    a preset default that would point outside the vocabulary (ModernBERT's 50,281) is None."""
    out = {k: v for k, v in special_ids.items()
           if v is not None and k not in ("cls_token_id", "sep_token_id")}
    for name, role in p.ids.items():
        out[name] = special_ids.get(f"{role}_token_id")
    default = p.config_class(**p.fields)
    for name in _ID_FIELDS:
        value = getattr(default, name, None)
        if name not in out and isinstance(value, int) and value >= vocab:
            out[name] = None
    return out


def config_from_dict(data: Mapping[str, Any]) -> PretrainedConfig:
    """Rebuild a saved config (config.json of a run) without knowing its class in advance."""
    data = dict(data)
    return AutoConfig.for_model(data.pop("model_type"), **data)


def max_positions(config: PretrainedConfig) -> int:
    """Longest sequence the model takes (GPT-2's n_positions through its attribute_map; RoBERTa
    spends the first pad id + 1 positions: its ids start after the padding id)."""
    if config.model_type in _OFFSET_POSITIONS:
        return int(config.max_position_embeddings) - int(config.pad_token_id or 0) - 1
    return int(config.max_position_embeddings)


_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert")


def objective_of(config: PretrainedConfig) -> str:
    """"mlm" for an encoder (an architecture with a masked-LM head: BERT, RoBERTa, ModernBERT),
    else "clm" (decoders: GPT-2, Llama, ...). By architecture, not name: a RoBERTa or ModernBERT
    config trained as a causal LM would learn nothing useful."""
    encoder = type(config) in AutoModelForMaskedLM._model_mapping \
        and not getattr(config, "is_decoder", False) \
        and not getattr(config, "is_encoder_decoder", False)
    return "mlm" if encoder else "clm"
