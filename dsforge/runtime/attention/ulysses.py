"""Ulysses context parallelism (Jacobs et al. 2023) on DeepSpeed's own ``DistributedAttention``.

DeepSpeed's layer (deepspeed/sequence/layer.py) all-to-alls q, k and v from "my tokens, all heads"
to "all tokens, my heads", runs any local attention, and all-to-alls the output back; its
backward is the reverse all-to-all. dsforge only fixes the layout ([batch, seq, heads, head_dim],
sequence split contiguously in rank order) and supplies a causal SDPA as the default local
attention. The heads (KV heads under GQA) must divide by cp or follow DeepSpeed's uneven rule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dsforge.runtime.groups import ensure_deepspeed_comm


def sdpa_local_attention(causal: bool = True) -> Callable[..., Tensor]:
    """A local attention over [batch, seq, heads, head_dim] tensors (SDPA, grouped-query aware)."""

    def attend(q: Tensor, k: Tensor, v: Tensor, *args: object, **kwargs: object) -> Tensor:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal, enable_gqa=k.shape[2] != q.shape[2])
        return out.transpose(1, 2)

    return attend


class UlyssesAttention(nn.Module):
    """Attention over the full sequence for tokens split contiguously over the CP group, via all-to-all."""

    def __init__(self, group: dist.ProcessGroup, local_attention: Callable[..., Tensor] | None = None,
                 causal: bool = True, num_kv_heads: int | None = None) -> None:
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        ensure_deepspeed_comm()
        self.group = group
        local = local_attention if local_attention is not None else sdpa_local_attention(causal)
        # scatter heads (dim 2), gather the sequence (dim 1) of [batch, seq, heads, head_dim].
        self.inner = DistributedAttention(local, group, scatter_idx=2, gather_idx=1,
                                          num_kv_heads=num_kv_heads)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """[b, s_local, h, d] queries, [b, s_local, h_kv, d] keys/values -> [b, s_local, h, d]."""
        return self.inner(q, k, v, 0)
