"""Model presets and their `transformers` models, built from configs with random weights.

Nothing is downloaded: a preset is a config dict; the vocabulary and special token ids come from
the dataset's tokenizer, and any config field can be overridden (`--model-arg key=value`).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from dataclasses import field as default_of
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    ModernBertConfig,
    ModernBertForMaskedLM,
    PretrainedConfig,
    PreTrainedModel,
    RobertaConfig,
    RobertaForMaskedLM,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions, MaskedLMOutput

from app.data.masking import IGNORE_INDEX
from app.flex import FLEX, FLEX_CAUSAL, causal_block_mask, document_block_mask
from app.losses import causal_lm_loss
from app.runtime.overlap import block_starts
from app.runtime.zero3_init import partitioned
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


class SparseHead:
    """A masked-LM model that, given the masked positions, runs the vocabulary head there only.

    The head (hidden x vocab per position) is most of a small encoder's step; MLM masks ~15% of
    positions, so this cuts a bert-tiny step about in half on CPU. The positions come as a
    fixed-width list per sample (`mlm_positions`, padded, with `mlm_labels` IGNORE_INDEX there;
    app.data.loader.BatchLayout): a gather with static shapes, no host sync. Same weights and the
    same loss (mean cross-entropy over the masked tokens); without positions it is the family's
    *ForMaskedLM, and exports load as one. A family names its encoder and head
    (`sparse_encoder`, `sparse_head`). ModernBERT's own `sparse_prediction` selects with a
    boolean mask instead: a host sync per step.
    """

    def forward(self, input_ids=None, attention_mask=None, mlm_positions=None, mlm_labels=None,
                document_ids=None, doc_lengths=None, **kwargs):
        if document_ids is not None:
            attention_mask = self.packed_inputs(document_ids, doc_lengths, kwargs)
        if mlm_positions is None:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden = self.sparse_encoder(input_ids=input_ids, attention_mask=attention_mask,
                                     **kwargs)[0]
        index = mlm_positions.unsqueeze(-1).expand(-1, -1, hidden.size(-1))
        logits = self.sparse_head(hidden.gather(1, index))
        flat = mlm_labels.reshape(-1)
        # sum / count on the device: a micro batch without a masked token gives 0, not NaN
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), flat,
                               ignore_index=IGNORE_INDEX, reduction="sum") \
            / (flat != IGNORE_INDEX).sum().clamp(min=1)
        return MaskedLMOutput(loss=loss, logits=logits)

    def packed_inputs(self, document_ids: torch.Tensor, doc_lengths: torch.Tensor | None,
                      kwargs: dict[str, Any]) -> Any:
        """--packing doc-packed: the attention mask that confines each token to its document
        (None with flash-attention, which gets the documents' cumulative lengths in `kwargs`
        instead: varlen_kwargs), and the family's position ids (`packed_positions`) in
        `kwargs`."""
        implementation = self.config._attn_implementation
        if "position_ids" in kwargs:
            kwargs["position_ids"] = self.packed_positions(kwargs["position_ids"])
        if implementation.startswith("flash"):
            if doc_lengths is None:
                raise UserError(f"--attn {implementation}: --packing doc-packed needs the "
                                f"documents' lengths (`doc_lengths`) from the loader")
            kwargs.update(varlen_kwargs(doc_lengths, document_ids.shape[1]))
            return None
        return self.document_mask(document_ids, implementation)

    def packed_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Position ids restarting at each document, as the family numbers a sample's."""
        return position_ids

    def document_mask(self, document_ids: torch.Tensor, implementation: str) -> Any:
        return document_attention(document_ids, implementation, self.dtype)


class SparseHeadBertForMaskedLM(SparseHead, BertForMaskedLM):
    """BertForMaskedLM with the sparse head (SparseHead)."""

    def sparse_encoder(self, **kwargs):
        return self.bert(**kwargs)

    def sparse_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.cls(hidden)


class SparseHeadRobertaForMaskedLM(SparseHead, RobertaForMaskedLM):
    """RobertaForMaskedLM with the sparse head (SparseHead)."""

    def sparse_encoder(self, **kwargs):
        return self.roberta(**kwargs)

    def sparse_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def packed_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """RoBERTa numbers a sample's tokens from the padding id + 1 (RobertaEmbeddings'
        `create_position_ids_from_input_ids`): so does each packed document."""
        return position_ids + (self.config.pad_token_id + 1)


class SparseHeadModernBertForMaskedLM(SparseHead, ModernBertForMaskedLM):
    """ModernBertForMaskedLM with the sparse head (SparseHead)."""

    def sparse_encoder(self, **kwargs):
        return self.model(**kwargs)

    def sparse_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.head(hidden))

    def document_mask(self, document_ids: torch.Tensor, implementation: str) -> Any:
        """One mask per layer type (ModernBertModel takes the mapping as it is): the global
        layers see the whole document, the local ones the document within the sliding window,
        |i - j| <= config.sliding_window, as create_bidirectional_sliding_window_mask has it in
        a sample of "doc" (a document's tokens are as far apart in its window as in its
        sample)."""
        return {"full_attention": document_attention(document_ids, implementation, self.dtype),
                "sliding_attention": document_attention(document_ids, implementation,
                                                        self.dtype,
                                                        window=self.config.sliding_window)}


# The sparse-head class of each MLM family this app trains (app.model.build_model)
SPARSE_HEADS = {"bert": SparseHeadBertForMaskedLM, "roberta": SparseHeadRobertaForMaskedLM,
                "modernbert": SparseHeadModernBertForMaskedLM}


CAUSAL_SDPA = "sdpa_causal"
"""The attention a training GPT-2 runs where the config says "sdpa" (causal_sdpa)."""


def causal_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention under a name its mask functions do not know (CAUSAL_SDPA).

    Without an inference cache, `create_causal_mask` looks at the position ids for packed
    sequences (`find_packed_sequence_indices`: a `.all()` read on the host every forward), and
    with padding `sdpa_mask` reads the mask to see whether it can skip it (another). For an
    implementation outside its mask mapping it returns the mask it was given at once
    (`_preprocess_mask_arguments`, transformers 5.24), with no work and no read: no mask is SDPA's
    own causal kernel (is_causal=True), and a padded batch comes with the 4D mask that
    CausalLossGPT2LMHeadModel builds on the device (causal_attention)."""
    if attention_mask is None:
        kwargs["is_causal"] = True
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(CAUSAL_SDPA, causal_sdpa)


def causal_attention(attention_mask: torch.Tensor | None, seq: int, implementation: str,
                     dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The attention mask a training GPT-2 hands its layers, built on the device (no host read):
    None for CAUSAL_SDPA without padding; else causal and, given the loader's [batch, seq]
    `attention_mask` (1 = token, 0 = padding), not onto padding (transformers' own causal mask
    with padding: `causal_mask_function` and `padding_mask_function`), [batch or 1, 1, seq, seq]:
    boolean for SDPA (True = attend), additive for eager attention (which masks nothing itself)."""
    if attention_mask is None and implementation == CAUSAL_SDPA:
        return None
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
    if implementation == CAUSAL_SDPA:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(
        ~mask, torch.finfo(dtype).min)


class LossHead(torch.nn.Linear):
    """A causal LM's tied head that, given the labels, returns the loss and no logits
    (app.losses.causal_lm_loss: the logits in chunks, never whole). A module call either way, so
    under ZeRO-3 this module's hooks gather the weight before the loss reads it and again before
    its backward, as for the stock head's matrix product."""

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(hidden)
        return causal_lm_loss(hidden, self.weight, labels, num_items_in_batch)


class CausalLossGPT2LMHeadModel(GPT2LMHeadModel):
    """GPT2LMHeadModel as the app trains it, same weights; exports load as the stock class.

    - The loss: with `labels`, the head and the cross-entropy run on chunks of the hidden states
      (LossHead); the output has the loss and no logits. Without labels (eval), the logits.
    - No inference cache: transformers' GPT-2 defaults to `use_cache=True`, which builds a
      DynamicCache and copies every layer's keys and values each forward. Off, transformers
      would then look for packed sequences in the position ids on the host every forward; so
      the model builds its own mask (causal_attention): none with SDPA (causal_sdpa's causal
      kernel), a 4D one for padded batches or eager attention, which transformers takes as it
      is; with --attn flex (FLEX_CAUSAL) a BlockMask handed to the attention function directly
      (app.flex.causal_block_mask: GPT2Model reads its mask as a tensor). Flash and other
      attentions keep transformers' own path (and its cache).
    GPT-2 takes no packed documents (PACKED_MODEL_TYPES): `position_ids`, when given, only number
    the positions. Not for generation: build the model without `for_training`.
    """

    def forward(self, input_ids=None, attention_mask=None, labels=None, position_ids=None,
                num_items_in_batch=None, **kwargs):
        if kwargs.get("use_cache") or kwargs.get("cache") is not None \
                or kwargs.get("past_key_values") is not None or input_ids is None:
            raise ValueError("a training GPT-2 takes input_ids and keeps no inference cache: "
                             "generate with build_model(config) (for_training=False) or an "
                             "exported model")
        implementation = self.config._attn_implementation
        use_cache = None  # transformers' default (the config's: on)
        if implementation == FLEX_CAUSAL:  # the mask goes past GPT2Model, which takes tensors
            kwargs["block_mask"] = causal_block_mask(attention_mask, input_ids.shape[-1],
                                                     input_ids.device)
            attention_mask, use_cache = None, False
        elif implementation in (CAUSAL_SDPA, "eager"):
            attention_mask = causal_attention(attention_mask, input_ids.shape[-1], implementation,
                                              self.lm_head.weight.dtype, input_ids.device)
            use_cache = False
        hidden = self.transformer(input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, use_cache=use_cache,
                                  **kwargs).last_hidden_state
        if labels is None:
            return CausalLMOutputWithCrossAttentions(logits=self.lm_head(hidden))
        return CausalLMOutputWithCrossAttentions(
            loss=self.lm_head(hidden, labels, num_items_in_batch))


PACKED_MODEL_TYPES = ("bert", "roberta", "modernbert")
"""Models whose training forward takes `document_ids`, `position_ids` and `doc_lengths`
(--packing doc-packed: SparseHead.packed_inputs)."""


def check_packed_attention(config: PretrainedConfig) -> None:
    """Refuse --packing doc-packed with a model that cannot confine attention to each document
    (one line, at start-up rather than at the first step). Every attention of --attn can: SDPA
    and eager with a block-diagonal mask, flash-attention with its variable-length kernels."""
    if config.model_type not in PACKED_MODEL_TYPES:
        raise UserError(f"--packing doc-packed: not supported for {config.model_type} models "
                        f"(supported: {', '.join(PACKED_MODEL_TYPES)}); use --packing doc")


def document_attention(document_ids: torch.Tensor, implementation: str, dtype: torch.dtype,
                       window: int | None = None) -> Any:
    """The block-diagonal attention of packed documents ("doc-packed", app.data.packing): token i
    attends to token j when both belong to the same document (and, with `window`, when
    |i - j| <= window: a sliding-window layer). `document_ids` [batch, seq] numbers each
    window's documents from 1 (0: padding, which attends only to padding, so no row of the
    softmax is empty). A [batch, 1, seq, seq] mask, built on the device from the loader's ids (no
    host sync), that transformers passes to every layer as it is: boolean for SDPA (True =
    attend), additive for eager attention; for --attn flex FlexAttention's BlockMask of the same
    pairs (app.flex.document_block_mask)."""
    if implementation.startswith("flash"):
        raise UserError(f"--attn {implementation}: flash-attention takes the documents' lengths "
                        f"(varlen_kwargs), not a mask")
    if implementation == FLEX:
        return document_block_mask(document_ids, window)
    mask = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    if window is not None:
        at = torch.arange(document_ids.shape[1], device=document_ids.device)
        mask = mask & ((at.unsqueeze(-1) - at.unsqueeze(0)).abs() <= window)
    mask = mask.unsqueeze(1)
    if implementation == "sdpa":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, torch.finfo(dtype).min)


def varlen_kwargs(doc_lengths: torch.Tensor, seq_len: int) -> dict[str, Any]:
    """flash-attention's variable-length call for packed windows (transformers'
    `_flash_attention_forward` takes it when the mask is None: the batch flattened to
    [batch x seq] tokens, one sequence per document). `doc_lengths` [batch, slots]: each
    window's documents' lengths, then its padding's, then zeros (app.data.packing
    .place_documents); their running sum over the flattened batch is `cu_seq_lens` (int32, on
    the device: no host sync; a zero length is an empty sequence, which the kernel skips). The
    longest sequence is at most seq_len, a Python int as the kernel's grid needs: an upper bound
    costs only empty blocks."""
    ends = doc_lengths.reshape(-1).cumsum(0)
    cu = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": seq_len,
            "max_length_k": seq_len}


def build_model(config: PretrainedConfig, *, gradient_checkpointing: bool = False,
                seed: int | None = None, for_training: bool = False,
                zero3_config: Mapping[str, Any] | None = None) -> torch.nn.Module:
    """A freshly initialised model for the config's objective (same seed, same weights).

    `for_training`: the MLM head takes the loader's masked positions (SparseHeadBertForMaskedLM);
    GPT-2 computes its loss in chunks, without a cache or a host read
    (CausalLossGPT2LMHeadModel); and the model skips transformers' per-forward look for padding
    in inputs given without an attention mask (a host sync each step; the loader hands over a
    mask whenever it pads).
    `zero3_config`: a ZeRO-3 DeepSpeed config; the model is then built partitioned
    (`deepspeed.zero.Init`, in a process group): no rank ever holds all of it, and its weights
    are the same as an unpartitioned build's (app.runtime.zero3_init). A warm start
    (`--init-from`) loads its weights into the built model: app.init_from.
    """
    if seed is not None:
        torch.manual_seed(seed)
    auto = AutoModelForMaskedLM if objective_of(config) == "mlm" else AutoModelForCausalLM
    with partitioned(zero3_config):
        model = _instantiate(config, auto, for_training)
    if for_training:
        for part in model.modules():  # the base model (GPT2Model, ...) is the one that looks
            if isinstance(part, PreTrainedModel):
                part.warn_if_padding_and_no_attention_mask = _no_padding_check
    if gradient_checkpointing:
        # use_reentrant=False: works with ZeRO-3's partitioned parameters and frozen inputs
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def _instantiate(config: PretrainedConfig, auto, for_training: bool) -> torch.nn.Module:
    gpt2 = for_training and config.model_type == "gpt2"
    if gpt2:  # its own attention name below: the caller's config (an export's) stays as it is
        config = copy.deepcopy(config)
    try:
        model = auto.from_config(config, attn_implementation=config._attn_implementation)
        if for_training and config.model_type in SPARSE_HEADS:
            # the same module with the sparse forward: built as the plain class, so the same
            # seed gives the same weights (ModernBERT's init skips a subclass's head)
            model.__class__ = SPARSE_HEADS[config.model_type]
        if gpt2:  # the chunked loss, no cache, no mask where SDPA needs none; same weights
            model.__class__, model.lm_head.__class__ = CausalLossGPT2LMHeadModel, LossHead
            if config._attn_implementation == "sdpa":
                model.config._attn_implementation = CAUSAL_SDPA
            elif config._attn_implementation == FLEX:
                model.config._attn_implementation = FLEX_CAUSAL
    except (ImportError, ValueError) as e:  # e.g. flash_attention_2 without its package
        raise UserError(f"--attn {config._attn_implementation}: {e}".splitlines()[0]) from None
    return model


def _no_padding_check(input_ids, attention_mask) -> None:
    """See build_model: the loader never pads without handing over an attention mask."""


def optimizer_groups(model: torch.nn.Module, weight_decay: float, blocks: int = 1
                     ) -> list[dict[str, Any]]:
    """Parameter groups for AdamW: weight decay on the matrices of the linear layers only; none on
    biases, LayerNorm weights and embeddings (decaying those only pulls scales and rare tokens'
    vectors toward zero; GPT-3, Megatron and the Hugging Face Trainer all exempt them).

    `blocks` > 1 (ZeRO-1/2: app.runtime.overlap.partition_blocks): the parameters in registration
    order are cut into that many runs of about equal size, each run two groups (decay, then
    none; an empty one left out), so ZeRO partitions each block on its own. 1: two groups."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding)
                  for p in m.parameters()}
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())

    def decays(p: torch.nn.Parameter) -> bool:
        ndim = len(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 partition is flat; its shape
        return ndim >= 2 and id(p) not in embeddings

    if blocks <= 1:
        return [{"params": [p for p in params if decays(p)], "weight_decay": weight_decay},
                {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}]
    groups: list[dict[str, Any]] = []
    for run in layer_blocks(params, blocks):
        for decay, wd in ((True, weight_decay), (False, 0.0)):
            members = [p for p in run if decays(p) is decay]
            if members:
                groups.append({"params": members, "weight_decay": wd})
    return groups


def layer_blocks(params: list[torch.nn.Parameter], blocks: int) -> list[list[torch.nn.Parameter]]:
    """`params` (in order) cut into at most `blocks` runs of consecutive ones of about equal
    size (app.runtime.overlap.block_starts)."""
    starts = block_starts([getattr(p, "ds_numel", p.numel()) for p in params], blocks)
    return [params[a:b] for a, b in zip(starts, starts[1:] + [len(params)])]


def group_names(model: torch.nn.Module, blocks: int = 1) -> list[list[str]]:
    """The parameters' names in each of `optimizer_groups(model, ..., blocks)`, in order. An
    optimizer's saved state holds parameters by their index in its groups; a checkpoint's train
    state records these names beside it, so the state reads back by name without building the
    model (app.checkpoint.universal)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]]
            for group in optimizer_groups(model, 0.0, blocks)]


def skeleton_group_names(model_config: Mapping[str, Any]) -> list[list[str]]:
    """`group_names` of the training model of `model_config` (the dict a train state saves), in
    two groups, from a skeleton on the meta device (no memory, no init): the names of a
    checkpoint written before train states recorded them (universal.read's `names_for`)."""
    with torch.device("meta"):
        model = build_model(config_from_dict(model_config), for_training=True)
    return group_names(model)


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied weights once)."""
    return sum(getattr(p, "ds_numel", p.numel())  # ZeRO-3: the whole, not this rank's shard
               for p in {id(p): p for p in model.parameters()}.values())
