"""The training loss: torch's cross-entropy on an fp32 copy of the logits (torchtitan's), or a fused one.

The fused cross-entropy (``Plan.fused_loss``) does what flash-attn's xentropy ``CrossEntropyLoss`` and Megatron's
``cross_entropy_loss_fusion`` do on a GPU, in chunks of rows instead of one kernel: the forward computes each row's
log-sum-exp in fp32 and keeps only the logits (their own dtype) and that per-row fp32 value; the backward writes
``softmax - onehot`` into one new tensor of the logits' size and dtype. No fp32 copy of the logits, no log-softmax
output and no separate gradients of the nll and the log-softmax are ever alive: 2 x param_dtype bytes per logit at
its peak (the logits and their gradient) against 12 B/logit for torch's fp32 path. The chunks' fp32 temporaries
(``CHUNK_ELEMENTS`` logits at a time) are the only other memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# [assumed] logits processed at a time by the chunked loss: 1 MiB of fp32 per temporary
CHUNK_ELEMENTS = 2**18


class FusedCrossEntropy(torch.autograd.Function):
    """Sum over rows of -log softmax(logits)[target], in fp32, keeping only the logits and a per-row fp32 lse."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        n, v = logits.shape
        rows = max(1, CHUNK_ELEMENTS // v)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for s in range(0, n, rows):
            z = logits[s:s + rows].float()
            lse[s:s + rows] = torch.logsumexp(z, dim=-1)
            total = total + (lse[s:s + rows] - z.gather(1, target[s:s + rows, None]).squeeze(1)).sum()
        ctx.save_for_backward(logits, target, lse)
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        logits, target, lse = ctx.saved_tensors
        n, v = logits.shape
        rows = max(1, CHUNK_ELEMENTS // v)
        grad = torch.empty_like(logits)
        g = grad_out.float()
        for s in range(0, n, rows):
            p = torch.exp(logits[s:s + rows].float() - lse[s:s + rows, None])
            p.scatter_add_(1, target[s:s + rows, None], torch.full_like(p[:, :1], -1.0))
            grad[s:s + rows] = (p * g).to(grad.dtype)
        return grad, None


def loss_sum(logits: torch.Tensor, target: torch.Tensor, fused: bool) -> torch.Tensor:
    """Sum of the token losses of a (batch, seq, vocab) logits tensor: torch's fp32 cross-entropy, or the fused
    one (whole-vocabulary logits only: under TP the logits are vocab-sharded DTensors, refused by
    ``parallelize.check_executable``)."""
    flat, y = logits.flatten(0, 1), target.flatten()
    if fused:
        return FusedCrossEntropy.apply(flat, y)
    return F.cross_entropy(flat.float(), y, reduction="sum")

