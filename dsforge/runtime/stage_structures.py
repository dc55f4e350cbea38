"""Where each hand-written family keeps its pipeline pieces, and which models take their stages from their own
HF pp plan instead (its own module so the rewrite planner can ask without importing the stage builder)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Structure:
    """Where a family keeps its pipeline pieces, relative to the causal-LM root."""

    embed: str
    layers: str
    norm: str
    head: str
    pos: str | None = None
    drop: str | None = None
    rotary: str | None = None


STRUCTURES: dict[str, Structure] = {
    "gpt2": Structure("transformer.wte", "transformer.h", "transformer.ln_f", "lm_head",
                      pos="transformer.wpe", drop="transformer.drop"),
    "llama": Structure("model.embed_tokens", "model.layers", "model.norm", "lm_head",
                       rotary="model.rotary_emb"),
    "mixtral": Structure("model.embed_tokens", "model.layers", "model.norm", "lm_head",
                         rotary="model.rotary_emb"),
}


def derived_pipeline(arch: str, model: nn.Module) -> bool:
    """True for an HF model (it has a config.model_type) whose family has no hand-written stage structure."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return arch not in STRUCTURES and isinstance(model_type, str)
