"""Parameter counts of an HF causal LM from its config.json alone (no torch): what `num_parameters()` gives.

The count follows the module structure most decoder-only families in transformers share: an input
embedding, per layer a token mixer, an MLP (gated, three matrices, unless the family is one of the
two-matrix ones) or a MoE block (router, experts, shared experts, dense layers by ``mlp_layer_types`` /
``first_k_dense_replace`` / ``mlp_only_layers`` / ``decoder_sparse_step``), the norms, and a final norm and
an untied head. The mixer is each layer's own kind (``layer_types``): softmax attention (q/k/v/o, biases,
MLA's low-rank projections, gates, sinks, q/k norms, and what a kind adds such as a sparse-attention
indexer) or the type's linear-attention, Mamba, convolution or compressed mixer (``hf_mixers``). What a
family adds to every layer or once (hyper-connections, residual scales, encoders) is counted beside it.
Each feature the count cannot state from config.json is named in ``HfCount.unpriced`` so explain can say
the figure is approximate; ``benchmarks/hf_param_counts.py`` measures the difference against HF's
``num_parameters()`` over the zoo's tiny configs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dsforge.compiler.model.hf_encoders import phi4_encoders
from dsforge.compiler.model.hf_mixers import (
    ATTENTION_EXTRAS,
    MIXERS,
    dsv4_hyper_connections,
    hyper_connection_head,
    hyper_connections,
    inkling2_layer_extras,
    loop_message_queries,
    nemotron_h_moe,
    zaya_moe,
)
from dsforge.compiler.model.hf_mixers import cfg_int as _int
from dsforge.compiler.model.hf_qwen4_exp import gated_residual, ple_layer, qsa_indexer

#: Families whose MLP has two matrices (up, down) rather than three (gate, up, down).
_TWO_MATRIX_MLP = frozenset({"gpt2", "gpt_neox", "gpt_bigcode", "starcoder2", "phi", "gptj", "codegen",
                             "falcon", "bloom", "opt", "biogpt", "xglm", "gpt_neo", "persimmon",
                             "stablelm_epoch", "nemotron", "nemotron_h", "jais2", "apertus",
                             "apertus1p5_text", "arcee", "nanochat"})
#: Families that bias every linear layer of attention and MLP (GPT-2 style), whatever attention_bias says.
_LINEAR_BIAS = frozenset({"gpt2", "gpt_neox", "gpt_bigcode", "starcoder2", "phi", "falcon", "bloom", "opt",
                          "biogpt", "xglm", "gpt_neo", "persimmon", "stablelm"})
#: Families with LayerNorm (weight and bias) rather than RMSNorm (weight only).
_LAYERNORM_BIAS = _LINEAR_BIAS | {"gptj", "codegen", "nemotron", "phimoe", "jais2"}
#: Families with no norm parameters (OLMo's LayerNorm without weight or bias).
_NO_NORM_PARAMS = frozenset({"olmo", "nanochat", "hrm_text", "dory", "qwen4_exp_text"})
#: Families with one norm per layer (attention and MLP in parallel on the same normed input).
_ONE_NORM = frozenset({"cohere", "cohere2", "cohere2_moe", "phi", "gptj", "codegen"})
#: What each (type, layer kind) adds to softmax attention (hf_mixers', and Qwen4-exp's QSA indexer).
_ATTENTION_EXTRAS = {**ATTENTION_EXTRAS, ("qwen4_exp_text", "full_attention"): qsa_indexer,
                     ("qwen4_exp_text", "indexed_attention"): qsa_indexer}
#: Types whose config class derives layer_types from full_attention_interval (every n-th layer softmax
#: attention, of this kind; the others linear attention) when config.json has none.
_INTERVAL_KINDS = {"qwen3_next": "full_attention", "qwen3_5_text": "full_attention",
                   "qwen3_5_moe_text": "full_attention", "qwen4_exp_text": "indexed_attention"}
#: Nemotron-H's hybrid_override_pattern characters (older config.json files).
_NEMOTRON_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
#: Families whose config has no tie_word_embeddings and whose head is its own matrix.
_UNTIED_WITHOUT_KEY = frozenset({"inkling_text", "inkling2_text", "inkling2_loop_text"})
#: Families whose LM head has a bias.
_HEAD_BIAS = frozenset({"phi", "gptj", "codegen"})
#: Families that bias q, k and v but not o_proj when attention_bias is set.
_QKV_ONLY_BIAS = frozenset({"glm", "glm4", "seed_oss"})
#: Families with q and k norms over the whole projection (q_dim and kv_dim wide).
_FULL_QK_NORMS = frozenset({"olmo2", "olmo3", "olmoe", "flex_olmo", "minimax_m2", "olmo_hybrid"})
#: Families with four norms per layer (pre and post attention, pre and post MLP).
_FOUR_NORMS = frozenset({"gemma2", "gemma3", "gemma3_text", "glm4", "hyperclovax", "kolibri1", "beam",
                         "afmoe"})
#: Families with per-head q and k norms (head_dim wide).
_HEAD_QK_NORMS = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text", "exaone4", "hunyuan_v1_dense",
                            "hy_v3", "mellum", "exaone_moe", "axk1", "hunyuan_v1_moe", "kolibri1", "flint",
                            "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "lara_mini", "apertus",
                            "apertus1p5_text", "beam", "afmoe", "minimax_m3_vl_text", "lfm2", "lfm3",
                            "laguna", "doge", "qwen4_exp_text"})
#: Families whose q_proj also projects a per-channel output gate (twice the query width).
_GATED_Q = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen4_exp_text"})
#: Families with an attention output gate of its own (gate_proj, hidden to heads x head_dim).
_ATTN_GATE_PROJ = frozenset({"beam", "afmoe", "hrm_text"})
#: Families whose shared expert is scaled by a learnt sigmoid gate (one hidden-wide row).
_SHARED_EXPERT_GATE = frozenset({"qwen2_moe", "qwen3_next", "qwen3_5_moe_text", "qwen4_exp_text"})
#: Families whose use_qk_norm is an L2 norm without weights (Llama 4).
_WEIGHTLESS_QK_NORM = frozenset({"llama4", "llama4_text"})
#: Families with one learnt attention sink per head and layer.
_SINKS = frozenset({"granite_swa", "granitemoe_swa", "flint", "gpt_oss"})
#: layer_types entries that are softmax attention (a chunk or window covering the sequence is full attention).
_SOFTMAX_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")
_MOE_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_MOE_FFN = ("moe_intermediate_size", "expert_intermediate_size")


#: Types whose count equals HF's num_parameters() on the zoo's tiny configs (benchmarks/hf_param_counts.py;
#: tests/compiler/model/test_hf_params.py checks the set both ways).
EXACT_TYPES = frozenset({"afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "axk2", "bamba",
                         "bailing_hybrid", "beam", "codegen", "cohere", "cohere2", "cohere2_moe", "cwm",
                         "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "diffllama", "doge",
                         "dory", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "falcon_h1",
                         "flex_olmo", "flint", "gemma", "gemma2", "gemma3_text", "glm", "glm4", "glm4_moe",
                         "glm4_moe_lite", "glm_moe_dsa", "gpt_neox", "gpt_oss", "gptj", "granite",
                         "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
                         "granitemoeshared", "helium", "hrm_text", "hunyuan_v1_dense", "hunyuan_v1_moe",
                         "hy_v3", "hy_v4", "hyperclovax", "inkling2_loop_text", "inkling2_text",
                         "inkling_text", "internlm3", "iquestcoder", "jais2", "jamba", "kimi_linear",
                         "kolibri1", "laguna", "lara_mini", "lfm2", "lfm3", "llama", "llama4", "llama4_text",
                         "longcat_flash", "mellum", "mimo_v2_flash", "minicpm3", "minimax", "minimax_m2",
                         "minimax_m3_vl_text", "ministral", "ministral3", "mistral", "mixtral", "nanochat",
                         "nemotron", "nemotron_h", "olmo", "olmo2", "olmo3", "olmo_hybrid", "olmoe", "phi",
                         "phi3", "phi4_multimodal", "phimoe", "qwen2", "qwen2_moe", "qwen3",
                         "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen4_exp_text",
                         "sarvam_mla", "sarvam_moe", "seed_oss", "smollm3", "solar_open", "starcoder2",
                         "vaultgemma", "youtu", "zaya"})


@dataclass(frozen=True)
class HfCount:
    """Parameters of an HF model by part, and the config features the count does not price."""

    model_type: str
    embedding: int
    layers: int
    head: int
    unpriced: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        """True for a type whose count was matched to HF's and a config without an unpriced feature."""
        return self.model_type in EXACT_TYPES and not self.unpriced

    @property
    def total(self) -> int:
        """All parameters, a tied head counted once (as `num_parameters()` does)."""
        return self.embedding + self.layers + self.head


def _mla(cfg: dict[str, Any], mtype: str, hidden: int, heads: int, rank: int) -> int:
    """MLA (DeepSeek-V2/V3): q through a rank-q_lora_rank bottleneck (or straight from the hidden state), k/v
    through one of kv_lora_rank (``rank``) with the shared rope key, and o_proj."""
    rope, nope = _int(cfg, "qk_rope_head_dim"), _int(cfg, "qk_nope_head_dim")
    v_dim, q_rank = _int(cfg, "v_head_dim"), _int(cfg, "q_lora_rank")
    # LongCat's q_b_proj is qk_head_dim wide per head, a key of its own (nope + rope unless set)
    q_head = (_int(cfg, "qk_head_dim") if mtype == "longcat_flash" else 0) or rope + nope
    q = (hidden * q_rank + q_rank + q_rank * heads * q_head) if q_rank else hidden * heads * q_head
    if mtype == "axk2":  # q_gate_proj from [q residual, q latent] to q and a gate over v, not q_b_proj
        q = hidden * q_rank + q_rank + 2 * q_rank * heads * (q_head + v_dim)
    kv_part = hidden * (rank + rope) + rank + rank * heads * (nope + v_dim)
    return q + kv_part + heads * v_dim * hidden


def _attention(cfg: dict[str, Any], mtype: str, hidden: int) -> int:
    """One layer's softmax attention: q/k/v/o with the family's biases, gates, sinks, q/k norms (or MLA)."""
    heads = _int(cfg, "num_attention_heads", "n_head", default=1)
    kv = _int(cfg, "num_key_value_heads", "num_kv_heads", default=heads) or heads
    if cfg.get("multi_query"):
        kv = 1
    rank = _int(cfg, "kv_lora_rank")
    bias = bool(cfg.get("attention_bias")) or bool(cfg.get("use_bias")) or mtype in _LINEAR_BIAS
    if rank:
        return _mla(cfg, mtype, hidden, heads, rank) + (hidden if bias else 0)
    head_dim = _int(cfg, "head_dim") or hidden // heads
    q_dim, kv_dim = heads * head_dim, kv * head_dim
    weights = 2 * hidden * q_dim + 2 * hidden * kv_dim + (hidden * q_dim if mtype in _GATED_Q else 0)
    if bias:
        weights += q_dim + 2 * kv_dim + (0 if mtype in _QKV_ONLY_BIAS else hidden)
    elif mtype in ("qwen2", "qwen2_moe") and cfg.get("qkv_bias", True):
        weights += q_dim + 2 * kv_dim
    if mtype in _SINKS:
        weights += heads
    if mtype in _ATTN_GATE_PROJ:  # an output gate (Beam's with a per-head bias, HRM's by attention_bias)
        gate_bias = heads if mtype == "beam" else q_dim if bias and mtype == "hrm_text" else 0
        weights += hidden * q_dim + gate_bias
    if mtype == "diffllama":  # differential attention's lambda_q1, lambda_k1, lambda_q2, lambda_k2
        weights += 4 * head_dim
    if mtype in _FULL_QK_NORMS:
        weights += q_dim + kv_dim
    elif (
        mtype in _HEAD_QK_NORMS
        or (cfg.get("use_qk_norm") and mtype not in _WEIGHTLESS_QK_NORM)
        or cfg.get("qk_layernorm")
    ):
        weights += 2 * head_dim
    return weights


def _mlp(cfg: dict[str, Any], mtype: str, hidden: int, ffn: int) -> int:
    mats = 2 if mtype in _TWO_MATRIX_MLP else 3
    linear_bias = mtype in _LINEAR_BIAS or mtype in ("gptj", "codegen")
    bias = ((mats - 1) * ffn + hidden) if (linear_bias or cfg.get("mlp_bias") or cfg.get("use_bias")) else 0
    return mats * hidden * ffn + bias


def _dense_layer(cfg: dict[str, Any], index: int, layers: int) -> bool:
    """Whether layer ``index`` of a MoE model is a dense MLP (first_k_dense_replace, mlp_only_layers, sparse
    step, ERNIE's moe_layer_start/end_index); mlp_layer_types, where config.json has it, says it alone."""
    types = cfg.get("mlp_layer_types")
    if isinstance(types, list) and len(types) == layers:
        return types[index] in ("dense", "mlp")  # the others: "sparse", DeepSeek-V4's "moe" and "hash_moe"
    if index < _int(cfg, "first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"):
        return True
    end = cfg.get("moe_layer_end_index")
    if isinstance(end, int) and 0 <= end < index:
        return True
    only = cfg.get("mlp_only_layers") or []
    if isinstance(only, list) and index in only:
        return True
    period = cfg.get("expert_layer_period")
    if isinstance(period, int) and period > 0:  # Jamba: experts where index % period == offset
        return index % period != _int(cfg, "expert_layer_offset")
    step = _int(cfg, "decoder_sparse_step", "moe_layer_interval", default=1) or 1
    return (index + 1) % step != 0


def _layer_kinds(cfg: dict[str, Any], mtype: str, layers: int) -> list[str] | None:
    """Each layer's token-mixer kind: config.json's layer_types, else what the type's config class derives
    from older keys (full_attention_interval, Nemotron-H's hybrid_override_pattern, LFM2's full_attn_idxs);
    None where config.json says nothing and the class derives a pattern this count does not know."""
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    if isinstance(types, list) and len(types) == layers:
        return [str(t) for t in types]
    if mtype in _INTERVAL_KINDS:
        step = _int(cfg, "full_attention_interval", default=4) or 4
        return ["linear_attention" if (i + 1) % step else _INTERVAL_KINDS[mtype] for i in range(layers)]
    pattern = cfg.get("hybrid_override_pattern")
    if mtype == "nemotron_h" and isinstance(pattern, str):
        return [_NEMOTRON_PATTERN.get(c, c) for c in pattern]
    full = cfg.get("full_attn_idxs")
    if mtype == "lfm2" and isinstance(full, list):
        return ["full_attention" if i in full else "conv" for i in range(layers)]
    period = cfg.get("attn_layer_period")
    if mtype == "jamba" and isinstance(period, int) and period > 0:  # JambaConfig.layers_block_type
        return ["full_attention" if i % period == _int(cfg, "attn_layer_offset") else "mamba"
                for i in range(layers)]
    if mtype == "bamba":  # Mamba-2 except at attn_layer_indices (BambaConfig.layers_block_type)
        full = cfg.get("attn_layer_indices") or []
        return ["full_attention" if i in full else "linear_attention" for i in range(layers)]
    kinded = {t for t, kind in (*MIXERS, *_ATTENTION_EXTRAS) if kind != "full_attention"} - {"laguna"}
    return None if mtype in kinded else ["full_attention"] * layers


def _priced_kind(mtype: str, kind: str) -> bool:
    if mtype == "nemotron_h":
        return kind in ("linear_attention", "moe", "mlp")
    return (mtype, kind) in MIXERS or (mtype, kind) in _ATTENTION_EXTRAS


def _longcat_layer(cfg: dict[str, Any], hidden: int, norm: int) -> int:
    """A LongCat-Flash layer: two MLA blocks and two dense MLPs, each with its norm, beside one MoE whose
    router and gate_up stack also cover the zero_expert_num identity experts (down_proj does not)."""
    experts, zero = _int(cfg, "n_routed_experts"), _int(cfg, "zero_expert_num")
    expert_ffn = _int(cfg, "expert_ffn_hidden_size", "moe_intermediate_size")
    ffn = _int(cfg, "ffn_hidden_size", "intermediate_size")
    router = (experts + zero) * (hidden + (1 if cfg.get("router_bias") else 0))
    stacks = (2 * (experts + zero) + experts) * expert_ffn * hidden if experts else 0
    moe = router + stacks
    dense = 2 * (_attention(cfg, "longcat_flash", hidden) + _mlp(cfg, "longcat_flash", hidden, ffn))
    return dense + 4 * norm + moe


def _nemotron_h_block(cfg: dict[str, Any], hidden: int, kind: str) -> int:
    """One Nemotron-H layer's block; use_bias is the Mamba projections' alone (attention has no biases)."""
    plain = {**cfg, "use_bias": False, "attention_bias": False}
    if kind == "moe":
        return nemotron_h_moe(cfg, hidden)
    if kind == "mlp":
        return _mlp(plain, "nemotron_h", hidden, _int(cfg, "intermediate_size"))
    return _mixer(plain if kind == "full_attention" else cfg, "nemotron_h", hidden, kind)


def _layer_cfg(cfg: dict[str, Any], index: int) -> dict[str, Any]:
    """The config of layer ``index``: num_attention_heads_per_layer (Laguna) overrides num_attention_heads."""
    heads = cfg.get("num_attention_heads_per_layer")
    if isinstance(heads, list) and index < len(heads) and isinstance(heads[index], int):
        return {**cfg, "num_attention_heads": heads[index]}
    return cfg


def _mixer(cfg: dict[str, Any], mtype: str, hidden: int, kind: str, index: int = 0) -> int:
    """One layer's token mixer: the type's own for this kind of layer, else softmax attention with what the
    type adds to it."""
    mixer = MIXERS.get((mtype, kind))
    if mixer:
        return mixer(cfg, hidden)
    extra = _ATTENTION_EXTRAS.get((mtype, kind))
    return _attention(cfg, mtype, hidden) + (extra(cfg, hidden, index) if extra else 0)


def _moe_block(cfg: dict[str, Any], mtype: str, hidden: int, ffn: int) -> int:
    """One sparse layer's MoE block: router, routed experts, shared experts (and their gate)."""
    experts = _int(cfg, *_MOE_EXPERTS)
    moe_ffn = _int(cfg, *_MOE_FFN) or ffn
    shared = _int(cfg, "n_shared_experts", "num_shared_experts", "moe_num_shared_experts",
                  default=1 if mtype in ("llama4_text", "hunyuan_v1_moe") else 0)
    shared_ffn = (_int(cfg, "shared_expert_intermediate_size", "shared_intermediate_size")
                  or (moe_ffn * shared if shared else 0))
    if mtype == "deepseek_v4":  # one shared expert of moe_intermediate_size, whatever n_shared_experts says
        shared_ffn = moe_ffn
    block = experts * _mlp(cfg, mtype, hidden, moe_ffn) + hidden * experts
    if shared_ffn:
        block += _mlp(cfg, mtype, hidden, shared_ffn) + (hidden if mtype in _SHARED_EXPERT_GATE else 0)
    if mtype == "gpt_oss":  # biased experts (gate_up, down) and router
        block += experts * (2 * moe_ffn + hidden) + experts
    if mtype in ("ernie4_5_moe", "afmoe", "laguna"):
        block += experts  # the router's correction bias or afmoe's expert_bias (deepseek_v3's is a buffer)
    if mtype == "axk1":
        block += hidden  # post_mlp_layernorm on the MoE block's output
    if mtype == "inkling_text":
        block += shared * hidden + 1  # its router also scores the shared experts, and has a global scale
    return block


def _ffn_block(cfg: dict[str, Any], mtype: str, hidden: int, index: int, layers: int) -> int:
    """Layer ``index``'s feed-forward block: the MoE block on a sparse layer, else the dense MLP."""
    ffn = _int(cfg, "intermediate_size", "n_inner", "ffn_hidden_size") or 4 * hidden
    if mtype == "doge":
        return _doge_ffn(cfg, hidden, ffn)
    if mtype == "zaya":
        return zaya_moe(cfg, hidden, index)
    if _int(cfg, *_MOE_EXPERTS) > 1:
        if not _dense_layer(cfg, index, layers):
            gated_norm = _gated_norm_mlp(cfg, hidden) if mtype == "axk2" else 0
            return _moe_block(cfg, mtype, hidden, ffn) + gated_norm
        ffn = _int(cfg, "dense_intermediate_size", "prefix_dense_intermediate_size") or ffn
    if mtype == "granitemoehybrid":  # without experts, only the (gated) shared MLP
        return _mlp(cfg, mtype, hidden, _int(cfg, "shared_intermediate_size"))
    # xIELU's learnt alpha_p and alpha_n; Inkling's MLP has a global scale
    scalars = (2 if cfg.get("hidden_act") == "xielu" else 0) + (1 if mtype == "inkling_text" else 0)
    return _mlp(cfg, mtype, hidden, _adjusted_ffn(cfg, ffn)) + scalars


def _gated_norm_mlp(cfg: dict[str, Any], hidden: int) -> int:
    """The low-rank MLP (fc1, fc2 of gated_norm_rank) of A.X-K2's gated RMSNorm: on every input norm, and on
    the post-attention norm of sparse layers."""
    return 2 * hidden * _int(cfg, "gated_norm_rank")


def _doge_ffn(cfg: dict[str, Any], hidden: int, ffn: int) -> int:
    """Doge's MLP; with is_moe its cross-domain MoE adds a product-key router (2 x floor(sqrt(E)) keys) and
    one hidden-wide down and up embedding per expert."""
    block = _mlp(cfg, "doge", hidden, ffn)
    if cfg.get("is_moe"):
        experts = _int(cfg, "num_experts")
        block += hidden * 2 * math.isqrt(experts) + 2 * experts * hidden
    return block


def _adjusted_ffn(cfg: dict[str, Any], ffn: int) -> int:
    """LFM2's block_auto_adjust_ff_dim: two thirds of intermediate_size, scaled by block_ffn_dim_multiplier
    and rounded up to block_multiple_of."""
    if not cfg.get("block_auto_adjust_ff_dim"):
        return ffn
    ffn = int(2 * ffn / 3)
    multiplier = cfg.get("block_ffn_dim_multiplier")
    if isinstance(multiplier, (int, float)):
        step = _int(cfg, "block_multiple_of", default=256)
        ffn = step * ((int(multiplier * ffn) + step - 1) // step)
    return ffn


def _one_entry_per_layer(cfg: dict[str, Any]) -> dict[str, Any]:
    """Dory's config.json lists each layer as two blocks (its attention, then "mlp") and counts layers
    twice; HF builds one decoder layer per pair."""
    types = cfg.get("layer_types")
    if cfg.get("model_type") != "dory" or not isinstance(types, list) or "mlp" not in types:
        return cfg
    return {**cfg, "layer_types": types[::2], "num_hidden_layers": _int(cfg, "num_hidden_layers") // 2}


def _family_extras(cfg: dict[str, Any], mtype: str, hidden: int) -> tuple[int, int]:
    """Parameters a family adds to every layer and once to the model, beside its mixer, MLP and norms."""
    if mtype == "doge":  # input_residual and post_attention_residual
        return 2 * hidden, 0
    if mtype == "axk2":
        return _gated_norm_mlp(cfg, hidden), 0
    if mtype == "hy_v4":  # hyper-connections in every layer and before the head
        return hyper_connections(cfg, hidden), hyper_connection_head(cfg, hidden)
    if mtype == "deepseek_v4":
        return dsv4_hyper_connections(cfg, hidden), hyper_connection_head(cfg, hidden)
    if mtype == "qwen4_exp_text":  # gated residuals around mixer and MLP, and the final stream mixer
        return 2 * gated_residual(cfg, hidden), gated_residual(cfg, hidden, combine=False)
    if mtype == "inkling_text":  # short convolutions after attention and MLP; the embedding's norm
        return 2 * hidden * _int(cfg, "conv_kernel_size", default=4), hidden
    if mtype in ("inkling2_text", "inkling2_loop_text"):  # the embedding's norm, the final block residual
        return 0, 2 * hidden + (loop_message_queries(cfg, hidden) if mtype == "inkling2_loop_text" else 0)
    if mtype == "hrm_text":  # z_L_init
        return 0, hidden
    if mtype == "zaya":  # two residual scalings (scale and bias of both streams) per layer; the input's
        return 8 * hidden, 2 * hidden
    if mtype == "dory":  # nGPT's lambda_1, lambda_2 and the MLP's suv_gate, suv_up; the head's logit_scale
        return 2 * hidden + 2 * _int(cfg, "intermediate_size"), _int(cfg, "vocab_size")
    return 0, 0


def _layer_count(cfg: dict[str, Any], mtype: str) -> int:
    """How many decoder layers HF builds (HRM-text: two stacks of num_layers_per_stack)."""
    blocks = cfg.get("layers_block_type")
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers") or (
        len(blocks) if isinstance(blocks, list) else 0)
    if mtype == "hrm_text":  # two stacks (low and high cycle) of num_layers_per_stack layers
        return 2 * _int(cfg, "num_layers_per_stack", default=layers)
    return layers


def _all_layers(cfg: dict[str, Any], mtype: str, hidden: int, norm: int, kinds: list[str]) -> int:
    """Every decoder layer: its mixer, norms and what the family adds to each layer, and its MLP or MoE."""
    layers = len(kinds)
    if mtype == "nemotron_h":  # each layer is one norm and one block: Mamba-2, attention, MoE or MLP
        return sum(norm + _nemotron_h_block(cfg, hidden, kind) for kind in kinds)
    if mtype == "longcat_flash":
        return layers * _longcat_layer(cfg, hidden, norm)
    four = mtype in _FOUR_NORMS or bool(cfg.get("use_sandwich_norm"))
    norms = (4 if four else 1 if mtype in _ONE_NORM else 2) * norm + _family_extras(cfg, mtype, hidden)[0]
    total = sum(_mixer(_layer_cfg(cfg, i), mtype, hidden, kinds[i], i) + norms
                + _ffn_block(cfg, mtype, hidden, i, layers) for i in range(layers))
    if mtype in ("inkling2_text", "inkling2_loop_text"):
        total += sum(inkling2_layer_extras(cfg, hidden, kinds[i], i) for i in range(layers))
    if mtype == "qwen4_exp_text":
        total += sum(ple_layer(cfg, hidden, i) for i in range(layers))
    return total


def _head(cfg: dict[str, Any], mtype: str, hidden: int, norm: int) -> int:
    """The final norm and the LM head (its own matrix unless tied, Inkling-2's without the padding rows)."""
    vocab = _int(cfg, "vocab_size")
    tied = bool(cfg.get("tie_word_embeddings", mtype not in _UNTIED_WITHOUT_KEY))
    rows = _int(cfg, "unpadded_vocab_size") or vocab
    bias = mtype in _HEAD_BIAS or bool(cfg.get("lm_head_bias"))
    return norm + (0 if tied else rows * hidden) + (vocab if bias else 0)


def hf_param_count(cfg: dict[str, Any]) -> HfCount:
    """The parameter count of the causal LM config.json describes, with the features it could not price."""
    mtype = str(cfg.get("model_type"))
    cfg = _one_entry_per_layer(cfg)
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    unpriced: list[str] = []
    norm = 0 if mtype in _NO_NORM_PARAMS else 2 * hidden if mtype in _LAYERNORM_BIAS else hidden
    embedding = _int(cfg, "vocab_size") * hidden + _family_extras(cfg, mtype, hidden)[1]
    if mtype in ("gpt2", "gpt_bigcode", "opt", "gpt_neo", "biogpt"):
        embedding += _int(cfg, "n_positions", "max_position_embeddings") * hidden
    layers = _layer_count(cfg, mtype)
    kinds = _layer_kinds(cfg, mtype, layers)
    if kinds is None:
        unpriced.append(f"config.json has no layer_types: the {layers} layers of {mtype} are priced as full "
                        f"attention, and its config class derives another pattern")
        kinds = ["full_attention"] * layers
    other = sorted({k for k in kinds if k not in _SOFTMAX_LAYERS and not _priced_kind(mtype, k)})
    if other:
        unpriced.append(f"layer_types {other}: linear-attention / other layers priced as attention")
    if mtype == "phi4_multimodal":  # its vision and audio encoders are part of the causal LM
        encoders = phi4_encoders(cfg, hidden)
        embedding += encoders or 0
        if encoders is None:
            unpriced.append("phi4_multimodal: vision and audio encoders (no vision_config / audio_config)")
    if mtype not in EXACT_TYPES and not unpriced:
        unpriced.append(f"model_type {mtype}: structure not matched to HF's num_parameters()")
    total = _all_layers(cfg, mtype, hidden, norm, kinds)
    return HfCount(mtype, embedding, total, _head(cfg, mtype, hidden, norm), unpriced)
