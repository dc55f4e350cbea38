"""Column- and row-parallel linear layers (Shoeybi et al. 2019, Megatron-LM sec. 3), with sequence
parallelism.

A column-parallel layer holds a slice of the output features and leaves its output split; a
row-parallel layer holds the matching slice of the input features and sums the partial products
over the TP group (all-reduce), or, with sequence parallelism (Korthikanti et al. 2022), sums and
scatters them along the sequence (reduce-scatter). Neither reads a global: the TP group is given.
They are plain nn.Modules, so they sit inside PipelineModule stages like any layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dsforge.runtime.groups import ParallelGroups
from dsforge.runtime.layers import gathered_input
from dsforge.runtime.layers.mappings import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_tp,
)
from dsforge.runtime.layers.sharding import (
    block_widths,
    check_blocks,
    dense_weight,
    gathered_order,
    linear_init_,
    mark_sequence_parallel,
    mark_tensor_parallel,
    shard_blocks,
    tp_group,
)


class ColumnParallelLinear(nn.Module):
    """Y = X A with A's output features split over the TP group; each fused block is split on its own."""

    _gather_order: Tensor | None

    def __init__(self, in_features: int, out_features: int, pg: dist.ProcessGroup, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 blocks: int | Sequence[int] = 1, unit: int = 1, sequence_dim: int = 1,
                 reset: bool = True, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.pg, self.tp, self.tp_rank = pg, dist.get_world_size(pg), dist.get_rank(pg)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel, self.sequence_dim = (
            gather_output,
            sequence_parallel,
            sequence_dim,
        )
        self.block_widths = block_widths(out_features, blocks)
        self.local_widths = check_blocks(self.block_widths, self.tp, unit, type(self).__name__)
        order = gathered_order(self.local_widths, self.tp)
        self.register_buffer("_gather_order", None if order is None else torch.tensor(order),
                             persistent=False)
        self.weight = nn.Parameter(torch.empty(sum(self.local_widths), in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(sum(self.local_widths), dtype=dtype)) if bias else None
        mark_tensor_parallel(self.weight, 0)
        if self.bias is not None:
            mark_tensor_parallel(self.bias, 0)
        if reset:
            linear_init_(self.weight, self.bias, in_features)

    @classmethod
    def from_dense(cls, dense: nn.Module, groups: ParallelGroups | dist.ProcessGroup, *,
                   gather_output: bool = False, sequence_parallel: bool = False,
                   blocks: int | Sequence[int] = 1, unit: int = 1,
                   sequence_dim: int = 1) -> ColumnParallelLinear:
        """Shard an existing nn.Linear / HF Conv1D: this rank keeps its slice of every output block."""
        weight, bias = dense_weight(dense)
        pg = tp_group(groups)
        layer = cls(weight.shape[1], weight.shape[0], pg, bias=bias is not None, gather_output=gather_output,
                    sequence_parallel=sequence_parallel, blocks=blocks, unit=unit, sequence_dim=sequence_dim,
                    reset=False, dtype=weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(shard_blocks(weight, layer.block_widths, layer.tp_rank, layer.tp))
            if bias is not None and layer.bias is not None:
                layer.bias.copy_(shard_blocks(bias, layer.block_widths, layer.tp_rank, layer.tp))
        return layer.to(weight.device)

    def forward(self, x: Tensor) -> Tensor:
        """Replicated (or, with SP, sequence-sharded) input -> this rank's output features (or all,
        gathered)."""
        if self.sequence_parallel:
            x = gather_from_sequence(x, self.pg, self.sequence_dim, grad_is_partial=True)
        else:
            x = copy_to_tp(x, self.pg)
        # inside a sequence region, the gathered input is saved as this rank's shard (gathered_input.py)
        y = gathered_input.linear(x, self.weight, self.bias)
        if not self.gather_output:
            return y
        y = gather_from_tp(y, self.pg, -1)
        return y if self._gather_order is None else y.index_select(-1, self._gather_order)

    def extra_repr(self) -> str:
        """Global and local shapes."""
        return (f"in={self.in_features}, out={self.out_features} (local {sum(self.local_widths)}), "
                f"tp={self.tp}, blocks={self.block_widths}, gather_output={self.gather_output}, "
                f"sp={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = X A with A's input features split over the TP group; partial products summed (or
    reduce-scattered)."""

    def __init__(self, in_features: int, out_features: int, pg: dist.ProcessGroup, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, unit: int = 1,
                 sequence_dim: int = 1, reset: bool = True, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear with sequence_parallel needs input_is_parallel=True: the "
                             "input must come split along features from a column-parallel layer")
        self.pg, self.tp, self.tp_rank = pg, dist.get_world_size(pg), dist.get_rank(pg)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.sequence_dim = \
            input_is_parallel, sequence_parallel, sequence_dim
        (self.local_in,) = check_blocks([in_features], self.tp, unit, type(self).__name__)
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in, dtype=dtype))
        # The bias is added once, after the reduction, so it stays whole on every rank.
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        mark_tensor_parallel(self.weight, 1)
        if self.bias is not None and sequence_parallel:
            mark_sequence_parallel(self.bias)
        if reset:
            linear_init_(self.weight, self.bias, in_features)

    @classmethod
    def from_dense(cls, dense: nn.Module, groups: ParallelGroups | dist.ProcessGroup, *,
                   input_is_parallel: bool = True, sequence_parallel: bool = False, unit: int = 1,
                   sequence_dim: int = 1) -> RowParallelLinear:
        """Shard an existing nn.Linear / HF Conv1D: this rank keeps its slice of the input features."""
        weight, bias = dense_weight(dense)
        pg = tp_group(groups)
        layer = cls(weight.shape[1], weight.shape[0], pg, bias=bias is not None,
                    input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel, unit=unit,
                    sequence_dim=sequence_dim, reset=False, dtype=weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(shard_blocks(weight, [weight.shape[1]], layer.tp_rank, layer.tp, dim=1))
            if bias is not None and layer.bias is not None:
                layer.bias.copy_(bias)
        return layer.to(weight.device)

    def forward(self, x: Tensor) -> Tensor:
        """Feature-split input -> full output (replicated, or this rank's sequence shard with SP)."""
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.pg, -1)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.pg, self.sequence_dim)
        else:
            y = reduce_from_tp(y, self.pg)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        """Global and local shapes."""
        return (f"in={self.in_features} (local {self.local_in}), out={self.out_features}, tp={self.tp}, "
                f"sp={self.sequence_parallel}")
