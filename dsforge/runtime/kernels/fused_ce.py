"""Chunked fused LM head + cross entropy: the loss and its gradients without full-vocabulary fp32 logits.

The unfused path (an LM head, then `F.cross_entropy` on `logits.float()` or dsforge's
`vocab_parallel_cross_entropy`) keeps tokens x vocab/tp fp32 probabilities for backward and, while the
loss is formed, the logits in the compute dtype and their fp32 copy. This Function keeps only what the
head's backward needs anyway (its input and weight) plus per token the fp32 row maximum and sum of
exponentials and the int64 target; forward and backward walk the tokens in chunks of at most
`LOSS_CHUNK_CELLS` logit cells and the backward recomputes each chunk's logits (the idea of Liger-Kernel's
fused_linear_cross_entropy and DeepSpeed's TiledFusedLogitsLoss in ulysses_sp.py; written here for the
vocabulary-parallel head).

Exactness: each chunk's logits are `F.linear(hidden, weight)` in the compute dtype, cast to fp32, exactly
as the unfused head and loss form them; the gradient of a logit, softmax - onehot in fp32, is cast to the
compute dtype before the two GEMMs, as autograd does after the unfused loss. Only the summation order of
the weight gradient over chunks differs (accumulated in fp32), which fp32 tolerance covers.
Under TP the vocabulary is split over the group (Megatron's vocab-parallel cross entropy, Shoeybi et al.
2019 sec. 3): the row maximum, the target logit and the sum of exponentials are all-reduced, three numbers
per token; the hidden-state gradient is this rank's partial sum, reduced by the head's input mapping.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from dsforge.compiler.model.lean_kernels import loss_chunk_tokens


def _chunk_stats(logits: Tensor, target: Tensor, vocab_start: int,
                 pg: dist.ProcessGroup | None) -> tuple[Tensor, Tensor, Tensor]:
    """(row max, shifted target logit or 0, is the target on this rank) of fp32 logits [n, V_local], max
    all-reduced."""
    row_max = logits.amax(dim=-1)
    if pg is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=pg)
    local = target - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])
    picked = logits.gather(-1, local.masked_fill(~mine, 0).unsqueeze(-1)).squeeze(-1)
    return row_max, (picked - row_max) * mine, mine


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, target: Tensor, pg: dist.ProcessGroup | None,
                vocab_start: int, ignore_index: int) -> Tensor:
        n = hidden.shape[0]
        step = loss_chunk_tokens(weight.shape[0])
        # per token the row maximum and the sum of exponentials, kept apart: folded into one log-sum-exp,
        # exp(logit - lse) near a saturated token loses the digits softmax - onehot needs (the ulp of the max)
        stats = torch.empty(2, n, dtype=torch.float32, device=hidden.device)
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            # in place from the fp32 copy on: one chunk holds its logits in the compute dtype only while they
            # are copied to fp32 (none in fp32), then one fp32 tensor (estimate: activations.logits_bytes)
            logits = F.linear(hidden[lo:hi], weight).float()
            row_max, picked, _ = _chunk_stats(logits, target[lo:hi], vocab_start, pg)
            # one all-reduce carries both per-token sums (the target logit lives on one rank)
            sums = torch.stack([picked, logits.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1)])
            del logits
            if pg is not None:
                dist.all_reduce(sums, group=pg)
            stats[0, lo:hi], stats[1, lo:hi] = row_max, sums[1]
            loss[lo:hi] = sums[1].log() - sums[0]
        valid = target != ignore_index
        loss = loss * valid
        ctx.save_for_backward(hidden, weight, target, stats)
        ctx.pg, ctx.vocab_start, ctx.ignore_index = pg, vocab_start, ignore_index
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None, None]:
        hidden, weight, target, stats = ctx.saved_tensors
        n, step = hidden.shape[0], loss_chunk_tokens(weight.shape[0])
        scale = grad * (target != ctx.ignore_index)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            # softmax as the unfused loss forms it: exp(logit - max) / sum
            probs = F.linear(hidden[lo:hi], weight).float().sub_(stats[0, lo:hi].unsqueeze(-1)).exp_()
            probs.div_(stats[1, lo:hi].unsqueeze(-1))
            local = target[lo:hi] - ctx.vocab_start
            mine = (local >= 0) & (local < weight.shape[0])
            probs.scatter_add_(-1, local.masked_fill(~mine, 0).unsqueeze(-1),
                               -mine.unsqueeze(-1).to(probs.dtype))
            g = probs.mul_(scale[lo:hi].unsqueeze(-1)).to(hidden.dtype)
            del probs
            if grad_hidden is not None:
                grad_hidden[lo:hi] = g @ weight
            if grad_weight is not None:
                grad_weight += (g.t() @ hidden[lo:hi]).float()
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None,
            None,
            None,
            None,
        )


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor,
                               pg: dist.ProcessGroup | None = None, vocab_start: int = 0,
                               ignore_index: int = -100) -> Tensor:
    """Per-token cross entropy of `F.linear(hidden, weight)` ([..., h] by [V_local, h]) against ``target``, in
    fp32, with no full-vocabulary logits kept; ``pg``: the group the vocabulary rows are split over."""
    shape = target.shape
    flat = _FusedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1),
                                          pg, vocab_start, ignore_index)
    return flat.reshape(shape)
