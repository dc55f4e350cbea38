"""Differentiable collectives at the edges of tensor- and sequence-parallel regions.

Megatron's conjugate pairs (Shoeybi et al. 2019 sec. 3, "f" and "g"; Korthikanti et al. 2022
sec. 4.2.2 for the sequence-parallel "g" and "g-bar"): whatever a forward does across the group,
the backward does its transpose, so the gradient of a replicated input is summed over the ranks
that used it and the gradient of a sharded input is the matching shard.

  copy_to_tp            identity           / all-reduce        (f: enters a TP region)
  reduce_from_tp        all-reduce         / identity          (g: leaves a row-parallel layer)
  scatter_to_tp         keep my shard      / all-gather        (input not yet split)
  gather_from_tp        all-gather         / keep my shard     (column output gathered)
  scatter_to_sequence   keep my seq shard  / all-gather
  gather_from_sequence  all-gather seq     / reduce-scatter    (SP: enters a TP region)
  reduce_scatter_to_sequence reduce-scatter / all-gather       (SP: leaves a row-parallel layer)

Every function takes the group explicitly; on a group of one rank each is the identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def _size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def _all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    if _size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: Tensor, dim: int, group: dist.ProcessGroup, sizes: Sequence[int] | None) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim``; ``sizes`` lets the shards differ in length."""
    n = _size(group)
    if n == 1:
        return x
    width = max(sizes) if sizes else x.shape[dim]
    moved = x.movedim(dim, 0)
    if moved.shape[0] < width:  # pad so every rank sends the same shape
        pad = moved.new_zeros((width - moved.shape[0], *moved.shape[1:]))
        moved = torch.cat([moved, pad])
    out = moved.new_empty((n * width, *moved.shape[1:]))
    dist.all_gather_single(out, moved.contiguous(), group=group)
    if sizes:
        out = torch.cat([out[i * width:i * width + s] for i, s in enumerate(sizes)])
    return out.movedim(0, dim)


def _shard(x: Tensor, dim: int, group: dist.ProcessGroup, sizes: Sequence[int] | None) -> Tensor:
    """This rank's slice of ``x`` along ``dim`` (equal slices, or the given sizes)."""
    n = _size(group)
    if n == 1:
        return x
    rank = dist.get_rank(group)
    if sizes is None:
        if x.shape[dim] % n:
            raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {n} ranks")
        sizes = [x.shape[dim] // n] * n
    start = sum(sizes[:rank])
    return x.narrow(dim, start, sizes[rank]).contiguous()


def _reduce_scatter(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"sequence dimension of size {x.shape[dim]} does not split over {n} ranks")
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // n, *moved.shape[1:]))
    dist.reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: dist.ProcessGroup,
                sizes: Sequence[int] | None) -> Tensor:
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        return _shard(x, dim, group, sizes)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _all_gather(grad, ctx.dim, ctx.group, ctx.sizes), None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: dist.ProcessGroup,
                sizes: Sequence[int] | None) -> Tensor:
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        return _all_gather(x, dim, group, sizes)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _shard(grad, ctx.dim, ctx.group, ctx.sizes), None, None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: dist.ProcessGroup, grad_is_partial: bool) -> Tensor:
        ctx.dim, ctx.group, ctx.partial = dim, group, grad_is_partial
        return _all_gather(x, dim, group, None)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        # Inside a TP region each rank holds a partial gradient of the gathered tensor: sum and
        # keep my slice. If the consumer was replicated, every rank already holds the full one.
        if ctx.partial:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _shard(grad, ctx.dim, ctx.group, None), None, None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.group, None), None, None


def copy_to_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Identity forward, all-reduce of the gradient over the TP group (Megatron's f)."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """All-reduce forward over the TP group, identity backward (Megatron's g)."""
    return _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: Tensor, group: dist.ProcessGroup, dim: int = -1,
                  sizes: Sequence[int] | None = None) -> Tensor:
    """Keep this rank's slice along ``dim``; the backward all-gathers the gradient."""
    return _Scatter.apply(x, dim % x.dim(), group, sizes)


def gather_from_tp(x: Tensor, group: dist.ProcessGroup, dim: int = -1,
                   sizes: Sequence[int] | None = None) -> Tensor:
    """All-gather along ``dim`` (shards may differ in ``sizes``); the backward keeps this rank's slice."""
    return _Gather.apply(x, dim % x.dim(), group, sizes)


def scatter_to_sequence(x: Tensor, group: dist.ProcessGroup, dim: int = 1) -> Tensor:
    """Split a replicated activation along the sequence dimension; the backward all-gathers."""
    return _Scatter.apply(x, dim % x.dim(), group, None)


def gather_from_sequence(x: Tensor, group: dist.ProcessGroup, dim: int = 1,
                         grad_is_partial: bool = True) -> Tensor:
    """All-gather the sequence; the backward reduce-scatters (partial grads) or just splits (full grads)."""
    return _GatherSequence.apply(x, dim % x.dim(), group, grad_is_partial)


def reduce_scatter_to_sequence(x: Tensor, group: dist.ProcessGroup, dim: int = 1) -> Tensor:
    """Sum partial results over the TP group and keep this rank's sequence slice; the backward all-gathers."""
    return _ReduceScatterSequence.apply(x, dim % x.dim(), group)
