"""Vocabulary-parallel embedding, LM head and cross entropy (Megatron-LM's VocabParallelEmbedding and
vocab_parallel_cross_entropy, Shoeybi et al. 2019 sec. 3).

The vocabulary rows are split over the TP group (the first ``vocab % tp`` ranks take one extra
row, so a vocabulary such as GPT-2's 50257 needs no padding); the embedding and the LM head use the
same split, so a tied head can share the embedding's shard. The loss never gathers the logits: it
all-reduces the row maximum, the target logit and the sum of exponentials, three numbers per token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dsforge.runtime.groups import ParallelGroups
from dsforge.runtime.layers.mappings import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)
from dsforge.runtime.layers.sharding import mark_tensor_parallel, split_sizes, tp_group


class _VocabShard(nn.Module):
    """A (local vocab rows, dim) weight and the global row range it covers."""

    def __init__(self, vocab: int, dim: int, pg: dist.ProcessGroup, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.pg, self.tp, self.tp_rank = pg, dist.get_world_size(pg), dist.get_rank(pg)
        self.vocab, self.sizes = vocab, split_sizes(vocab, self.tp)
        self.vocab_start = sum(self.sizes[:self.tp_rank])
        self.vocab_end = self.vocab_start + self.sizes[self.tp_rank]
        self.weight = nn.Parameter(torch.empty(self.sizes[self.tp_rank], dim, dtype=dtype))
        mark_tensor_parallel(self.weight, 0)

    def load_dense_rows(self, weight: Tensor) -> None:
        """Copy this rank's rows of a full (vocab, dim) weight."""
        if weight.shape[0] != self.vocab:
            raise ValueError(f"dense weight has {weight.shape[0]} rows, "
                             f"this layer's vocabulary is {self.vocab}")
        with torch.no_grad():
            self.weight.copy_(weight[self.vocab_start:self.vocab_end])


class VocabParallelEmbedding(_VocabShard):
    """Embedding whose rows are split over the TP group; tokens outside this rank's range contribute zero.

    ``embed_scale``: a constant the looked-up rows are multiplied by (Gemma's sqrt(hidden)), kept
    from the dense module as HF applies it (a non-persistent buffer, cast to the weight's dtype).
    """

    embed_scale: Tensor | None

    def __init__(self, num_embeddings: int, embedding_dim: int, pg: dist.ProcessGroup,
                 padding_idx: int | None = None, sequence_parallel: bool = False, sequence_dim: int = 1,
                 reset: bool = True, dtype: torch.dtype | None = None,
                 embed_scale: Tensor | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, pg, dtype)
        self.register_buffer("embed_scale", None if embed_scale is None else embed_scale.detach().clone(),
                             persistent=False)
        self.embedding_dim, self.padding_idx = embedding_dim, padding_idx
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        inside = padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
        self._local_padding = padding_idx - self.vocab_start if inside and padding_idx is not None else None
        if reset:
            with torch.no_grad():
                self.weight.normal_()  # nn.Embedding's N(0, 1)
                if self._local_padding is not None:
                    self.weight[self._local_padding].zero_()

    @classmethod
    def from_dense(cls, dense: nn.Embedding, groups: ParallelGroups | dist.ProcessGroup, *,
                   sequence_parallel: bool = False, sequence_dim: int = 1) -> VocabParallelEmbedding:
        """Shard an existing nn.Embedding: this rank keeps its range of rows."""
        scale = getattr(dense, "embed_scale", None)
        if isinstance(scale, (int, float)):  # older HF keeps the scale as a plain number
            scale = torch.tensor(float(scale))
        layer = cls(dense.num_embeddings, dense.embedding_dim, tp_group(groups),
                    padding_idx=dense.padding_idx, sequence_parallel=sequence_parallel,
                    sequence_dim=sequence_dim, reset=False, dtype=dense.weight.dtype,
                    embed_scale=scale if isinstance(scale, Tensor) else None)
        layer.load_dense_rows(dense.weight)
        if dense.weight.device.type == "meta":  # a rank's skeleton: its parameters are on meta already, and
            return layer                        # .to("meta") would lose the embed_scale buffer's value
        return layer.to(dense.weight.device)

    def forward(self, ids: Tensor) -> Tensor:
        """Token ids (replicated) -> embeddings, summed over the group (or reduce-scattered along the
        sequence)."""
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self._local_padding)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(self.weight.dtype)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.pg, self.sequence_dim)
        return reduce_from_tp(out, self.pg)


class VocabParallelLMHead(_VocabShard):
    """LM head producing this rank's slice of the vocabulary logits (a column-parallel linear; a bias, as
    CodeGen, GPT-J and Phi have, is split by the same vocabulary rows)."""

    bias: nn.Parameter | None

    def __init__(self, hidden: int, vocab: int, pg: dist.ProcessGroup, gather_output: bool = False,
                 sequence_parallel: bool = False, sequence_dim: int = 1, reset: bool = True,
                 dtype: torch.dtype | None = None, bias: bool = False) -> None:
        super().__init__(vocab, hidden, pg, dtype)
        self.gather_output, self.sequence_parallel, self.sequence_dim = (
            gather_output,
            sequence_parallel,
            sequence_dim,
        )
        self.bias = nn.Parameter(torch.zeros(self.sizes[self.tp_rank], dtype=dtype)) if bias else None
        if self.bias is not None:
            mark_tensor_parallel(self.bias, 0)
        if reset:
            with torch.no_grad():
                bound = hidden ** -0.5  # nn.Linear's U(-1/sqrt(fan_in), 1/sqrt(fan_in))
                self.weight.uniform_(-bound, bound)

    @classmethod
    def from_dense(cls, dense: nn.Linear, groups: ParallelGroups | dist.ProcessGroup, *,
                   gather_output: bool = False, sequence_parallel: bool = False,
                   sequence_dim: int = 1) -> VocabParallelLMHead:
        """Shard an existing nn.Linear(hidden, vocab): this rank keeps its rows of the weight and the bias."""
        layer = cls(dense.in_features, dense.out_features, tp_group(groups), gather_output=gather_output,
                    sequence_parallel=sequence_parallel, sequence_dim=sequence_dim, reset=False,
                    dtype=dense.weight.dtype, bias=dense.bias is not None)
        layer.load_dense_rows(dense.weight)
        if layer.bias is not None and dense.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(dense.bias[layer.vocab_start:layer.vocab_end])
        return layer.to(dense.weight.device)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's shard as this head's weight (tied embeddings: same vocabulary split)."""
        if embedding.sizes != self.sizes or embedding.weight.shape != self.weight.shape:
            raise ValueError("cannot tie: the embedding and the head split the vocabulary differently")
        self.weight = embedding.weight

    def forward(self, hidden: Tensor) -> Tensor:
        """Hidden states (replicated, or sequence-sharded with SP) -> this rank's logits (or all,
        gathered)."""
        if self.sequence_parallel:
            hidden = gather_from_sequence(hidden, self.pg, self.sequence_dim, grad_is_partial=True)
        else:
            hidden = copy_to_tp(hidden, self.pg)
        logits = F.linear(hidden, self.weight, self.bias)
        return gather_from_tp(logits, self.pg, -1, self.sizes) if self.gather_output else logits


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, pg: dist.ProcessGroup, vocab_start: int,
                ignore_index: int) -> Tensor:
        ctx.dtype = logits.dtype
        logits = logits.float()
        row_max = logits.detach().amax(dim=-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=pg)
        shifted = logits - row_max.unsqueeze(-1)
        local_target = target - vocab_start
        mine = (local_target >= 0) & (local_target < logits.shape[-1])
        index = local_target.masked_fill(~mine, 0).unsqueeze(-1)
        exp = shifted.exp()
        # One all-reduce carries both per-token sums: the target logit (found on one rank) and sum(exp).
        sums = torch.stack([shifted.gather(-1, index).squeeze(-1) * mine, exp.sum(dim=-1)])
        dist.all_reduce(sums, group=pg)
        valid = target != ignore_index
        loss = (sums[1].log() - sums[0]) * valid
        ctx.save_for_backward(exp.div_(sums[1].unsqueeze(-1)), index, mine & valid, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        softmax, index, hit, valid = ctx.saved_tensors
        # d loss / d logit_j = softmax_j - [j == target], zero for ignored tokens.
        grad_logits = softmax.scatter_add(-1, index, -hit.unsqueeze(-1).to(softmax.dtype))
        grad_logits = grad_logits * (grad * valid).unsqueeze(-1)
        return grad_logits.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, pg: dist.ProcessGroup, vocab_start: int,
                                 ignore_index: int = -100) -> Tensor:
    """Per-token cross entropy from vocabulary-split logits [..., V_local]; ignored tokens give 0.

    ``vocab_start`` is the first global vocabulary row of this rank's logits (``head.vocab_start``).
    The result is fp32 and replicated over the group; average it over the non-ignored tokens.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, pg, vocab_start, ignore_index)
