"""The causal-LM loss on the hidden states, in row chunks: the [tokens x vocabulary] logits are
never whole in memory.

transformers' GPT-2 loss (`ForCausalLMLoss`) takes the full logits, upcasts them to fp32 and runs
`cross_entropy` on them: at gpt-125m (vocabulary 50,304, micro batch 64 x 512) that is 3.3 GB of
bf16 logits, a 6.6 GB fp32 copy, as much again for the log-softmax and its gradient, and a
quarter of an H100 step in memory traffic. Here the LM head's matrix product and the
cross-entropy run `rows` tokens at a time: each chunk's logits in the model's dtype, their
log-sum-exp in fp32, and only the per-token log-sum-exp (4 bytes a token) is kept for backward,
which recomputes each chunk's logits. Same value and gradients as the stock loss (the shift by
one, IGNORE_INDEX, the mean over the predicted tokens), one more matrix product of the head.
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


def chunk_rows(vocab_size: int, budget: int = CHUNK_BYTES) -> int:
    """Rows a chunk takes: the most whose fp32 logits fit `budget`, a multiple of ROW_MULTIPLE."""
    rows = budget // (4 * vocab_size)
    return max(ROW_MULTIPLE, rows // ROW_MULTIPLE * ROW_MULTIPLE)


class LinearCrossEntropy(torch.autograd.Function):
    """sum over the rows whose target is not IGNORE_INDEX of cross_entropy(hidden @ weight.T,
    target), in fp32, `rows` rows at a time; backward recomputes each chunk's logits.

    The weight is an input of the function (not read from a module inside it): autograd hands its
    gradient to the parameter, where ZeRO's hooks take it, and under ZeRO-3 the caller runs this
    inside the head module's forward, whose hooks gather the weight for it (app.model.LossHead).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                rows: int) -> torch.Tensor:
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            logits = (hidden[start:start + rows] @ weight.t()).float()
            t = target[start:start + rows]
            here = torch.logsumexp(logits, dim=-1)
            lse[start:start + rows] = here
            picked = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += torch.where(t != IGNORE_INDEX, here - picked, 0.0).sum()
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.rows = rows
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        hidden, weight, target, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # summed over the chunks in fp32 whatever the model's dtype, cast once at the end
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if want_weight else None
        for start in range(0, hidden.shape[0], ctx.rows):
            h = hidden[start:start + ctx.rows]
            t = target[start:start + ctx.rows]
            keep = t != IGNORE_INDEX
            # d loss / d logits = softmax - one_hot(target), on the kept rows, times the
            # incoming gradient; fp32 as the stock loss's, then the model's dtype for the products
            grad = (h @ weight.t()).float().sub_(lse[start:start + ctx.rows].unsqueeze(1)).exp_()
            grad.scatter_add_(1, t.clamp(min=0).unsqueeze(1),
                              torch.full((t.shape[0], 1), -1.0, device=grad.device))
            grad.mul_(torch.where(keep, grad_total, 0.0).unsqueeze(1))
            grad = grad.to(hidden.dtype)
            if want_hidden:
                grad_hidden[start:start + ctx.rows] = grad @ weight
            if want_weight:
                grad_weight += (grad.t() @ h).float()
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


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
    total = LinearCrossEntropy.apply(flat, weight, target, rows)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return total / (target != IGNORE_INDEX).sum().clamp(min=1)
