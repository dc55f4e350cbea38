"""HF's RMSNorm as one autograd Function that saves only its input and the fp32 reciprocal RMS.

transformers' LlamaRMSNorm (and the families that copy it) upcasts its input to fp32 and autograd keeps
that copy, the fp32 rstd and the normalised tensor in the compute dtype: ~ (4 + 2e) bytes per element.
This Function keeps the input in its own dtype and rstd (4 bytes per token), as Megatron/TE's fused
RMSNorm and Liger-Kernel's `ops/rms_norm.py` do, and recomputes the normalised tensor in backward.
Forward: HF's ops in HF's order, bit for bit. Two HF variants, told apart by where the weight multiplies:
``cast_first`` (Llama: weight * normed.to(dtype)) and not (OLMo2: (weight * normed).to(dtype)).
LayerNorm needs nothing here: torch's native layer_norm already saves its input and fp32 mean and rstd.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float, cast_first: bool) -> Tensor:
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        normed = x32 * rstd
        ctx.save_for_backward(x, weight, rstd)
        ctx.cast_first = cast_first
        return weight * normed.to(x.dtype) if cast_first else (weight * normed).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        x, weight, rstd = ctx.saved_tensors
        normed = x.to(torch.float32) * rstd
        if ctx.cast_first:  # y = w * n.to(dtype): the product and the weight's sum in the product's dtype
            n16 = normed.to(x.dtype)
            grad_weight = (grad * n16).to(weight.dtype)
            grad_n = (grad * weight).to(torch.float32)
        else:  # y = (w * n).to(dtype): the product in fp32 (or the weight's wider dtype)
            g = grad.to(torch.promote_types(weight.dtype, torch.float32))
            grad_weight = g * normed
            grad_n = (g * weight).to(torch.float32)
        grad_weight = grad_weight.reshape(-1, grad_weight.shape[-1]).sum(0).to(weight.dtype)
        grad_x = rstd * (grad_n - normed * (grad_n * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, cast_first: bool = True) -> Tensor:
    """HF's RMSNorm of ``x`` (over the last dimension), saving only ``x`` and the fp32 rstd for backward."""
    return _RMSNorm.apply(x, weight, eps, cast_first)
