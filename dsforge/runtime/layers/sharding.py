"""How a dense weight is cut into tensor-parallel shards, and the parameter tags DeepSpeed and dsforge read.

A fused projection (QKV, gate+up) is a stack of blocks; each block is split on its own so every
rank gets its slice of every block ([q_r | k_r | v_r]), which keeps whole heads together under GQA
where q, k and v differ in width (Megatron's ColumnParallelLinear over a fused QKV, and HF GPT-2's
``c_attn`` as a Conv1D with its weight stored (in, out)).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dsforge.runtime.groups import ParallelGroups


def tp_group(groups: ParallelGroups | dist.ProcessGroup) -> dist.ProcessGroup:
    """The tensor-parallel group, from a ParallelGroups object or a group given directly."""
    return groups.tp if isinstance(groups, ParallelGroups) else groups


def split_sizes(total: int, parts: int) -> list[int]:
    """Split ``total`` rows over ``parts`` ranks as evenly as possible (the first ranks take the extra
    ones)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def block_widths(total: int, blocks: int | Sequence[int]) -> list[int]:
    """Widths of a fused output's blocks: ``blocks`` equal blocks, or the explicit widths."""
    if isinstance(blocks, int):
        if blocks < 1 or total % blocks:
            raise ValueError(f"{total} output features do not form {blocks} equal fused blocks")
        return [total // blocks] * blocks
    widths = list(blocks)
    if sum(widths) != total:
        raise ValueError(f"fused block widths {widths} sum to {sum(widths)}, not the {total} output features")
    return widths


def check_blocks(widths: Sequence[int], parts: int, unit: int, what: str) -> list[int]:
    """Per-rank widths of each block; a ValueError unless every block splits into whole ``unit``s."""
    for w in widths:
        if w % (parts * unit):
            units = f" of {unit} (one head)" if unit > 1 else ""
            raise ValueError(f"{what}: a block of {w} features does not split into {parts} equal "
                             f"shards of whole units{units}; use a tensor-parallel size dividing {w // unit}")
    return [w // parts for w in widths]


def shard_blocks(weight: Tensor, widths: Sequence[int], rank: int, parts: int, dim: int = 0) -> Tensor:
    """This rank's slice of every block of ``weight`` along ``dim``, concatenated in block order."""
    pieces, start = [], 0
    for w in widths:
        shard = w // parts
        pieces.append(weight.narrow(dim, start + rank * shard, shard))
        start += w
    return torch.cat(pieces, dim=dim)


def gathered_order(local_widths: Sequence[int], parts: int) -> list[int] | None:
    """Column permutation turning a rank-major gather [r0: b0 b1 | r1: b0 b1] into block order; None if
    identity."""
    if len(local_widths) == 1:
        return None
    per_rank = sum(local_widths)
    order: list[int] = []
    for b, w in enumerate(local_widths):
        offset = sum(local_widths[:b])
        for r in range(parts):
            start = r * per_rank + offset
            order.extend(range(start, start + w))
    return order


def dense_weight(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """The (out, in) weight and the bias of an nn.Linear or a HF Conv1D (whose weight is stored (in, out))."""
    weight: Any = getattr(module, "weight", None)
    bias: Any = getattr(module, "bias", None)
    if isinstance(module, nn.Linear):
        return weight, bias
    if (
        type(module).__name__ == "Conv1D"
        and weight.dim() == 2
        and weight.shape[1] == getattr(module, "nf", -1)
    ):
        return weight.t(), bias
    raise TypeError(f"cannot shard a {type(module).__name__}: expected nn.Linear or transformers' Conv1D")


def linear_init_(weight: Tensor, bias: Tensor | None, fan_in: int) -> None:
    """Initialise a shard with nn.Linear's distribution for the full layer's fan-in."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        # kaiming_uniform(a=sqrt(5)) on the full layer is U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        weight.uniform_(-bound, bound)
        if bias is not None:
            bias.uniform_(-bound, bound)


def _tag(param: Tensor, **tags: object) -> None:
    """Set attributes on a parameter (DeepSpeed and Megatron read such tags with getattr)."""
    for name, value in tags.items():
        setattr(param, name, value)


def mark_tensor_parallel(param: Tensor, dim: int) -> None:
    """Tag a sharded parameter: DeepSpeed counts it on every TP rank in grad norms (runtime/utils.py)."""
    _tag(param, tensor_model_parallel=True, partition_dim=dim)


def mark_sequence_parallel(param: Tensor) -> None:
    """Tag a replicated parameter that only sees this rank's sequence shard (its gradient is partial)."""
    _tag(param, sequence_parallel=True)


def allreduce_sequence_parallel_grads(params: Iterable[Tensor], group: dist.ProcessGroup) -> None:
    """Sum the partial gradients of sequence-parallel parameters over the TP group (Megatron's finalize
    step)."""
    grads = [p.grad for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
