"""dsforge's own tensor-parallel layers: column/row-parallel linear, vocabulary-parallel embedding, LM head
and cross entropy, and the differentiable collectives between them (imports torch)."""

from dsforge.runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
from dsforge.runtime.layers.mappings import (
                                             copy_to_tp,
                                             gather_from_sequence,
                                             gather_from_tp,
                                             reduce_from_tp,
                                             reduce_scatter_to_sequence,
                                             scatter_to_sequence,
                                             scatter_to_tp,
)
from dsforge.runtime.layers.sharding import (
                                             allreduce_sequence_parallel_grads,
                                             mark_sequence_parallel,
                                             mark_tensor_parallel,
                                             split_sizes,
)
from dsforge.runtime.layers.vocab import (
                                             VocabParallelEmbedding,
                                             VocabParallelLMHead,
                                             vocab_parallel_cross_entropy,
)

__all__ = [
                                             "ColumnParallelLinear",
                                             "RowParallelLinear",
                                             "VocabParallelEmbedding",
                                             "VocabParallelLMHead",
                                             "allreduce_sequence_parallel_grads",
                                             "copy_to_tp",
                                             "gather_from_sequence",
                                             "gather_from_tp",
                                             "mark_sequence_parallel",
                                             "mark_tensor_parallel",
                                             "reduce_from_tp",
                                             "reduce_scatter_to_sequence",
                                             "scatter_to_sequence",
                                             "scatter_to_tp",
                                             "split_sizes",
                                             "vocab_parallel_cross_entropy",
]
