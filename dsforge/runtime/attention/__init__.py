"""Context parallelism: dsforge's own ring attention (load-balanced, causal) and a Ulysses wrapper around
DeepSpeed's DistributedAttention (imports torch)."""

from dsforge.runtime.attention.ring import RingAttention, ring_attention
from dsforge.runtime.attention.sequence import chunk_ids, gather_sequence, positions, shard_sequence
from dsforge.runtime.attention.ulysses import UlyssesAttention, sdpa_local_attention

__all__ = [
           "RingAttention",
           "UlyssesAttention",
           "chunk_ids",
           "gather_sequence",
           "positions",
           "ring_attention",
           "sdpa_local_attention",
           "shard_sequence",
]
