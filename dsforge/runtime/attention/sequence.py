"""Which tokens each context-parallel rank holds, and how to split or reassemble a sequence accordingly.

Ring attention uses the load-balanced layout: the sequence is cut into 2·cp chunks and rank i
holds chunks i and 2·cp-1-i, so under a causal mask every rank does the same amount of work
(Megatron-LM's context parallelism; Liu et al. 2023 for the ring). Ulysses needs the plain
contiguous layout, because its all-to-all reassembles the sequence in rank order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from dsforge.runtime.layers.mappings import gather_from_tp


def chunk_ids(rank: int, cp: int, load_balanced: bool) -> list[int]:
    """The sequence chunks rank ``rank`` holds: [i, 2cp-1-i] of 2cp (load-balanced) or [i] of cp."""
    return [rank, 2 * cp - 1 - rank] if load_balanced else [rank]


def _chunks_of(seq_len: int, cp: int, load_balanced: bool) -> int:
    parts = 2 * cp if load_balanced else cp
    if seq_len % parts:
        raise ValueError(f"sequence length {seq_len} does not split into {parts} equal chunks "
                         f"({'2 x ' if load_balanced else ''}cp={cp}); pad it to a multiple of {parts}")
    return seq_len // parts


def positions(seq_len: int, rank: int, cp: int, load_balanced: bool = True) -> Tensor:
    """Global token positions held by ``rank``, in local order."""
    size = _chunks_of(seq_len, cp, load_balanced)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunk_ids(rank, cp, load_balanced)])


def shard_sequence(x: Tensor, rank: int, cp: int, dim: int = 1, load_balanced: bool = True) -> Tensor:
    """This rank's tokens of a full-sequence tensor (no communication: every rank holds the full input)."""
    size = _chunks_of(x.shape[dim], cp, load_balanced)
    return torch.cat([x.narrow(dim, c * size, size) for c in chunk_ids(rank, cp, load_balanced)], dim=dim)


def gather_sequence(x: Tensor, group: dist.ProcessGroup, dim: int = 1, load_balanced: bool = True) -> Tensor:
    """Reassemble the full sequence from every rank's shard (differentiable: the backward keeps this rank's
    part)."""
    cp = dist.get_world_size(group)
    gathered = gather_from_tp(x, group, dim)  # rank-major: [r0 chunks | r1 chunks | ...]
    if not load_balanced or cp == 1:
        return gathered
    per = x.shape[dim] // 2
    order = [0] * (2 * cp)
    for r in range(cp):
        for slot, c in enumerate(chunk_ids(r, cp, True)):
            order[c] = 2 * r + slot
    return torch.cat([gathered.narrow(dim, i * per, per) for i in order], dim=dim)
