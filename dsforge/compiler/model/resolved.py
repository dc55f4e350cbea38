"""The model with every default filled: what the estimates, rules and runtime read instead of the job's
ModelSpec.

The job file may leave ``kv_heads``, ``ffn_hidden``, ``activation``, ``position`` and
``moe.ffn_hidden`` unset, so ModelSpec types them Optional; they follow from other keys. They are
derived here, once (``resolve_model``), into frozen dataclasses whose fields are never None where
the model always has a value, so no reader re-derives a default. Being frozen and hashable, a
ResolvedModel can key caches of per-layer counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dsforge.compiler.spec.schema import ModelSpec, MoESpec

Arch = Literal["gpt2", "llama", "mixtral", "qwen3", "gemma2", "gemma3", "olmo2", "phi3", "gpt_neox",
               "qwen2_moe", "qwen3_moe", "deepseek_v3", "custom", "auto"]
Activation = Literal["gelu", "swiglu"]
Position = Literal["learned", "rope"]

#: Architectures with a gated (SwiGLU) MLP and rotary positions; every other arch defaults to GELU and
#: learned.
_GATED_ARCHS = frozenset({"llama", "mixtral", "qwen3", "gemma2", "gemma3", "olmo2", "phi3", "qwen2_moe",
                          "qwen3_moe", "deepseek_v3"})
#: GPT-NeoX: a GELU MLP with rotary positions.
_ROPE_ARCHS = _GATED_ARCHS | {"gpt_neox"}
#: Archs whose q, k and v projections carry biases by default (GPT-2 and GPT-NeoX bias their fused QKV).
_QKV_BIAS_ARCHS = frozenset({"gpt2", "gpt_neox", "qwen2_moe"})


@dataclass(frozen=True)
class ResolvedMoE:
    """Mixture-of-experts layers with the expert width known (``model.moe`` of the job, defaults filled)."""

    experts: int
    top_k: int
    ffn_hidden: int
    every: int
    capacity_factor: float
    drop_tokens: bool = False
    shared_experts: int = 0
    shared_ffn_hidden: int = 0  # one shared expert's width (moe.ffn_hidden unless set)


@dataclass(frozen=True)
class ResolvedModel:
    """The transformer of the job with every derived value filled (``model`` of the job, defaults applied).

    The field names are ModelSpec's, so code written against the job's model section reads the same.
    """

    arch: Arch
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int  # one head's width: hidden / heads unless the job (or config.json) says otherwise
    ffn_hidden: int
    vocab: int
    seq_len: int
    tied_embeddings: bool
    qkv_bias: bool  # biases on q, k and v (beside those of an arch that biases every linear layer)
    activation: Activation
    position: Position
    vocab_multiple_of: int | None  # None: the vocabulary is not padded
    moe: ResolvedMoE | None  # None: a dense model
    factory: str | None  # None: the HF model of the arch is built
    preset: str | None  # the preset the keys came from, if any (informational)
    pretrained: str | None = None  # an HF model directory: config.json builds the model, its weights fill it


def _resolve_moe(moe: MoESpec, ffn_hidden: int) -> ResolvedMoE:
    expert_ffn = moe.ffn_hidden if moe.ffn_hidden is not None else ffn_hidden
    return ResolvedMoE(moe.experts, moe.top_k, expert_ffn, moe.every, moe.capacity_factor, moe.drop_tokens,
                       moe.shared_experts,
                       moe.shared_ffn_hidden if moe.shared_ffn_hidden is not None else expert_ffn)


def resolve_model(model: ModelSpec | ResolvedModel) -> ResolvedModel:
    """The model with its defaults filled: kv_heads = heads, head_dim = hidden / heads, qkv_bias by arch,
    ffn_hidden = 4 x hidden, moe.ffn_hidden =
    ffn_hidden, and for llama/mixtral a SwiGLU MLP with RoPE, for every other arch GELU with learned
    positions. A ResolvedModel is returned as it is."""
    if isinstance(model, ResolvedModel):
        return model
    gated = model.arch in _GATED_ARCHS
    ffn = model.ffn_hidden if model.ffn_hidden is not None else 4 * model.hidden
    activation: Activation = (
        model.activation if model.activation is not None else ("swiglu" if gated else "gelu")
    )
    position: Position = model.position if model.position is not None else (
        "rope" if model.arch in _ROPE_ARCHS else "learned")
    return ResolvedModel(
        arch=model.arch, layers=model.layers, hidden=model.hidden, heads=model.heads,
        kv_heads=model.kv_heads if model.kv_heads is not None else model.heads,
        head_dim=model.head_dim if model.head_dim is not None else model.hidden // model.heads,
        ffn_hidden=ffn, vocab=model.vocab, seq_len=model.seq_len, tied_embeddings=model.tied_embeddings,
        qkv_bias=model.qkv_bias if model.qkv_bias is not None else model.arch in _QKV_BIAS_ARCHS,
        activation=activation, position=position,
        vocab_multiple_of=model.vocab_multiple_of,
        moe=_resolve_moe(model.moe, ffn) if model.moe is not None else None, factory=model.factory,
        preset=model.preset, pretrained=model.pretrained)
