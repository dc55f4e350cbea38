"""SwiGLU, silu(gate) * up, as one autograd Function that saves only its two inputs.

Plain ops save four f-wide tensors per MLP: SiLU's input (gate) and output, the product's other
factor (up), and the product itself (the down projection's input). This Function saves gate and up
and recomputes silu(gate) in backward, so the MLP keeps three (with the down projection's input), as
Megatron's fused `SwiGLUFunction` (megatron/core/fusions/fused_bias_swiglu.py) and Liger-Kernel's
`ops/swiglu.py` do. The forward is the same two ops as HF's `act_fn(gate) * up` (bit for bit); the
backward is their analytic derivative: d/dgate = up * s * (1 + gate * (1 - s)), s = sigmoid(gate).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        silu = gate * sig
        return grad * up * sig * (1 + gate * (1 - sig)), grad * silu


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, saving only gate and up for backward."""
    return _SwiGLU.apply(gate, up)
