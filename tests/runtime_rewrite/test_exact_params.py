"""The meta-device model's exact parameter count against dsforge.compiler.model.params for every model preset.

The two sides are independent: params.py counts from the shape formulas, the rewrite plan counts
the tensors of the HF module tree built on the meta device (so a 405B model costs no memory).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from dsforge.compiler.frontend.presets import presets
from dsforge.compiler.model.params import total_params
from dsforge.runtime.models import build_model
from dsforge.runtime.rewrite import describe, plan_rewrite

MODELS = sorted(presets("models"))


@pytest.mark.slow  # over ~3 s: the fast tier stays near a minute
def test_every_model_preset_counts_exactly_what_params_py_says(job):
    for name in MODELS:
        spec, plan = job({"preset": name})
        model = build_model(spec.model, "meta")
        rp = plan_rewrite(model, plan)
        meta = sum(p.numel() for p in model.parameters())
        assert (name, rp.total_params, meta) == (name, total_params(spec.model),
                                                 meta == rp.total_params and meta)


def test_padded_vocabulary_is_built_and_counted(job):
    spec, plan = job({"preset": "gpt2-small", "vocab_multiple_of": 128}, {"tp": 2})
    out = describe(spec, plan)
    assert out["ok"] and out["params"]["total"] == out["params"]["formula_total"] == total_params(
        spec.model, 2
    )
    assert out["modules"][0]["params"]["weight"] == {"shape": [50432, 768], "shard": [25216, 768], "dim": 0}
