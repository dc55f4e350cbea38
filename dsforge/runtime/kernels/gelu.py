"""GPT-2's `gelu_new` (the tanh approximation) as one autograd Function that saves only its input.

In plain ops (transformers' NewGELUActivation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))) autograd
keeps five f-wide tensors per MLP; this Function keeps its input, so the MLP keeps two with the output
projection's input (Megatron's fused bias-GELU, megatron/core/fusions/fused_bias_gelu.py, keeps the same).
The forward is HF's expression op for op (bit for bit); the backward its analytic derivative.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

_C = math.sqrt(2.0 / math.pi)


def _gelu_new(x: Tensor) -> Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_C * (x + 0.044715 * torch.pow(x, 3.0))))


class _GeluNew(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return _gelu_new(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        t = torch.tanh(_C * (x + 0.044715 * x * x * x))
        d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * x * x)
        return grad * d


class LeanGeluNew(nn.Module):
    """A drop-in for transformers' NewGELUActivation that saves only its input."""

    def forward(self, x: Tensor) -> Tensor:
        """gelu_new(x)."""
        return _GeluNew.apply(x)
