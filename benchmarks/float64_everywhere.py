"""Float64 with the model's own float32 casts promoted: a run in which rounding is a billion times smaller
than float32's everywhere, including the parts a model computes in float32 whatever its dtype (norms, softmax,
routers, gated delta rules, hyper-connections).

`model.double()` alone leaves those casts in place, so a float64 comparison of such a model still carries
float32's rounding, which a gradient that is a small difference of large terms amplifies past any fixed
tolerance. Under this mode every float32 a torch function or tensor method is asked for becomes float64
(the reference and the rewritten model alike), so what remains between them is mathematics, not summation
order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _wide(value: Any) -> Any:
    return torch.float64 if value is torch.float32 else value


class Float64Everywhere(TorchFunctionMode):
    """A torch function mode that turns every request for float32 (dtype arguments, `.float()`,
    `.to(torch.float32)`, `.type(torch.float32)`) into float64."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = {k: _wide(v) for k, v in (kwargs or {}).items()}
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        return func(*(_wide(a) for a in args), **kwargs)


@contextlib.contextmanager
def float64_everywhere() -> Iterator[None]:
    """Run the body with float64 as the default dtype and every float32 request promoted to float64,
    custom autograd Functions' backward included."""
    # The autograd engine runs a Function's backward without the caller's function modes (measured: a
    # float32 request there stayed float32), so its entry point enters the mode again.
    node = torch.autograd.function.BackwardCFunction
    entry = node.apply

    def widened(self: Any, *args: Any) -> Any:
        with Float64Everywhere():
            return entry(self, *args)

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    node.apply = widened
    try:
        with Float64Everywhere():
            yield
    finally:
        node.apply = entry
        torch.set_default_dtype(before)
