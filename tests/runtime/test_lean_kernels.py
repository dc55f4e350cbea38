"""The lean kernels against the plain ops they replace, on one process: same forward, same gradients.

fp32 to 1e-5 of the largest magnitude (the analytic backward re-associates the chain rule's products);
the forward of the norm, SwiGLU and gelu_new Functions is HF's ops in HF's order, so it is bit for bit.
Each kernel's saved bytes are counted with `saved_tensors_hooks` (what backward keeps).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.runtime.kernels.fused_ce import fused_linear_cross_entropy
from dsforge.runtime.kernels.gelu import LeanGeluNew
from dsforge.runtime.kernels.norms import rms_norm
from dsforge.runtime.kernels.swiglu import swiglu


def close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    scale = float(want.detach().abs().max()) or 1.0
    assert float((got.detach().float() - want.detach().float()).abs().max()) <= rtol * scale, (got, want)


def saved_bytes(fn: object) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if not isinstance(t, torch.nn.Parameter):
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()  # type: ignore[operator]
    return total


def _head_loss_grads(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                     fused: bool) -> tuple[torch.Tensor, ...]:
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    if fused:
        loss = fused_linear_cross_entropy(h, w, target).sum()
    else:
        loss = F.cross_entropy(F.linear(h, w).float(), target, ignore_index=-100, reduction="sum")
    loss.backward()
    assert h.grad is not None and w.grad is not None
    return loss.detach(), h.grad, w.grad


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 40), vocab=st.integers(2, 70), ignored=st.integers(0, 5),
       seed=st.integers(0, 2**16))
def test_fused_loss_equals_head_then_cross_entropy(tokens: int, vocab: int, ignored: int, seed: int) -> None:
    # Against the same computation in fp64: the fused loss is as close to it as the unfused fp32 path (twice
    # its error, plus 1e-6 of the gradient's scale: both sides round softmax - onehot near a saturated token)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 16, generator=g)
    weight = torch.randn(vocab, 16, generator=g)
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[:min(ignored, tokens)] = -100
    exact = _head_loss_grads(hidden.double(), weight.double(), target, fused=False)
    fused = _head_loss_grads(hidden, weight, target, fused=True)
    plain = _head_loss_grads(hidden, weight, target, fused=False)
    for got, ref, want in zip(fused, plain, exact):
        scale = float(want.abs().max()) or 1.0
        err_fused = float((got.double() - want).abs().max())
        err_plain = float((ref.double() - want).abs().max())
        assert err_fused <= 2 * err_plain + 1e-6 * scale, (err_fused, err_plain, scale)
        close(got, ref, 1e-4)  # and the two fp32 paths agree


def test_fused_loss_chunks_and_keeps_no_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    # 7 tokens per chunk over 50: the chunk walk and the recomputing backward still give the same loss and
    # gradients; backward keeps the input, the targets and per token the fp32 row maximum and sum of
    # exponentials, no tokens x vocab
    import dsforge.runtime.kernels.fused_ce as fce

    monkeypatch.setattr(fce, "loss_chunk_tokens", lambda v: 7)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 25, 16, generator=g, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(300, 16, generator=g))  # a parameter: not counted as saved
    target = torch.randint(0, 300, (2, 25), generator=g)
    ref = F.cross_entropy(F.linear(hidden, weight).float().reshape(-1, 300), target.reshape(-1),
                          reduction="sum")
    ref.backward()
    want = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    kept = saved_bytes(lambda: fused_linear_cross_entropy(hidden, weight, target).sum().backward())
    close(hidden.grad, want[0])
    close(weight.grad, want[1])
    assert kept == 50 * 16 * 4 + 50 * 8 + 50 * 2 * 4, kept
    unfused = saved_bytes(lambda: F.cross_entropy(F.linear(hidden, weight).float().reshape(-1, 300),
                                                  target.reshape(-1)))
    assert unfused > 50 * 300 * 4, unfused


def test_fused_loss_bf16_matches_the_unfused_bf16_path() -> None:
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(64, 32, generator=g).bfloat16().requires_grad_()
    weight = (0.1 * torch.randn(500, 32, generator=g)).bfloat16().requires_grad_()
    target = torch.randint(0, 500, (64,), generator=g)
    ref = F.cross_entropy(F.linear(hidden, weight).float(), target, reduction="sum")
    ref.backward()
    want = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    got = fused_linear_cross_entropy(hidden, weight, target).sum()
    got.backward()
    close(got, ref, 1e-5)
    close(hidden.grad, want[0], 1e-2)  # bf16 gradients: one rounding of the same fp32 values
    close(weight.grad, want[1], 1e-2)


@pytest.mark.parametrize("cast_first", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_hf_and_saves_input_and_rstd(cast_first: bool, dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    hf = (LlamaRMSNorm if cast_first else Olmo2RMSNorm)(24, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(24))
    x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(2)).to(dtype).requires_grad_()
    dy = torch.randn(3, 5, 24).to(dtype)
    want = hf(x)
    want.backward(dy)
    want_g = (x.grad.clone(), hf.weight.grad.clone())
    x.grad = hf.weight.grad = None
    got = rms_norm(x, hf.weight, hf.variance_epsilon, cast_first)
    assert torch.equal(got, want)  # the forward is HF's ops, bit for bit
    got.backward(dy)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    close(x.grad, want_g[0], tol)
    close(hf.weight.grad, want_g[1], tol)
    kept = saved_bytes(lambda: rms_norm(x, hf.weight, 1e-5, cast_first))
    assert kept == x.numel() * x.element_size() + 15 * 4, kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_silu_times_up_and_saves_two_tensors(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(4, 30, generator=g).to(dtype).requires_grad_() for _ in range(2))
    dy = torch.randn(4, 30, generator=g).to(dtype)
    want = F.silu(gate) * up
    want.backward(dy)
    want_g = (gate.grad.clone(), up.grad.clone())
    gate.grad = up.grad = None
    got = swiglu(gate, up)
    assert torch.equal(got, want)
    got.backward(dy)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    close(gate.grad, want_g[0], tol)
    close(up.grad, want_g[1], tol)
    assert saved_bytes(lambda: swiglu(gate, up)) == 2 * gate.numel() * gate.element_size()
    # + the product's user
    assert saved_bytes(lambda: F.silu(gate) * up) == 3 * gate.numel() * gate.element_size()


def test_gelu_new_equals_hf_and_saves_its_input() -> None:
    from transformers.activations import NewGELUActivation

    x = (3 * torch.randn(200, generator=torch.Generator().manual_seed(4))).requires_grad_()
    dy = torch.randn(200)
    want = NewGELUActivation()(x)
    want.backward(dy)
    want_g = x.grad.clone()
    x.grad = None
    got = LeanGeluNew()(x)
    assert torch.equal(got, want)
    got.backward(dy)
    close(x.grad, want_g)
    assert saved_bytes(lambda: LeanGeluNew()(x)) == 200 * 4
