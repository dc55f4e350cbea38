"""Ring attention over the context-parallel group (Liu et al. 2023, "Ring Attention with Blockwise
Transformers").

Each rank keeps its queries and passes its key/value block around the ring with point-to-point
send/recv, one hop per step; after cp steps every query has met every key. The partial results of
the blocks are merged with the online softmax (Milakov & Gimelshein 2018; the FlashAttention
recurrence): a running row maximum m, a running sum l of exp(s - m) and an accumulator of
exp(s - m)·V, rescaled whenever m grows.

Forward and backward are one ``torch.autograd.Function`` that keeps what FlashAttention keeps (Dao
et al. 2022, sec. 3.1 and app. B.2): this rank's q, k, v, the output and an fp32 log-sum-exp per
query row, O(s_local x head_dim) per rank. The backward passes the key/value blocks around the
ring again, recomputes each block's probabilities exp(q·kᵀ·scale - lse) from them, and sends the
key/value gradients along with their block, so after one more hop every rank holds the gradient of
its own keys and values. No s x s matrix outlives the block that made it.

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
    """Send ``x`` to one global rank and receive a tensor of the same shape from another (both posted
    first)."""
    buf = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), send_to, group),
           dist.P2POp(dist.irecv, buf, recv_from, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return buf


class _Ring:
    """Who this rank sends to and receives from, and which keys each of its queries may see at each step."""

    def __init__(self, group: dist.ProcessGroup, s_local: int, causal: bool, load_balanced: bool,
                 device: torch.device) -> None:
        self.group, self.causal, self.load_balanced, self.device = group, causal, load_balanced, device
        self.cp, self.me = dist.get_world_size(group), dist.get_rank(group)
        self.seq_len = s_local * self.cp
        self.send_to = dist.get_global_rank(group, (self.me + 1) % self.cp) if self.cp > 1 else 0
        self.recv_from = dist.get_global_rank(group, (self.me - 1) % self.cp) if self.cp > 1 else 0
        self.q_pos = positions(self.seq_len, self.me, self.cp, load_balanced).to(device)

    def shift(self, x: Tensor) -> Tensor:
        """The previous rank's tensor, after sending mine to the next."""
        return _exchange(x, self.send_to, self.recv_from, self.group)

    def visible(self, step: int) -> Tensor | None | bool:
        """Mask of the block held at ``step`` (query i may see key j): None when all, False when none."""
        if not self.causal:
            return None
        kv_pos = positions(self.seq_len, (self.me - step) % self.cp, self.cp,
                           self.load_balanced).to(self.device)
        mask = kv_pos.unsqueeze(0) <= self.q_pos.unsqueeze(1)
        if not bool(mask.any()):
            return False
        return None if bool(mask.all()) else mask


def _expand(x: Tensor, rep: int) -> Tensor:
    """Grouped-query attention: each KV head serves ``rep`` consecutive query heads."""
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def _scores(q: Tensor, k: Tensor, scale: float, visible: Tensor | None) -> Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if visible is None else s.masked_fill(~visible, -math.inf)


class _RingAttention(torch.autograd.Function):
    """Ring attention whose backward recomputes each block's probabilities from q, k, v and the saved lse."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ring: _Ring, scale: float) -> Tensor:
        b, h, s, d = q.shape
        rep = h // k.shape[1]
        qf = q.float()
        m = q.new_full((b, h, s), -math.inf, dtype=torch.float32)
        l = q.new_zeros((b, h, s), dtype=torch.float32)
        acc = q.new_zeros((b, h, s, d), dtype=torch.float32)
        kv = torch.stack([k, v])  # one message per hop
        for step in range(ring.cp):
            if step:
                kv = ring.shift(kv)
            visible = ring.visible(step)
            if visible is False:
                continue
            scores = _scores(qf, _expand(kv[0], rep).float(), scale, visible)
            new_m = torch.maximum(m, scores.amax(dim=-1))
            safe = new_m.masked_fill(torch.isinf(new_m), 0.0)  # rows that have seen no key yet
            alpha = torch.exp(m - safe)
            p = torch.exp(scores - safe.unsqueeze(-1))
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha.unsqueeze(-1) + torch.matmul(p, _expand(kv[1], rep).float())
            m = new_m
        # [b, s, h, d] in memory, returned as a [b, h, s, d] view: the caller's transpose back to
        # [b, s, h, d] is then contiguous, and the output projection's saved input is this same storage.
        out = (acc / l.unsqueeze(-1)).transpose(1, 2).contiguous().to(q.dtype).transpose(1, 2)
        lse = m + torch.log(l)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        b, h, s, d = q.shape
        hkv = k.shape[1]
        rep = h // hkv
        qf, do = q.float(), grad_out.float()
        delta = (do * out.float()).sum(dim=-1, keepdim=True)  # rowsum(dO ∘ O) = rowsum(P ∘ dP)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v])
        dkv = q.new_zeros((2, b, hkv, s, d), dtype=torch.float32)  # travels with its key/value block
        for step in range(ring.cp):
            if step:
                kv, dkv = ring.shift(kv), ring.shift(dkv)
            visible = ring.visible(step)
            if visible is False:
                continue
            kf, vf = _expand(kv[0], rep).float(), _expand(kv[1], rep).float()
            p = torch.exp(_scores(qf, kf, scale, visible) - lse.unsqueeze(-1))
            dp = torch.matmul(do, vf.transpose(-1, -2))
            ds = p * (dp - delta) * scale
            dq += torch.matmul(ds, kf)
            dk = torch.matmul(ds.transpose(-1, -2), qf)
            dv = torch.matmul(p.transpose(-1, -2), do)
            if rep > 1:  # a KV head's gradient sums over the query heads it served
                dk, dv = dk.view(b, hkv, rep, s, d).sum(2), dv.view(b, hkv, rep, s, d).sum(2)
            dkv = dkv + torch.stack([dk, dv])
        if ring.cp > 1:
            dkv = ring.shift(dkv)  # the block held last is the next rank's: one more hop brings each home
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, *, causal: bool = True,
                   scale: float | None = None, load_balanced: bool = True) -> Tensor:
    """Attention of this rank's queries over the whole sequence held by the CP group.

    q: [batch, heads, s_local, head_dim]; k, v: [batch, kv_heads, s_local, head_dim] (kv_heads
    divides heads). Every rank holds the same number of tokens, laid out as ``positions`` says.
    Saved for backward: q, k, v, the output and an fp32 log-sum-exp per head and query.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ring = _Ring(group, q.shape[2], causal, load_balanced, q.device)
    out: Tensor = _RingAttention.apply(q, k, v, ring, scale)
    return out


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
