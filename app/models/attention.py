"""The attention masks and functions the training models run: GPT-2's causal SDPA without a host
read (CAUSAL_SDPA, `causal_attention`) and packed documents' block-diagonal attention
(`document_attention`, flash-attention's `varlen_kwargs`), all built on the device.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from app.flex import FLEX, document_block_mask
from data_tools.errors import UserError

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
