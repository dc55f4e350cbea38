"""Weights arriving in another dtype than the job's precision: cast, stated, or refused
(dsforge.runtime.precision)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsforge.runtime.precision import PrecisionError, job_dtype, match_precision


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).to(dtype)


def test_job_dtype_follows_the_ds_config() -> None:
    assert job_dtype({"bf16": {"enabled": True}}) == torch.bfloat16
    assert job_dtype({"fp16": {"enabled": True}, "bf16": {"enabled": False}}) == torch.float16
    assert job_dtype({"bf16": {"enabled": False}}) == job_dtype({}) == torch.float32


def test_an_fp32_job_casts_bf16_weights_exactly_and_says_so() -> None:
    model = _model(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    said = match_precision(model, torch.float32)
    assert said is not None and "4 bfloat16 parameter(s)" in said and "cast to float32 (exact)" in said
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(a is b for a, b in zip(params, model.parameters()))  # the same Parameter objects
    assert all(torch.equal(p.detach(), b.float()) for p, b in zip(model.parameters(), before))
    assert match_precision(model, torch.float32) is None  # nothing left to say


def test_a_16bit_job_states_what_deepspeed_casts() -> None:
    said = match_precision(_model(torch.float16), torch.bfloat16)
    assert said is not None and "casts them to bfloat16" in said and "(rounding them)" in said
    assert "fp32 master weights" in said
    assert match_precision(_model(torch.bfloat16), torch.bfloat16) is None
    assert match_precision(_model(torch.float32), torch.bfloat16) is None  # the usual mixed-precision start


def test_fp16_refuses_weights_beyond_its_range() -> None:
    model = _model(torch.bfloat16)
    with torch.no_grad():
        model[0].weight[0, 0] = 2.0**20
    with pytest.raises(PrecisionError, match=r"0.weight holds 1.05e\+06, beyond fp16"):
        match_precision(model, torch.float16)
