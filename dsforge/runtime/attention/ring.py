"""Ring attention over the context-parallel group (Liu et al. 2023, "Ring Attention with Blockwise Transformers").

Each rank keeps its queries and passes its key/value block around the ring with point-to-point
send/recv, one hop per step; after cp steps every query has met every key. The partial results of
the blocks are merged with the online softmax (Milakov & Gimelshein 2018; the FlashAttention
recurrence): a running row maximum m, a running sum l of exp(s - m) and an accumulator of
exp(s - m)·V, rescaled whenever m grows. m is only a stabiliser (the result does not depend on
it), so it is detached and the backward that autograd derives is exact attention's backward; the
ring's send/recv is an autograd function whose backward sends the gradient one hop back. This
favours obvious correctness over speed: each block's probabilities are kept for the backward.

Tokens are laid out load-balanced (rank i holds chunks i and 2cp-1-i of 2cp), so under the causal
mask every rank has the same work; ``positions`` in sequence.py gives each rank's token positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dsforge.runtime.attention.sequence import positions


def _exchange(x: Tensor, send_to: int, recv_from: int, group: dist.ProcessGroup) -> Tensor:
    """Send ``x`` to one global rank and receive a tensor of the same shape from another (both posted first)."""
    buf = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), send_to, group), dist.P2POp(dist.irecv, buf, recv_from, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return buf


class _RingShift(torch.autograd.Function):
    """Receive the previous rank's block, send mine to the next; the backward sends gradients the other way."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup, send_to: int, recv_from: int) -> Tensor:
        ctx.group, ctx.send_to, ctx.recv_from = group, send_to, recv_from
        return _exchange(x, send_to, recv_from, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _exchange(grad, ctx.recv_from, ctx.send_to, ctx.group), None, None, None


class _OnlineSoftmax:
    """Running (max, sum of exponentials, weighted values) of one rank's queries over the blocks seen so far."""

    def __init__(self, q: Tensor, scale: float) -> None:
        self.q, self.scale = q.float(), scale
        b, h, s, d = q.shape
        self.m = q.new_full((b, h, s), -math.inf, dtype=torch.float32)
        self.l = q.new_zeros((b, h, s), dtype=torch.float32)
        self.acc = q.new_zeros((b, h, s, d), dtype=torch.float32)

    def update(self, k: Tensor, v: Tensor, visible: Tensor | None) -> None:
        """Fold one key/value block in; ``visible[i, j]`` says whether query i may attend to key j."""
        rep = self.q.shape[1] // k.shape[1]  # grouped-query attention: each KV head serves `rep` query heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(self.q, k.float().transpose(-1, -2)) * self.scale
        if visible is not None:
            scores = scores.masked_fill(~visible, -math.inf)
        new_m = torch.maximum(self.m, scores.detach().amax(dim=-1))
        safe = new_m.masked_fill(torch.isinf(new_m), 0.0)  # rows that have seen no key yet
        alpha = torch.exp(self.m - safe)
        p = torch.exp(scores - safe.unsqueeze(-1))
        self.l = self.l * alpha + p.sum(dim=-1)
        self.acc = self.acc * alpha.unsqueeze(-1) + torch.matmul(p, v.float())
        self.m = new_m

    def touch(self, block: Tensor) -> None:
        """Make a skipped block part of the graph (zero contribution) so every rank runs every ring backward."""
        self.acc = self.acc + block.sum() * 0.0

    def result(self, dtype: torch.dtype) -> Tensor:
        """softmax(QK^T)V over all blocks folded in."""
        return (self.acc / self.l.unsqueeze(-1)).to(dtype)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, *, causal: bool = True,
                   scale: float | None = None, load_balanced: bool = True) -> Tensor:
    """Attention of this rank's queries over the whole sequence held by the CP group.

    q: [batch, heads, s_local, head_dim]; k, v: [batch, kv_heads, s_local, head_dim] (kv_heads
    divides heads). Every rank holds the same number of tokens, laid out as ``positions`` says.
    """
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    seq_len = q.shape[2] * cp
    q_pos = positions(seq_len, me, cp, load_balanced).to(q.device)
    send_to = dist.get_global_rank(group, (me + 1) % cp) if cp > 1 else 0
    recv_from = dist.get_global_rank(group, (me - 1) % cp) if cp > 1 else 0
    state = _OnlineSoftmax(q, scale)
    kv = torch.stack([k, v])  # one message per hop
    for step in range(cp):
        if step:
            kv = _RingShift.apply(kv, group, send_to, recv_from)
        visible = None
        if causal:
            kv_pos = positions(seq_len, (me - step) % cp, cp, load_balanced).to(q.device)
            visible = kv_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
            if not bool(visible.any()):
                # A rank whose graph skipped this block would skip its backward send/recv and deadlock the ring.
                state.touch(kv)
                continue
            if bool(visible.all()):
                visible = None
        state.update(kv[0], kv[1], visible)
    return state.result(q.dtype)


class RingAttention(nn.Module):
    """Module form of ``ring_attention`` with the CP group and masking fixed at construction."""

    def __init__(self, group: dist.ProcessGroup, causal: bool = True, scale: float | None = None,
                 load_balanced: bool = True) -> None:
        super().__init__()
        self.group, self.causal, self.scale, self.load_balanced = group, causal, scale, load_balanced

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """[b, h, s_local, d] queries and [b, h_kv, s_local, d] keys/values -> [b, h, s_local, d]."""
        return ring_attention(q, k, v, self.group, causal=self.causal, scale=self.scale,
                              load_balanced=self.load_balanced)
