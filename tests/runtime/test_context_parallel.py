"""Context parallelism (cp 2): ring attention and Ulysses against full-sequence attention on one process.

Every rank builds the full q, k, v with the same seed, computes causal SDPA over the whole
sequence (the reference), then runs the parallel attention on its own tokens only. Outputs and the
gradients of q, k and v must equal the reference's rows for this rank's tokens. A failure means a
wrong causal mask across blocks, a wrong online-softmax merge, or a backward that loses the
gradient of a key/value block that travelled around the ring (or through the all-to-all).

Tolerance: rtol 1e-5 of the reference's largest magnitude. The ring merges per-block softmax
sums in a different order from SDPA (and exp(s - m) with a different m), which perturbs fp32
results by a few ulps per accumulated term; sequences here have at most 32 keys, so errors stay
around 1e-7 relative. A masking or merge bug errs by O(1e-1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsforge.compiler.plan.placement import place
from dsforge.runtime.attention import (
    RingAttention,
    UlyssesAttention,
    gather_sequence,
    positions,
    ring_attention,
    shard_sequence,
)
from dsforge.runtime.groups import create_groups
from tests.runtime.launcher import report, run

RTOL = 1e-5


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Full-sequence attention, [b, h, s, d] with GQA by repeating the KV heads."""
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          is_causal=causal)


def check_ring(group: torch.distributed.ProcessGroup, causal: bool, load_balanced: bool, seed: int,
               shape: tuple[int, int, int, int, int] = (2, 4, 2, 16, 8)) -> None:
    """Ring attention on this rank's tokens equals the full attention's rows, values and q/k/v gradients."""
    b, h, hkv, s, d = shape
    cp, me = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    torch.manual_seed(seed)
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    w = torch.randn(b, h, s, d)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    ref = reference_attention(q, k, v, causal)
    (ref * w).sum().backward()
    local = [shard_sequence(t.detach(), me, cp, dim=2, load_balanced=load_balanced).requires_grad_(True)
             for t in (q, k, v)]
    out = ring_attention(*local, group, causal=causal, load_balanced=load_balanced)
    tag = f"ring(cp={cp}, causal={causal}, balanced={load_balanced})"
    cut = lambda t: shard_sequence(t, me, cp, dim=2, load_balanced=load_balanced)
    report(f"{tag} out", out, cut(ref), RTOL)
    (out * cut(w)).sum().backward()
    for name, mine, full in zip("qkv", local, (q, k, v)):
        report(f"{tag} d{name}", mine.grad, cut(full.grad), RTOL)


def _layout_checks(cp: int, me: int, group: torch.distributed.ProcessGroup) -> None:
    assert positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    torch.manual_seed(7)
    x = torch.randn(2, 16, 3, requires_grad=True)
    for balanced in (True, False):
        part = shard_sequence(x.detach(), me, cp, dim=1, load_balanced=balanced).requires_grad_(True)
        whole = gather_sequence(part, group, dim=1, load_balanced=balanced)
        report(f"gather_sequence(balanced={balanced})", whole, x, 0.0)
        whole.sum().backward()  # the backward keeps exactly this rank's part of a replicated gradient
        report("gather_sequence backward", part.grad, torch.ones_like(part), 0.0)


def _ulysses(group: torch.distributed.ProcessGroup) -> None:
    cp, me = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    b, s, h, hkv, d = 2, 16, 4, 2, 8
    torch.manual_seed(11)
    q, k, v = torch.randn(b, s, h, d), torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, d)
    w = torch.randn(b, s, h, d)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    ref = reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True).transpose(1, 2)
    (ref * w).sum().backward()
    attn = UlyssesAttention(group)
    cut = lambda t: shard_sequence(t, me, cp, dim=1, load_balanced=False)
    local = [cut(t.detach()).requires_grad_(True) for t in (q, k, v)]
    out = attn(*local)
    report("ulysses(cp=2, gqa) out", out, cut(ref), RTOL)
    (out * cut(w)).sum().backward()
    for name, mine, full in zip("qkv", local, (q, k, v)):
        report(f"ulysses d{name}", mine.grad, cut(full.grad), RTOL)


def _cp2_worker(rank: int, world: int) -> None:
    g = create_groups(place(tp=1, pp=1, dp=1, cp=2, ep=1, gpus_per_node=2))
    cp, me = g.size("cp"), g.index("cp")
    _layout_checks(cp, me, g.cp)
    check_ring(g.cp, causal=True, load_balanced=True, seed=1)
    check_ring(g.cp, causal=False, load_balanced=True, seed=2)
    # Contiguous layout: rank 0 sees none of rank 1's keys, so it skips a block (the deadlock-prone path).
    check_ring(g.cp, causal=True, load_balanced=False, seed=3)
    module = RingAttention(g.cp)
    torch.manual_seed(4)
    q = torch.randn(1, 2, 8, 4)
    assert module(q, q, q).shape == q.shape
    _ulysses(g.cp)


@pytest.mark.slow
def test_ring_and_ulysses_match_full_attention_cp2() -> None:
    run(_cp2_worker, 2)
