"""Exact parameter counts of the supported transformer families, from the model shape alone.

Counts follow the module structure of the reference implementations (GPT-2: fused QKV with
biases, LayerNorm with bias, 4h GELU MLP, learned positions, tied head; Llama/Mixtral: separate
q/k/v/o without bias, RMSNorm, SwiGLU MLP, RoPE; Mixtral adds a router per MoE layer), as in
Narayanan et al. 2021, eq. 2 (12·l·h² + the embedding terms) extended to GQA and gated MLPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsforge.compiler.model.resolved import ResolvedModel, resolve_model


def has_bias(model: ResolvedModel) -> bool:
    """GPT-2-style models carry biases on every linear layer and norm; Llama-style ones carry none."""
    return model.arch in {"gpt2",
                          "gpt_neox"} or (model.arch in {"custom", "auto"} and model.activation == "gelu")


#: Families with extra per-layer weights beside Llama's: per-head q/k norms (Qwen3, Gemma3), q/k norms over
#: the whole projection (OLMo2), four norms per layer (Gemma). Biases on q, k and v follow model.qkv_bias.
_HEAD_QK_NORMS = frozenset({"qwen3", "qwen3_moe", "gemma3"})
_FOUR_NORMS = frozenset({"gemma2", "gemma3"})


def shared_gate(model: ResolvedModel) -> bool:
    """Qwen2-MoE scales its shared expert by a sigmoid gate (hidden -> 1); DeepSeek's shared experts have
    none."""
    return model.arch == "qwen2_moe"


def shared_expert_params(model: ResolvedModel) -> int:
    """The shared experts of one MoE layer: dense MLPs every token passes through, plus their gate."""
    moe = model.moe
    if moe is None or not moe.shared_experts:
        return 0
    return moe.shared_experts * mlp_params(model, moe.shared_ffn_hidden) + (
        model.hidden if shared_gate(model) else 0
    )


def padded_vocab(model: ResolvedModel, tp: int) -> int:
    """The vocabulary after padding to a multiple of vocab_multiple_of x tp (no padding if unset)."""
    if not model.vocab_multiple_of:
        return model.vocab
    step = model.vocab_multiple_of * tp
    return -(-model.vocab // step) * step


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one transformer layer, by part."""

    attention: int
    mlp: int
    norms: int
    router: int = 0

    @property
    def total(self) -> int:
        """All parameters of the layer."""
        return self.attention + self.mlp + self.norms + self.router


def mlp_params(model: ResolvedModel, ffn: int) -> int:
    """One MLP (or one expert): 2 matrices for GELU, 3 for SwiGLU, plus biases where the arch has them."""
    h = model.hidden
    mats = 3 if model.activation == "swiglu" else 2
    bias = (ffn + h) if has_bias(model) else 0
    return mats * h * ffn + bias


def is_moe_layer(model: ResolvedModel, index: int) -> bool:
    """True if layer ``index`` (0-based) is a mixture-of-experts layer."""
    return model.moe is not None and (index + 1) % model.moe.every == 0


def moe_layers_in(model: ResolvedModel, first: int, count: int) -> int:
    """How many of layers [first, first + count) are MoE layers: the multiples of ``every`` among their
    1-based indices first + 1 .. first + count (what counting `is_moe_layer` over the range gives)."""
    return moe_count(model.moe.every if model.moe is not None else 0, first, count)


def moe_count(every: int, first: int, count: int) -> int:
    """`moe_layers_in` for MoE layers every ``every`` layers (0: a dense model)."""
    if every <= 0 or count <= 0:
        return 0
    return (first + count) // every - first // every


def kv_heads_per_rank(model: ResolvedModel, tp: int) -> float:
    """KV heads a tp rank holds: kv_heads / tp, or one replicated head when tp exceeds kv_heads."""
    kv = model.kv_heads
    return kv / tp if kv >= tp else 1.0


def layer_params(model: ResolvedModel, moe: bool = False) -> LayerParams:
    """Parameters of one layer (dense, or MoE with all of its experts)."""
    model = resolve_model(model)  # a job's ModelSpec leaves head_dim and qkv_bias unset: their defaults apply
    h, kv = model.hidden, model.kv_heads
    head_dim = model.head_dim
    q_dim, kv_dim = model.heads * head_dim, kv * head_dim
    bias = has_bias(model)
    # Q is h x q_dim and O q_dim x h: with head_dim != hidden / heads (Qwen3, Gemma) they are not square
    attention = 2 * h * q_dim + 2 * h * kv_dim + ((q_dim + 2 * kv_dim + h) if bias else 0)
    attention += (q_dim + 2 * kv_dim) if model.qkv_bias and not bias else 0
    norms = (4 if model.arch in _FOUR_NORMS else 2) * (2 * h if bias else h)
    norms += (
        2 * head_dim if model.arch in _HEAD_QK_NORMS else (q_dim + kv_dim) if model.arch == "olmo2" else 0
    )
    if moe and model.moe is not None:
        return LayerParams(attention, model.moe.experts * mlp_params(model, model.moe.ffn_hidden)
                           + shared_expert_params(model), norms, h * model.moe.experts)
    return LayerParams(attention, mlp_params(model, model.ffn_hidden), norms)


def embedding_params(model: ResolvedModel, tp: int = 1) -> int:
    """Input embedding (padded vocabulary) plus a learned position table where the arch has one."""
    pos = model.seq_len * model.hidden if model.position == "learned" else 0
    return padded_vocab(model, tp) * model.hidden + pos


def head_params(model: ResolvedModel, tp: int = 1) -> int:
    """Final norm plus the LM head (zero extra weights when tied to the embedding)."""
    norm = 2 * model.hidden if has_bias(model) else model.hidden
    return norm + (0 if model.tied_embeddings else padded_vocab(model, tp) * model.hidden)


def total_params(model: ResolvedModel, tp: int = 1) -> int:
    """All parameters of the model (every expert counted)."""
    model = resolve_model(model)
    layers = sum(layer_params(model, is_moe_layer(model, i)).total for i in range(model.layers))
    return embedding_params(model, tp) + layers + head_params(model, tp)
