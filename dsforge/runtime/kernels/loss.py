"""The runtime's token loss through the fused LM head + cross entropy (`fused_ce`), for the head dsforge has.

The head is the HF model's ``lm_head``: a bias-free nn.Linear (tp = 1) or dsforge's VocabParallelLMHead,
whose input mapping (copy to TP, or the sequence all-gather under SP) is applied here as its own forward
applies it, so the hidden-state gradient is summed over the group in the same place.
"""

from __future__ import annotations

from torch import Tensor, nn

from dsforge.runtime.errors import RuntimeRefusal
from dsforge.runtime.kernels.fused_ce import fused_linear_cross_entropy
from dsforge.runtime.layers import VocabParallelLMHead, copy_to_tp, gather_from_sequence


class FusedLossError(RuntimeRefusal, RuntimeError):
    """The model's head or final logits are not what the fused loss computes exactly."""


def check_fused_head(model: nn.Module) -> None:
    """Refuse a model whose logits the fused loss would not reproduce (soft-capping, scaling, a biased
    head)."""
    cfg = getattr(model, "config", None)
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(cfg, key, None) not in (None, 1, 1.0):
            raise FusedLossError(f"the model's config sets {key}={getattr(cfg, key)!r}: the fused loss does "
                                 f"not apply it; set training.kernels.fused_loss: false")
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model:
        raise FusedLossError(f"the model ({type(model).__name__}) has no HF base_model to take the hidden "
                             f"states from: set training.kernels.fused_loss: false")
    head = getattr(model, "lm_head", None)
    if isinstance(head, VocabParallelLMHead):
        if head.gather_output and head.tp > 1:
            raise FusedLossError("the LM head gathers its logits: the fused "
                                 "loss needs them split over the vocabulary")
        if head.bias is not None:
            raise FusedLossError("the model's lm_head has a bias: the fused loss needs a bias-free linear "
                                 "head; set training.kernels.fused_loss: false")
    elif not isinstance(head, nn.Linear) or head.bias is not None:
        raise FusedLossError(f"the model's lm_head is a {type(head).__name__}"
                             f"{' with a bias' if isinstance(head, nn.Linear) else ''}: the fused loss needs "
                             f"a bias-free linear head; set training.kernels.fused_loss: false")


def fused_token_loss_sum(hidden: Tensor, targets: Tensor, head: nn.Module, ignore_index: int) -> Tensor:
    """Sum of next-token cross entropy over the non-ignored targets of the head's logits of ``hidden``."""
    if isinstance(head, VocabParallelLMHead):
        if head.sequence_parallel:
            hidden = gather_from_sequence(hidden, head.pg, head.sequence_dim, grad_is_partial=True)
        else:
            hidden = copy_to_tp(hidden, head.pg)
        pg = head.pg if head.tp > 1 else None
        return fused_linear_cross_entropy(hidden, head.weight, targets, pg, head.vocab_start,
                                          ignore_index).sum()
    return fused_linear_cross_entropy(hidden, head.weight, targets, None, 0, ignore_index).sum()
