"""Sequence parallelism's saved block inputs at 1/tp: a gathered sequence kept as this rank's shard for
backward.

dsforge's sequence regions (dsforge.runtime.rewrite.sequence) all-gather the sequence at a TP block's
boundary, because HF attention sizes its views from its input. Autograd would then save the gathered
(whole-sequence) input in each column-parallel layer of the block (q, k and v; gate and up), tp times
what Megatron keeps: its sequence-parallel linear layers save this rank's 1/tp shard and all-gather it
again in backward (Korthikanti et al. 2022, sec. 4.2.2). ``gathered_input`` marks the gathered tensor
for the length of one region's forward; a column-parallel layer that reads it saves the shard instead,
and the first of the block's backwards gathers it once for all of them. The values, and so every
gradient, are those of the gathered tensor; the shard is an ordinary saved tensor (autograd's
saved-tensor hooks, and so dsforge's activation probe, see it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from dsforge.runtime.layers.mappings import _all_gather


class GatheredInput:
    """One region's gathered sequence: its shard, and the whole tensor while its backwards need it."""

    def __init__(self, full: Tensor, shard: Tensor, group: dist.ProcessGroup, dim: int) -> None:
        self.ptr, self.shape = full.untyped_storage().data_ptr(), full.shape
        self.shard, self.group, self.dim = shard.detach(), group, dim
        self.users = 0
        self._full: Tensor | None = None

    def reads(self, x: Tensor) -> bool:
        """True when ``x`` is the gathered tensor (or an alias of it, as copy_to_tp returns)."""
        return x.shape == self.shape and x.untyped_storage().data_ptr() == self.ptr

    def regather(self) -> Tensor:
        """The gathered tensor again, all-gathered once for all the layers that saved its shard."""
        if self._full is None:
            with torch.no_grad():
                self._full = _all_gather(self.shard, self.dim, self.group, None).contiguous()
        full = self._full
        self.users -= 1
        if self.users <= 0:  # the last of the block's layers: nothing keeps the whole sequence after it
            self._full = None
        return full


_ACTIVE: list[GatheredInput] = []


@contextmanager
def gathered_input(full: Tensor, shard: Tensor, group: dist.ProcessGroup,
                   dim: int) -> Iterator[GatheredInput]:
    """Within this block, column-parallel layers reading ``full`` (gathered from ``shard``) save the shard."""
    source = GatheredInput(full, shard, group, dim)
    _ACTIVE.append(source)
    try:
        yield source
    finally:
        _ACTIVE.remove(source)


def source_of(x: Tensor) -> GatheredInput | None:
    """The active region whose gathered tensor ``x`` is, when autograd records (else None)."""
    if not _ACTIVE or not torch.is_grad_enabled():
        return None
    top = _ACTIVE[-1]
    return top if top.reads(x) else None


class _LinearOnGathered(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, source: GatheredInput) -> Tensor:
        ctx.source, ctx.has_bias = source, bias is not None
        source.users += 1
        ctx.save_for_backward(source.shard, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        _, weight = ctx.saved_tensors
        x = ctx.source.regather()
        flat = grad.reshape(-1, grad.shape[-1])
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = flat.t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear, saving only the shard when ``x`` is an active region's gathered sequence."""
    source = source_of(x)
    if source is None:
        return F.linear(x, weight, bias)
    out: Tensor = _LinearOnGathered.apply(x, weight, bias, source)
    return out
