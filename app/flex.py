"""--attn flex: attention through PyTorch's FlexAttention (`torch.nn.attention.flex_attention`).

FlexAttention takes the mask as a function of (batch, head, query, key) indices (a `mask_mod`)
and a `BlockMask` made from it: which tiles of the S x S scores hold any pair that attends. Its
compiled kernel (CUDA: Triton, through torch.compile) skips the empty tiles, so packed documents
(`--packing doc-packed`) cost the attention of their own lengths, not of the whole window, and no
S x S mask is ever materialised. Where a step cannot run the kernel, the same `mask_mod` is
expanded to SDPA's boolean mask (`dense_mask`) and SDPA runs it:

- attention dropout > 0 in training: FlexAttention has no dropout (SDPA then draws the same
  random numbers as `--attn sdpa`, so the two train the same losses);
- a backward on a device where torch has none for FlexAttention (CPU: app.runtime.device
  `flex_backward`): CPU training runs the masks through SDPA, CPU eval through eager FlexAttention.

Plugged in as the model families plug attention in: `flex` is an attention function of
transformers' `AttentionInterface` (what `config._attn_implementation` names), and a mask
function of its `AttentionMaskInterface`, so its mask helpers (`create_bidirectional_mask`,
`create_causal_mask`, the sliding-window ones) hand every family a BlockMask of their own mask
functions, padding included, with no host read. The app's own masks (packed documents,
app.models.attention.document_attention; GPT-2's causal mask,
app.models.attention.causal_attention) are BlockMasks built here. transformers' own
"flex_attention" is not used: it compiles flex_attention on every device, refuses attention
dropout, and reads the padding mask on the host (`fast_all`).
"""
from __future__ import annotations

import warnings
from functools import lru_cache
from typing import Any, Callable

import torch
from torch.nn.attention.flex_attention import (
    BlockMask,
    create_block_mask,
    create_mask,
    flex_attention,
)
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    add_offsets_to_mask_function,
    and_masks,
    bidirectional_mask_function,
    causal_mask_function,
    padding_mask_function,
    prepare_padding_mask,
)

from app.runtime.device import flex_backward, flex_compiled

# The eager form is chosen where torch has no compiled kernel to gain (app.runtime.device
# flex_compiled) and the start-up line says so: torch's advice to compile it, once per process
# and many lines long, is no news to the user there.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

FLEX = "flex"
"""The --attn name and `config._attn_implementation` of FlexAttention (this module)."""
FLEX_CAUSAL = "flex_causal"
"""The attention a training GPT-2 runs where the config says "flex" (app.models.heads
CausalLossGPT2LMHeadModel): the same function under a name transformers' mask helpers do not
know, so they build nothing and read nothing (its `create_causal_mask` would look for packed
sequences on the host); the model hands its causal BlockMask over as `block_mask`."""

MaskMod = Callable[[Any, Any, Any, Any], Any]


def block_mask(mask_mod: MaskMod, batch: int | None, q_len: int, kv_len: int,
               device: torch.device | str) -> BlockMask:
    """FlexAttention's BlockMask of `mask_mod` over [batch (None: any), any head, q_len,
    kv_len]; built by a compiled kernel where flex_attention is compiled (no S x S tensor), else
    by evaluating the mask_mod on the whole grid."""
    device = torch.device(device)
    return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device,
                             _compile=flex_compiled(device.type))


def document_block_mask(document_ids: torch.Tensor, window: int | None = None) -> BlockMask:
    """--packing doc-packed: token i attends to token j of its own window when both belong to the
    same document (`document_ids` [batch, seq], documents from 1, padding 0, which attends only
    to padding), and with `window` when |i - j| <= window; app.models.attention.document_attention's
    mask as a BlockMask."""
    def same_document(b, h, q, kv):
        return document_ids[b, q] == document_ids[b, kv]

    mask_mod: MaskMod = same_document
    if window is not None:
        def within(b, h, q, kv):
            return (q - kv).abs() <= window
        mask_mod = and_masks(same_document, within)
    batch, seq = document_ids.shape
    return block_mask(mask_mod, batch, seq, seq, document_ids.device)


def causal_block_mask(padding: torch.Tensor | None, seq: int,
                      device: torch.device | str) -> BlockMask:
    """A causal LM's mask: key <= query and, given the loader's [batch, seq] `padding` (1 = token,
    0 = padding), not onto padding (app.models.attention.causal_attention's mask as a
    BlockMask). Without padding one mask for any batch, built once per length and device."""
    if padding is None:
        return _causal(seq, str(device))
    keep = padding.to(dtype=torch.bool)
    return block_mask(and_masks(causal_mask_function, padding_mask_function(keep)),
                      keep.shape[0], seq, seq, keep.device)


@lru_cache(maxsize=8)
def _causal(seq: int, device: str) -> BlockMask:
    return block_mask(causal_mask_function, None, seq, seq, device)


def flex_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0,
              kv_offset: Any = 0, mask_function: MaskMod = causal_mask_function,
              attention_mask: torch.Tensor | None = None,
              device: torch.device | str | None = None, **kwargs: Any) -> BlockMask | None:
    """transformers' mask interface for FLEX (`create_causal_mask` and its kin call it with the
    family's mask function): the BlockMask of `mask_function`, and of the 2D padding mask where
    one is given (always folded in: no host read to see whether it pads); None for full
    bidirectional attention without padding (FlexAttention's default, no mask to build)."""
    if device is None:  # transformers passes the inputs' device
        device = attention_mask.device if attention_mask is not None \
            else torch.get_default_device()
    no_offset = all(isinstance(o, int) and o == 0 for o in (q_offset, kv_offset))
    if attention_mask is None and mask_function is bidirectional_mask_function and no_offset:
        return None
    batch = None
    if attention_mask is not None:
        padding = prepare_padding_mask(attention_mask.to(torch.bool), kv_length, kv_offset)
        mask_function = and_masks(mask_function, padding_mask_function(padding))
        batch = batch_size
    if not no_offset:
        mask_function = add_offsets_to_mask_function(mask_function, q_offset, kv_offset)
    return block_mask(mask_function, batch, q_length, kv_length, device)


def dense_mask(mask: BlockMask) -> torch.Tensor:
    """`mask`'s mask_mod evaluated on every (query, key) pair: SDPA's boolean mask
    [batch or 1, 1, q_len, kv_len] (True = attend). Once per BlockMask (every layer of a forward
    shares one)."""
    dense = getattr(mask, "_app_dense", None)
    if dense is None:
        batch, _, q_len, kv_len = mask.shape
        dense = create_mask(mask.mask_mod, batch, None, q_len, kv_len,
                            device=mask.kv_num_blocks.device)
        mask._app_dense = dense  # type: ignore[attr-defined]
    return dense


_COMPILED: dict[str, Callable[..., Any]] = {}


def kernel(device_type: str) -> Callable[..., Any]:
    """flex_attention, compiled once per process where app.runtime.device `flex_compiled` says
    (the fused kernel); as it is inside a graph torch.compile is already tracing (--compile: the
    graph's compiler fuses it) and on other devices (eager: the scores materialised, as SDPA's
    math path)."""
    if not flex_compiled(device_type) or torch.compiler.is_compiling():
        return flex_attention
    if device_type not in _COMPILED:
        _COMPILED[device_type] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED[device_type]


def runs_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                dropout: float) -> bool:
    """Whether this call can run FlexAttention: no attention dropout, a backward (if one will be
    taken) on a device where torch has FlexAttention's, and inside a graph torch.compile traces
    (--compile) only where flex_attention is compiled anyway (on CPU, inductor's flex lowering
    failed on bert-tiny's eval graph in torch 2.13: `LoweringException: ValueError: not enough
    values to unpack`, the query a view of a matrix product)."""
    if dropout > 0:
        return False
    if torch.compiler.is_compiling() and not flex_compiled(query.device.type):
        return False
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return not grad or flex_backward(query.device.type)


def flex_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: BlockMask | None,
                           dropout: float = 0.0, scaling: float | None = None,
                           block_mask: BlockMask | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function of FLEX (transformers' calling convention: q, k, v [batch, heads,
    seq, head_dim], the output [batch, seq, heads, head_dim]). `attention_mask`: a BlockMask
    (the masks above) or None (every token attends to every token); `block_mask`, where the
    model hands its mask past transformers' (FLEX_CAUSAL)."""
    if attention_mask is None:
        attention_mask = block_mask
    if attention_mask is not None and not isinstance(attention_mask, BlockMask):
        raise ValueError(f"--attn {FLEX}: expected a BlockMask or no mask, got a "
                         f"{type(attention_mask).__name__} (a mask built for another attention)")
    if not runs_kernel(query, key, value, dropout):
        dense = None if attention_mask is None else dense_mask(attention_mask)
        kwargs.pop("is_causal", None)  # the mask says it: None is full attention
        return sdpa_attention_forward(module, query, key, value, dense, dropout=dropout,
                                      scaling=scaling, is_causal=False, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    out = kernel(query.device.type)(query, key, value, block_mask=attention_mask, scale=scaling,
                                    enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(FLEX, flex_attention_forward)
AttentionInterface.register(FLEX_CAUSAL, flex_attention_forward)
AttentionMaskInterface.register(FLEX, flex_mask)
