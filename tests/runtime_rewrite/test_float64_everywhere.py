"""The zoo's float64 mode (benchmarks/float64_everywhere.py): every float32 a model asks torch for becomes
float64, and nothing outside the mode changes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.float64_everywhere import float64_everywhere


def test_every_float32_request_becomes_float64_inside_only():
    x = torch.randn(3, 4, dtype=torch.float64)
    with float64_everywhere():
        made = [torch.zeros(2, dtype=torch.float32), torch.ones(2), torch.arange(3.0), x.float(),
                x.to(torch.float32), x.to(dtype=torch.float32), x.to("cpu", torch.float32),
                x.type(torch.float32), F.softmax(x, dim=-1, dtype=torch.float32),
                x.softmax(-1, torch.float32),
                torch.nn.Linear(4, 2, dtype=torch.float32).weight]
        assert [t.dtype for t in made] == [torch.float64] * len(made)
        assert torch.tensor([1, 2]).dtype == torch.int64  # integers untouched
    assert torch.get_default_dtype() == torch.float32
    assert x.float().dtype == torch.float32 and torch.ones(2).dtype == torch.float32


def test_a_float32_cast_no_longer_rounds():
    x = torch.tensor([1.0 + 2.0 ** -40], dtype=torch.float64)
    assert x.float().double().item() == 1.0
    with float64_everywhere():
        assert x.float().double().item() == 1.0 + 2.0 ** -40


class _Halve(torch.autograd.Function):
    """A custom Function whose backward asks for float32, as dsforge's fused kernels do."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x / 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return (grad.to(torch.float32) / 2).to(grad.dtype)


def test_a_custom_functions_backward_is_widened_too():
    x = torch.full((1,), 1.0 + 2.0 ** -40, dtype=torch.float64, requires_grad=True)
    (_Halve.apply(x) * (1.0 + 2.0 ** -40)).sum().backward()
    assert x.grad.item() == 0.5  # float32 rounded the incoming gradient
    x.grad = None
    with float64_everywhere():
        (_Halve.apply(x) * (1.0 + 2.0 ** -40)).sum().backward()
    assert x.grad.item() == (1.0 + 2.0 ** -40) / 2
    assert torch.autograd.function.BackwardCFunction.apply.__name__ == "apply"  # restored
