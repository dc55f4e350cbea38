"""The attention implementation dsforge builds a family with: sdpa where the class takes it, eager where it
does not (Gemma 2 refuses sdpa in from_config)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from dsforge.runtime.attention_impl import attention_of


@pytest.mark.parametrize(("model_type", "want"),
                         [("llama", "sdpa"), ("gemma3_text", "sdpa"), ("gemma2", "eager")])
def test_sdpa_unless_the_class_refuses_it(model_type: str, want: str) -> None:
    cfg = transformers.AutoConfig.for_model(model_type)
    assert attention_of(cfg) == want
    cls = transformers.AutoModelForCausalLM._model_mapping[type(cfg)]
    assert getattr(cls, "_supports_sdpa", True) is (want == "sdpa")
