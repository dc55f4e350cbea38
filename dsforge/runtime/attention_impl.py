"""The attention implementation dsforge builds an HF model with."""

from __future__ import annotations

from typing import Any


def attention_of(cfg: Any) -> str:
    """sdpa, or eager for a causal LM whose class does not take sdpa (Gemma 2: its soft-capped scores); both
    are the same mathematics."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(cfg), None)
    return "eager" if cls is not None and getattr(cls, "_supports_sdpa", True) is False else "sdpa"
