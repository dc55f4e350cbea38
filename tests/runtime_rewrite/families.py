"""Tiny HF models of every family dsforge has a rewrite policy for, built from transformers configs (random
weights).

Each factory takes the job's resolved model (``model.factory: tests.runtime_rewrite.families:<arch>``)
so the job's widths are the model's; ``FAMILY_JOBS`` gives the model keys of one tiny job per family
(2 layers, hidden 64, 4 query and 2 key/value heads of 16 channels). Attention runs eager where the
family's forward has something SDPA cannot express (Gemma's soft-capping), SDPA elsewhere.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dsforge.compiler.model.resolved import ResolvedModel

BASE: dict[str, Any] = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 96, "vocab": 128,
                        "seq_len": 16}
MOE = {"experts": 4, "top_k": 2, "ffn_hidden": 32}


def _common(m: ResolvedModel, **extra: Any) -> dict[str, Any]:
    return {"hidden_size": m.hidden, "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
            "num_key_value_heads": m.kv_heads, "intermediate_size": m.ffn_hidden, "vocab_size": m.vocab,
            "max_position_embeddings": m.seq_len, "tie_word_embeddings": m.tied_embeddings,
            "use_cache": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            "attention_dropout": 0.0, **extra}


def _build(config: Any, attn: str = "sdpa") -> nn.Module:
    from transformers import AutoModelForCausalLM

    config._attn_implementation = attn
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).float()


def _moe(m: ResolvedModel) -> Any:
    assert m.moe is not None, "an MoE family needs the job's moe: section"
    return m.moe


def qwen3(m: ResolvedModel) -> nn.Module:
    """Qwen3: Llama with per-head q/k RMSNorms."""
    from transformers import Qwen3Config
    return _build(Qwen3Config(**_common(m, head_dim=m.hidden // m.heads)))


def gemma2(m: ResolvedModel) -> nn.Module:
    """Gemma2: scaled embedding, four norms per layer, attention and final-logit soft-capping (eager
    attention)."""
    from transformers import Gemma2Config
    return _build(Gemma2Config(**_common(m, head_dim=m.hidden // m.heads,
                                         query_pre_attn_scalar=m.hidden // m.heads, sliding_window=8,
                                         final_logit_softcapping=3.0, attn_logit_softcapping=5.0)), "eager")


def gemma2_plain_attention(m: ResolvedModel) -> nn.Module:
    """Gemma2 whose attention is plain causal at the job's length: no score soft-capping, a window covering
    seq_len."""
    from transformers import Gemma2Config
    return _build(Gemma2Config(**_common(m, head_dim=m.hidden // m.heads,
                                         query_pre_attn_scalar=m.hidden // m.heads, sliding_window=m.seq_len,
                                         final_logit_softcapping=3.0, attn_logit_softcapping=None)), "eager")


def gemma2_wide_heads(m: ResolvedModel) -> nn.Module:
    """Gemma2 with heads wider than hidden / heads (as Gemma2-2B: 8 heads of 256 channels on hidden 2304)."""
    from transformers import Gemma2Config
    return _build(Gemma2Config(**_common(m, head_dim=2 * m.hidden // m.heads, query_pre_attn_scalar=32)),
                  "eager")


def gemma3(m: ResolvedModel) -> nn.Module:
    """Gemma3 (text): Gemma2's layout plus per-head q/k norms."""
    from transformers import Gemma3TextConfig
    return _build(Gemma3TextConfig(**_common(m, head_dim=m.hidden // m.heads,
                                             query_pre_attn_scalar=m.hidden // m.heads,
                                             sliding_window=8)), "eager")


def olmo2(m: ResolvedModel) -> nn.Module:
    """OLMo2: q/k RMSNorms over the whole projection, norms after attention and MLP."""
    from transformers import Olmo2Config
    return _build(Olmo2Config(**_common(m)))


def phi3(m: ResolvedModel) -> nn.Module:
    """Phi3: fused qkv_proj of unequal blocks under GQA, fused gate_up_proj."""
    from transformers import Phi3Config
    return _build(Phi3Config(**_common(m), resid_pdrop=0.0, embd_pdrop=0.0))


def gpt_neox(m: ResolvedModel) -> nn.Module:
    """GPT-NeoX: per-head [q k v] fused projection, parallel residual, partial rotary, biases everywhere."""
    from transformers import GPTNeoXConfig
    cfg = _common(m)
    cfg.pop("num_key_value_heads")
    return _build(GPTNeoXConfig(**cfg, hidden_dropout=0.0, rotary_pct=0.5))


def mistral(m: ResolvedModel) -> nn.Module:
    """Mistral: Llama's layout with sliding-window attention (rewritten by the llama policy)."""
    from transformers import MistralConfig
    return _build(MistralConfig(**_common(m, head_dim=m.hidden // m.heads), sliding_window=8))


def qwen2(m: ResolvedModel) -> nn.Module:
    """Qwen2: Llama's layout with q/k/v biases (rewritten by the llama policy)."""
    from transformers import Qwen2Config
    return _build(Qwen2Config(**_common(m)))


def qwen2_moe(m: ResolvedModel) -> nn.Module:
    """Qwen2-MoE: routed experts (no renormalisation), a shared expert and its sigmoid gate, q/k/v biases."""
    from transformers import Qwen2MoeConfig
    moe = _moe(m)
    return _build(Qwen2MoeConfig(**_common(m), num_experts=moe.experts, num_experts_per_tok=moe.top_k,
                                 moe_intermediate_size=moe.ffn_hidden,
                                 shared_expert_intermediate_size=moe.shared_ffn_hidden,
                                 decoder_sparse_step=moe.every, norm_topk_prob=False,
                                 output_router_logits=False))


def qwen3_moe(m: ResolvedModel) -> nn.Module:
    """Qwen3-MoE: per-head q/k norms and routed experts, renormalised over the top-k."""
    from transformers import Qwen3MoeConfig
    moe = _moe(m)
    return _build(Qwen3MoeConfig(**_common(m, head_dim=m.hidden // m.heads), num_experts=moe.experts,
                                 num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.ffn_hidden,
                                 decoder_sparse_step=moe.every, norm_topk_prob=True,
                                 output_router_logits=False))


def mixtral(m: ResolvedModel) -> nn.Module:
    """Mixtral through the factory path (the HF builder dsforge has gives the same model)."""
    from transformers import MixtralConfig
    moe = _moe(m)
    return _build(MixtralConfig(**_common(m, head_dim=m.hidden // m.heads, intermediate_size=moe.ffn_hidden),
                                num_local_experts=moe.experts,
                                num_experts_per_tok=moe.top_k, output_router_logits=False))


def deepseek_v3(m: ResolvedModel) -> nn.Module:
    """DeepSeek-V3: MLA attention (low-rank q and kv, a rotary key shared by the heads), sigmoid-routed
    experts."""
    from transformers import DeepseekV3Config
    moe = _moe(m)
    cfg = _common(m)
    return _build(DeepseekV3Config(**cfg, moe_intermediate_size=moe.ffn_hidden, n_routed_experts=moe.experts,
                                   num_experts_per_tok=moe.top_k, n_shared_experts=moe.shared_experts,
                                   first_k_dense_replace=0, q_lora_rank=32, kv_lora_rank=16,
                                   qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
                                   topk_group=1))


def _job(arch: str, **extra: Any) -> dict[str, Any]:
    return {"arch": arch, "factory": f"tests.runtime_rewrite.families:{arch}", **BASE, **extra}


#: The model keys of one tiny job per family (the llama policy's Mistral and Qwen2 under arch llama).
FAMILY_JOBS: dict[str, dict[str, Any]] = {
    "qwen3": _job("qwen3"),
    "gemma2": _job("gemma2", tied_embeddings=True),
    "gemma3": _job("gemma3", tied_embeddings=True),
    "olmo2": _job("olmo2"),
    "phi3": _job("phi3"),
    "gpt_neox": {**_job("gpt_neox"), "kv_heads": 4},
    "mistral": {**_job("llama"), "factory": "tests.runtime_rewrite.families:mistral"},
    "qwen2": {**_job("llama"), "factory": "tests.runtime_rewrite.families:qwen2"},
    "qwen2_moe": _job("qwen2_moe", moe={**MOE, "shared_experts": 1, "shared_ffn_hidden": 48}),
    "qwen3_moe": _job("qwen3_moe", moe={**MOE, "experts": 8, "top_k": 8}),
    "mixtral": _job("mixtral", moe=MOE),
    "deepseek_v3": {**_job("deepseek_v3", moe={**MOE, "shared_experts": 1}), "kv_heads": 4},
}
