"""The heads the app trains with, same weights as the stock models: the sparse masked-LM heads
(SparseHead, SPARSE_HEADS: the vocabulary head at the masked positions only) and the training
GPT-2 (CausalLossGPT2LMHeadModel, LossHead: the chunked loss, no inference cache).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import (
    BertForMaskedLM,
    GPT2LMHeadModel,
    ModernBertForMaskedLM,
    RobertaForMaskedLM,
)
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions, MaskedLMOutput

from app.data.masking import IGNORE_INDEX
from app.flex import FLEX_CAUSAL, causal_block_mask
from app.models.attention import CAUSAL_SDPA, causal_attention, document_attention, varlen_kwargs
from app.models.losses import causal_lm_loss
from data_tools.errors import UserError


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


# The sparse-head class of each MLM family this app trains (app.models.build.build_model)
SPARSE_HEADS = {"bert": SparseHeadBertForMaskedLM, "roberta": SparseHeadRobertaForMaskedLM,
                "modernbert": SparseHeadModernBertForMaskedLM}


class LossHead(torch.nn.Linear):
    """A causal LM's tied head that, given the labels, returns the loss and no logits
    (app.models.losses.causal_lm_loss: the logits in chunks, never whole). A module call either
    way, so under ZeRO-3 this module's hooks gather the weight before the loss reads it and again
    before its backward, as for the stock head's matrix product."""

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
