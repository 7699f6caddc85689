"""The causal-LM loss on the hidden states, in row chunks: the [tokens x vocabulary] logits are
never whole in memory.

transformers' GPT-2 loss (`ForCausalLMLoss`) takes the full logits, upcasts them to fp32 and runs
`cross_entropy` on them: at gpt-125m (vocabulary 50,304, micro batch 64 x 512) that is 3.3 GB of
bf16 logits, a 6.6 GB fp32 copy, as much again for the log-softmax and its gradient, and a
quarter of an H100 step in memory traffic. Here the LM head's matrix product and the
cross-entropy run `rows` tokens at a time: each chunk's logits in the model's dtype, their
log-sum-exp and gradient in fp32, then the chunk is freed (LinearCrossEntropy). Same value and
gradients as the stock loss (the shift by one, IGNORE_INDEX, the mean over the predicted tokens)
and the same matrix products, in autocast's dtype under autocast (`autocast_dtype`).
"""
from __future__ import annotations

import torch

from app.data.masking import IGNORE_INDEX

CHUNK_BYTES = 128 * 2**20
"""The fp32 logits of one chunk, at most (128 MiB: 640 tokens at vocabulary 50,257). A chunk
holds about three such buffers at a time (the logits in the model's dtype, fp32, and their
exponentials or gradient). At 640 rows the head's product of a chunk is ~50 GFLOP at gpt-125m
width, enough to keep a GPU busy between kernel launches (51 chunks at micro batch 64 x 512)."""

ROW_MULTIPLE = 64  # chunk rows: whole tiles of the matrix product


def chunk_rows(vocab_size: int, budget: int | None = None) -> int:
    """Rows a chunk takes: the most whose fp32 logits fit `budget` (CHUNK_BYTES, read at the
    call: a benchmark may set it), a multiple of ROW_MULTIPLE."""
    rows = (budget or CHUNK_BYTES) // (4 * vocab_size)
    return max(ROW_MULTIPLE, rows // ROW_MULTIPLE * ROW_MULTIPLE)


class LinearCrossEntropy(torch.autograd.Function):
    """sum over the rows whose target is not IGNORE_INDEX of cross_entropy(hidden @ weight.T,
    target), in fp32, `rows` rows at a time.

    The loss is a sum, so its gradients are known in the forward: each chunk's d loss / d logits
    (softmax - one_hot(target), fp32) goes into the hidden states' and the weight's gradients
    (fp32, a few MB to a few hundred) right away and the chunk's logits are freed; backward only
    scales them by the incoming gradient. The head's matrix products are then the stock loss's
    three, where recomputing the logits in backward would add a fourth. `with_grads` False (no
    autograd: an evaluation) computes the loss only.

    The weight is an input of the function (not read from a module inside it): autograd hands its
    gradient to the parameter, where ZeRO's hooks take it; under ZeRO-3 the caller runs this
    inside the head module's forward, whose hooks gather the weight for it
    (app.models.heads.LossHead).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                rows: int, with_grads: bool) -> torch.Tensor:
        fp32 = dict(dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), **fp32)
        grad_hidden = torch.empty(hidden.shape, **fp32) \
            if with_grads and ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, **fp32) \
            if with_grads and ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], rows):
            end = start + rows
            total += _chunk(hidden[start:end], weight, target[start:end],
                            None if grad_hidden is None else grad_hidden[start:end], grad_weight)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (None if grad_hidden is None else (grad_hidden * grad_total).to(ctx.dtypes[0]),
                None if grad_weight is None else (grad_weight * grad_total).to(ctx.dtypes[1]),
                None, None, None)


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
           grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None) -> torch.Tensor:
    """One chunk of LinearCrossEntropy: its loss sum; its gradients written into `grad_hidden`
    (its rows) and added to `grad_weight`. A function of its own so that the chunk's logits are
    freed when it returns, before the next chunk's are made."""
    keep, t = target != IGNORE_INDEX, target.clamp(min=0).unsqueeze(1)
    logits = (hidden @ weight.t()).float()
    picked = logits.gather(1, t).squeeze(1)
    # log-sum-exp and softmax in the logits' own memory: one [rows, vocab] fp32 buffer
    top = logits.amax(dim=-1, keepdim=True)
    sums = logits.sub_(top).exp_().sum(dim=-1, keepdim=True)
    lse = (sums.log() + top).squeeze(1)
    total = torch.where(keep, lse - picked, 0.0).sum()
    if grad_hidden is None and grad_weight is None:
        return total
    grad = logits.div_(sums)  # softmax
    grad.scatter_add_(1, t, torch.full(t.shape, -1.0, dtype=grad.dtype, device=grad.device))
    # rows without a target: none (even from non-finite logits); products in the model's dtype
    grad = grad.masked_fill_(~keep.unsqueeze(1), 0.0).to(hidden.dtype)
    if grad_hidden is not None:
        grad_hidden.copy_(grad @ weight)
    if grad_weight is not None:
        low = autocast_dtype(hidden.device.type)
        if low is not None:  # the head's product in autocast's dtype, as the stock loss's
            grad_weight.add_(grad.t().to(low) @ hidden.to(low))
        elif grad.dtype == torch.float32:
            grad_weight.addmm_(grad.t(), hidden)
        else:
            grad_weight.add_(grad.t() @ hidden)
    return total


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs matrix products in on `device_type`, None outside autocast.

    The weight gradient accumulates with the in-place `addmm_`, which autocast does not cast
    (it casts out-of-place ops only): under `torch.autocast(bf16)` over fp32 weights (the plain
    loop of bench/gpu_mfu.py) it ran as an fp32 GEMM where the stock loss's head runs in bf16,
    ~2.5 TFLOP a gpt-125m step on a GPU's CUDA cores (review gpu-path-2 M-5, an estimate). So
    under autocast the chunk's product is taken in autocast's dtype and added to the fp32 sum, as
    the bf16-weight branch does. `torch.addmm(..., out_dtype=torch.float32)` would skip the bf16
    rounding of each chunk's product, but torch 2.13 has no CPU kernel for it
    (`aten::addmm.dtype_out`: NotImplementedError on CPU), and it would make the plain loop's
    head cheaper than the app's bf16 branch, which rounds each product too. Outside autocast
    nothing changes: the other two branches, bit for bit."""
    if not (torch.amp.is_autocast_available(device_type)  # "meta" has no autocast: it raises
            and torch.is_autocast_enabled(device_type)):
        return None
    return torch.get_autocast_dtype(device_type)


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   num_items_in_batch: torch.Tensor | int | None = None,
                   rows: int | None = None) -> torch.Tensor:
    """transformers' `ForCausalLMLoss(hidden @ weight.T, labels)` without its logits.

    `hidden` [batch, seq, width], `labels` [batch, seq] (IGNORE_INDEX where not a target):
    position t predicts labels[t + 1], the last position nothing. The mean over the predicted
    tokens, or the sum over `num_items_in_batch` where given (as transformers). One difference:
    a micro batch without any target gives 0 (and zero gradients), where the stock mean is NaN.
    """
    shifted = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    target = shifted.reshape(-1).to(device=hidden.device, dtype=torch.int64)
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows = rows or chunk_rows(weight.shape[0])
    with_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    total = LinearCrossEntropy.apply(flat, weight, target, rows, with_grads)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return total / (target != IGNORE_INDEX).sum().clamp(min=1)
