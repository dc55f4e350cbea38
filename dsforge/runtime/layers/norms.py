"""Norms inside a tensor-parallel attention block: per-head norms and norms over a head-split projection.

A per-head norm (Qwen3's and Gemma3's q_norm/k_norm, over head_dim channels) is replicated, but
each TP rank applies it to its own heads only, so each rank's weight gradient is a partial sum
over heads: ``sum_grads_over_tp`` adds the partial sums over the TP group as autograd produces
them (the same tensor hook sequence parallelism uses, dsforge.runtime.engine), so every rank
holds the gradient a single process would. A norm over a whole projection (OLMo2's q_norm over
heads x head_dim) normalises by the mean square of all heads: ``ShardedRMSNorm`` keeps this
rank's heads' slice of the weight and all-reduces the sum of squares, in the forward and (the
transpose of a sum that every rank uses) in the backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dsforge.runtime.layers.sharding import mark_tensor_parallel


def sum_grads_over_tp(module: nn.Module, group: dist.ProcessGroup) -> int:
    """Make every parameter of ``module`` receive its gradient summed over ``group``; returns how many."""
    if dist.get_world_size(group) == 1:
        return 0

    def hook(grad: Tensor) -> Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    count = 0
    for p in module.parameters():
        if p.requires_grad:
            p.register_hook(hook)
            p.tp_partial_grad = True  # type: ignore[attr-defined]  # a tag for readers of the plan
            count += 1
    return count


class _AllReduceBoth(torch.autograd.Function):
    """Sum over the group in the forward and in the backward (a sum every rank then uses)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ShardedRMSNorm(nn.Module):
    """RMSNorm over features split across the TP group: weight * x / sqrt(mean over *all* features of x^2 +
    eps).

    The forward is HF's (LlamaRMSNorm, Olmo2RMSNorm): computed in fp32, scaled by the weight, cast back.
    """

    def __init__(self, local: int, full: int, eps: float, pg: dist.ProcessGroup,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.pg, self.full, self.variance_epsilon = pg, full, eps
        self.weight = nn.Parameter(torch.ones(local, dtype=dtype))
        mark_tensor_parallel(self.weight, 0)

    @classmethod
    def from_dense(cls, dense: nn.Module, pg: dist.ProcessGroup, start: int, local: int) -> ShardedRMSNorm:
        """This rank's features [start, start + local) of an HF RMSNorm (weight and ``variance_epsilon``)."""
        weight: Any = dense.weight
        eps = getattr(dense, "variance_epsilon", getattr(dense, "eps", None))
        if eps is None:
            raise TypeError(f"{type(dense).__name__} has no variance_epsilon/eps: not an HF RMSNorm")
        layer = cls(local, weight.shape[0], float(eps), pg, dtype=weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(weight[start:start + local])
        return layer.to(weight.device)

    def forward(self, x: Tensor) -> Tensor:
        """This rank's features of [..., full] -> normalised by the mean square over every rank's features."""
        dtype = x.dtype
        x = x.to(torch.float32)
        square_sum = _AllReduceBoth.apply(x.pow(2).sum(-1, keepdim=True), self.pg)
        x = x * torch.rsqrt(square_sum / self.full + self.variance_epsilon)
        return (self.weight * x).to(dtype)

    def extra_repr(self) -> str:
        """Local and global widths."""
        return f"local={self.weight.shape[0]}, full={self.full}, eps={self.variance_epsilon}"
