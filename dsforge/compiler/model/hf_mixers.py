"""Parameters of the token mixers that are not softmax attention, from config.json alone (no torch).

Each function counts one layer's mixer (its projections, convolution, per-head decay and gate parameters,
and its own output norm) from the config keys the HF modeling code reads. ``LINEAR_MIXERS`` says which
mixer a model type's ``linear_attention`` layers are; ``hf_params`` adds the layer's norms and MLP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def cfg_int(cfg: dict[str, Any], *names: str, default: int = 0) -> int:
    """The first of ``names`` that config.json sets to an integer (not a bool), else ``default``."""
    for name in names:
        value = cfg.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def gated_delta_net(cfg: dict[str, Any], hidden: int) -> int:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-hybrid, Lara): q/k/v/z and the b/a gates projected from
    the hidden state, a depthwise causal convolution over q, k and v, per value head a decay ``A_log`` and a
    ``dt_bias``, a gated RMSNorm over one value head, and the output projection."""
    key = cfg_int(cfg, "linear_num_key_heads") * cfg_int(cfg, "linear_key_head_dim")
    v_heads, v_dim = cfg_int(cfg, "linear_num_value_heads"), cfg_int(cfg, "linear_value_head_dim")
    value = v_heads * v_dim
    conv = (2 * key + value) * cfg_int(cfg, "linear_conv_kernel_dim", default=4)
    return hidden * (2 * key + 2 * value + 2 * v_heads) + conv + 2 * v_heads + v_dim + value * hidden


def _mamba2(hidden: int, inner: int, heads: int, state_width: int, kernel: int, conv_bias: bool,
            proj_bias: bool) -> int:
    """A Mamba-2 mixer: in_proj to z, x, B, C (``state_width`` = 2 x groups x state) and dt; a depthwise
    convolution over x, B and C; per head dt_bias, A_log and D; a gated RMSNorm over ``inner``; out_proj."""
    conv_dim = inner + state_width
    in_proj = hidden * (inner + conv_dim + heads) + (inner + conv_dim + heads if proj_bias else 0)
    conv = conv_dim * kernel + (conv_dim if conv_bias else 0)
    return in_proj + conv + 3 * heads + inner + inner * hidden + (hidden if proj_bias else 0)


def jamba_mamba(cfg: dict[str, Any], hidden: int) -> int:
    """Jamba's Mamba (1) mixer: in_proj to x and z, a depthwise convolution over x, x_proj to dt, B and C,
    dt_proj back to the inner width, A_log (inner x state) and D, RMSNorms over dt, B and C, out_proj."""
    inner, state = cfg_int(cfg, "mamba_expand", default=2) * hidden, cfg_int(cfg, "mamba_d_state")
    rank = cfg.get("mamba_dt_rank")
    rank = -(-hidden // 16) if rank == "auto" or not isinstance(rank, int) else rank
    bias = bool(cfg.get("mamba_proj_bias"))
    kernel = cfg_int(cfg, "mamba_d_conv", default=4)
    conv = inner * kernel + (inner if cfg.get("mamba_conv_bias", True) else 0)
    projections = hidden * 2 * inner + inner * (rank + 2 * state) + rank * inner + inner + inner * hidden
    return projections + (2 * inner + hidden if bias else 0) + conv + inner * state + inner + rank + 2 * state


def granite_mamba(cfg: dict[str, Any], hidden: int) -> int:
    """Granite-4.0-H's Mamba-2 layer (``mamba_*`` keys; its inner width is ``mamba_expand`` x hidden)."""
    return _mamba2(hidden, cfg_int(cfg, "mamba_expand", default=2) * hidden, cfg_int(cfg, "mamba_n_heads"),
                   2 * cfg_int(cfg, "mamba_n_groups", default=1) * cfg_int(cfg, "mamba_d_state"),
                   cfg_int(cfg, "mamba_d_conv", default=4), bool(cfg.get("mamba_conv_bias", True)),
                   bool(cfg.get("mamba_proj_bias")))


def nemotron_h_mamba(cfg: dict[str, Any], hidden: int) -> int:
    """Nemotron-H's Mamba-2 layer (inner width ``mamba_num_heads`` x ``mamba_head_dim``)."""
    heads = cfg_int(cfg, "mamba_num_heads")
    conv_bias = cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))  # older config.json: mamba_* names
    return _mamba2(hidden, heads * cfg_int(cfg, "mamba_head_dim"), heads,
                   2 * cfg_int(cfg, "n_groups", "mamba_n_groups", default=1) * cfg_int(cfg, "ssm_state_size"),
                   cfg_int(cfg, "conv_kernel", "mamba_d_conv", default=4), bool(conv_bias),
                   bool(cfg.get("use_bias")))


def nemotron_h_moe(cfg: dict[str, Any], hidden: int) -> int:
    """Nemotron-H's MoE layer: ungated (up, down) experts, optionally in a ``moe_latent_size`` space reached
    by two projections, a router, and an ungated shared expert."""
    latent = cfg_int(cfg, "moe_latent_size")
    width, experts = latent or hidden, cfg_int(cfg, "n_routed_experts")
    bias = bool(cfg.get("mlp_bias"))
    shared = cfg_int(cfg, "moe_shared_expert_intermediate_size")
    block = experts * 2 * width * cfg_int(cfg, "moe_intermediate_size") + experts * hidden
    block += 2 * hidden * shared + ((shared + hidden) if bias else 0)
    if latent:
        block += 2 * hidden * latent + ((latent + hidden) if bias else 0)
    return block


def lightning_attention(cfg: dict[str, Any], hidden: int) -> int:
    """MiniMax's lightning (linear) attention: fused q/k/v, an output gate and out_proj, all heads x head_dim
    wide, and an RMSNorm over that width (its decay tables are buffers)."""
    heads = cfg_int(cfg, "num_attention_heads", default=1)
    width = heads * (cfg_int(cfg, "head_dim") or hidden // heads)
    return 5 * hidden * width + width


def _mimo_attention(cfg: dict[str, Any], hidden: int, sliding: bool) -> int:
    """MiMo-V2-Flash's attention: v and o ``v_head_dim`` wide, o unbiased; a sliding layer has twice the kv
    heads and one sink per head."""
    heads = cfg_int(cfg, "num_attention_heads", default=1)
    kv = cfg_int(cfg, "num_key_value_heads", default=heads) * (2 if sliding else 1)
    head_dim = cfg_int(cfg, "head_dim") or hidden // heads
    v_dim = cfg_int(cfg, "v_head_dim") or head_dim
    weights = hidden * (heads * head_dim + kv * head_dim + kv * v_dim) + heads * v_dim * hidden
    bias = heads * head_dim + kv * head_dim + kv * v_dim if cfg.get("attention_bias") else 0
    return weights + bias + (heads if sliding else 0)


def mimo_full(cfg: dict[str, Any], hidden: int) -> int:
    """MiMo-V2-Flash's full-attention layer."""
    return _mimo_attention(cfg, hidden, sliding=False)


def mimo_sliding(cfg: dict[str, Any], hidden: int) -> int:
    """MiMo-V2-Flash's sliding-window layer."""
    return _mimo_attention(cfg, hidden, sliding=True)


def kimi_delta_attention(cfg: dict[str, Any], hidden: int) -> int:
    """Kimi Delta Attention (Kimi Linear): q/k/v of linear_num_heads x linear_head_dim with a depthwise
    convolution, a per-channel forget gate (low-rank f_a/f_b, dt_bias per channel, A_log per head), the beta
    projection, a low-rank output gate (g_a/g_b), a gated RMSNorm over one head and o_proj."""
    heads, dim = cfg_int(cfg, "linear_num_heads"), cfg_int(cfg, "linear_head_dim")
    width = heads * dim
    conv = 3 * width * cfg_int(cfg, "linear_conv_kernel_dim", default=4)
    low_rank = 2 * (hidden * dim + dim * width)  # forget gate and output gate
    return 4 * hidden * width + conv + low_rank + width + heads + hidden * heads + dim


def bailing_delta_attention(cfg: dict[str, Any], hidden: int) -> int:
    """Ling/Bailing-hybrid's delta attention: Kimi's, with full-rank forget (f_proj) and output (g_proj)
    gates."""
    heads, dim = cfg_int(cfg, "linear_num_heads"), cfg_int(cfg, "linear_head_dim")
    width = heads * dim
    conv = 3 * width * cfg_int(cfg, "linear_conv_kernel_dim", default=4)
    return 6 * hidden * width + conv + width + heads + hidden * heads + dim


def short_conv(cfg: dict[str, Any], hidden: int) -> int:
    """LFM2's gated short convolution: in_proj to three hidden-wide streams, a depthwise convolution of
    conv_L_cache taps and out_proj, all biased when conv_bias."""
    bias = 5 * hidden if cfg.get("conv_bias") else 0
    return 4 * hidden * hidden + hidden * cfg_int(cfg, "conv_L_cache", default=3) + bias


def _inkling_widths(cfg: dict[str, Any], hidden: int, sliding: bool) -> tuple[int, int, int, int, int, int]:
    """Inkling 1 and 2's attention widths: heads, kv heads, head_dim (the swa_* ones on sliding layers),
    d_rel, the relative extent (the window on sliding layers) and the short-convolution kernel."""
    prefix = "swa_" if sliding else ""
    heads = cfg_int(cfg, prefix + "num_attention_heads", default=1)
    kv = cfg_int(cfg, prefix + "num_key_value_heads", default=heads)
    dim = cfg_int(cfg, prefix + "head_dim") or hidden // heads
    extent = cfg_int(cfg, "sliding_window_size" if sliding else "rel_extent")
    kernel = cfg_int(cfg, "sconv_kernel_size", "conv_kernel_size", default=4)
    return heads, kv, dim, cfg_int(cfg, "d_rel"), extent, kernel


def _inkling_attention(cfg: dict[str, Any], hidden: int, sliding: bool) -> int:
    """Inkling's attention: q/k/v/o and r_proj (d_rel per head), short convolutions over k and v, per-head
    q/k norms and a relative-logit table of d_rel x rel_extent (the window on sliding layers, which have
    swa_* heads)."""
    heads, kv, dim, d_rel, extent, kernel = _inkling_widths(cfg, hidden, sliding)
    projections = hidden * (2 * heads * dim + 2 * kv * dim + heads * d_rel)
    return projections + 2 * kv * dim * kernel + 2 * dim + d_rel * extent


def inkling_full(cfg: dict[str, Any], hidden: int) -> int:
    """Inkling's global ("hybrid") attention layer."""
    return _inkling_attention(cfg, hidden, sliding=False)


def inkling_sliding(cfg: dict[str, Any], hidden: int) -> int:
    """Inkling's sliding-window ("hybrid_sliding") attention layer."""
    return _inkling_attention(cfg, hidden, sliding=True)


def _inkling2_attention(cfg: dict[str, Any], hidden: int, full: bool) -> int:
    """Inkling-2's attention: q with a learnt per-head scale, k and v each with a short convolution (on full
    layers a dynamic one: static taps plus per-token taps projected from the hidden state), a sigmoid-gated
    o_proj, per-head sinks, and a relative-position bias (linear to d_rel per head, its scale, the d_rel x
    extent table). Full ("hybrid") layers have the global heads, sliding layers the swa_* heads."""
    heads, kv, dim, d_rel, extent, kernel = _inkling_widths(cfg, hidden, not full)
    q = hidden * heads * dim + heads * dim
    k_v = 2 * (hidden * kv * dim + kv * dim * kernel + (hidden * kv * kernel if full else 0))
    out = 2 * hidden * heads * dim + hidden * heads
    relative = hidden * heads * d_rel + heads * d_rel + d_rel * extent
    return q + k_v + out + relative


def inkling2_full(cfg: dict[str, Any], hidden: int) -> int:
    """Inkling-2's global ("hybrid") attention layer."""
    return _inkling2_attention(cfg, hidden, full=True)


def inkling2_sliding(cfg: dict[str, Any], hidden: int) -> int:
    """Inkling-2's sliding-window ("hybrid_sliding") attention layer."""
    return _inkling2_attention(cfg, hidden, full=False)


def inkling2_layer_extras(cfg: dict[str, Any], hidden: int, kind: str, index: int) -> int:
    """What an Inkling-2 layer has beside attention, MoE and its two norms: the block attention residuals'
    queries (the MLP's; attention's from layer 1 on, three of them on full layers, for q, k and v), the k and
    v input norms of full layers, and the short convolutions after attention and MLP."""
    full = kind == "hybrid"
    queries = hidden + ((3 if full else 1) * hidden if index > 0 else 0)
    extras = queries + (2 * hidden if full else 0) + 2 * hidden * cfg_int(cfg, "conv_kernel_size", default=4)
    if cfg_int(cfg, "loop_layer_index_start") <= index < cfg_int(cfg, "loop_layer_index_end"):
        # a looped layer's four message gates (q, k, v, MLP): down_proj from 2 x hidden to loop_gate_rank, and
        # forget and message projections back
        extras += 4 * 4 * hidden * cfg_int(cfg, "loop_gate_rank")
    return extras


def loop_message_queries(cfg: dict[str, Any], hidden: int) -> int:
    """Inkling-2-loop's message attention residual: four queries for each looped layer."""
    return (cfg_int(cfg, "loop_layer_index_end") - cfg_int(cfg, "loop_layer_index_start")) * 4 * hidden


def zaya_cca_attention(cfg: dict[str, Any], hidden: int) -> int:
    """ZAYA's compressed convolutional attention: q, k and current/delayed half-width v projections, a
    depthwise (cca_time0 taps) and a per-head grouped (cca_time1 taps) biased convolution over q and k, a
    learnt temperature per kv head, and o_proj; the projections biased with attention_bias."""
    heads = cfg_int(cfg, "num_attention_heads", default=1)
    kv = cfg_int(cfg, "num_key_value_heads", default=heads)
    dim = cfg_int(cfg, "head_dim") or hidden // heads
    q_dim, kv_dim = heads * dim, kv * dim
    channels = q_dim + kv_dim
    taps = cfg_int(cfg, "cca_time0", default=2) + dim * cfg_int(cfg, "cca_time1", default=2)
    convs = channels * taps
    bias = q_dim + 2 * kv_dim + hidden if cfg.get("attention_bias") else 0
    return hidden * (2 * q_dim + 2 * kv_dim) + bias + convs + 2 * channels + kv


def zaya_moe(cfg: dict[str, Any], hidden: int, index: int) -> int:
    """ZAYA's MoE: experts, and a router through router_hidden_size (a biased down_proj, a scale on every
    layer but the first, an MLP with norm, two biased square layers and out_proj to the experts and a skip
    class)."""
    experts, width = cfg_int(cfg, "num_experts"), cfg_int(cfg, "router_hidden_size")
    router = hidden * width + width + (width if index > 0 else 0)
    router += width + 2 * (width * width + width) + width * (experts + 1)
    return router + experts * 3 * hidden * cfg_int(cfg, "moe_intermediate_size")


def _dsv4_attention(cfg: dict[str, Any], hidden: int, kind: str) -> int:
    """DeepSeek-V4's attention: q through q_lora_rank, one shared kv head, a grouped low-rank o_proj (o_groups
    x o_lora_rank), per-head sinks; a heavily compressed layer adds a compressor (kv, gate, position bias of
    its compress rate, norm), a compressed sparse layer one twice as wide and a lightning indexer."""
    heads, dim, q_rank = cfg_int(cfg, "num_attention_heads", default=1), cfg_int(cfg, "head_dim"), cfg_int(
        cfg, "q_lora_rank")
    groups, o_rank = cfg_int(cfg, "o_groups", default=1), cfg_int(cfg, "o_lora_rank")
    core = hidden * q_rank + q_rank + q_rank * heads * dim + hidden * dim + dim
    core += heads * dim * o_rank + groups * o_rank * hidden + heads
    rates = cfg.get("compress_rates")
    rate = rates.get(kind, 0) if isinstance(rates, dict) else 0
    if kind == "heavily_compressed_attention":
        return core + 2 * hidden * dim + rate * dim + dim
    if kind != "compressed_sparse_attention":
        return core
    idx_heads, idx_dim = cfg_int(cfg, "index_n_heads"), cfg_int(cfg, "index_head_dim")
    compressor = 4 * hidden * dim + rate * 2 * dim + dim
    indexer = 4 * hidden * idx_dim + rate * 2 * idx_dim + idx_dim + q_rank * idx_heads * idx_dim
    return core + compressor + indexer + hidden * idx_heads


def dsv4_sliding(cfg: dict[str, Any], hidden: int) -> int:
    """DeepSeek-V4's sliding-window layer (no compressor)."""
    return _dsv4_attention(cfg, hidden, "sliding_attention")


def dsv4_compressed(cfg: dict[str, Any], hidden: int) -> int:
    """DeepSeek-V4's compressed sparse attention layer."""
    return _dsv4_attention(cfg, hidden, "compressed_sparse_attention")


def dsv4_heavily_compressed(cfg: dict[str, Any], hidden: int) -> int:
    """DeepSeek-V4's heavily compressed attention layer."""
    return _dsv4_attention(cfg, hidden, "heavily_compressed_attention")


def dsv4_hyper_connections(cfg: dict[str, Any], hidden: int) -> int:
    """DeepSeek-V4's two manifold hyper-connections per layer: (2 + hc_mult) x hc_mult mixes of the streams
    (pre, post and the comb matrix), their biases and three scales."""
    streams = cfg_int(cfg, "hc_mult")
    mixes = (2 + streams) * streams
    return 2 * (mixes * streams * hidden + mixes + 3)


Mixer = Callable[[dict[str, Any], int], int]

#: The token mixer of each (model type, layer kind) whose layers are not the shared softmax attention.
MIXERS: dict[tuple[str, str], Mixer] = {
    **{(t, "linear_attention"): gated_delta_net
       for t in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini",
                 "qwen4_exp_text")},
    ("granitemoehybrid", "linear_attention"): granite_mamba, ("bamba", "linear_attention"): granite_mamba,
    ("jamba", "mamba"): jamba_mamba,
    ("nemotron_h", "linear_attention"): nemotron_h_mamba,
    ("minimax", "linear_attention"): lightning_attention,
    ("kimi_linear", "linear_attention"): kimi_delta_attention,
    ("bailing_hybrid", "linear_attention"): bailing_delta_attention,
    ("lfm2", "conv"): short_conv, ("lfm3", "conv"): short_conv,
    ("deepseek_v4", "sliding_attention"): dsv4_sliding,
    ("deepseek_v4", "compressed_sparse_attention"): dsv4_compressed,
    ("deepseek_v4", "heavily_compressed_attention"): dsv4_heavily_compressed,
    ("zaya", "hybrid"): zaya_cca_attention, ("zaya", "hybrid_sliding"): zaya_cca_attention,
    ("inkling_text", "hybrid"): inkling_full, ("inkling_text", "hybrid_sliding"): inkling_sliding,
    **{(t, "hybrid"): inkling2_full for t in ("inkling2_text", "inkling2_loop_text")},
    **{(t, "hybrid_sliding"): inkling2_sliding for t in ("inkling2_text", "inkling2_loop_text")},
    ("mimo_v2_flash", "full_attention"): mimo_full, ("mimo_v2_flash", "sliding_attention"): mimo_sliding,
}


def minimax_m3_indexer(cfg: dict[str, Any], hidden: int, index: int) -> int:
    """MiniMax-M3's lightning indexer on its sparse layers: q (index_n_heads heads) and one k head of
    index_head_dim, each with an RMSNorm over index_head_dim."""
    del index
    dim = cfg_int(cfg, "index_head_dim")
    return hidden * (cfg_int(cfg, "index_n_heads") + 1) * dim + 2 * dim


def head_gate(cfg: dict[str, Any], hidden: int, index: int) -> int:
    """A per-head output gate of attention (Bailing-hybrid's g_proj, hidden to num_attention_heads)."""
    del index
    return hidden * cfg_int(cfg, "num_attention_heads", default=1)


def optional_head_gate(cfg: dict[str, Any], hidden: int, index: int) -> int:
    """LFM3's per-head attention gate (g_proj), present when use_attention_gate."""
    return head_gate(cfg, hidden, index) if cfg.get("use_attention_gate") else 0


def laguna_gate(cfg: dict[str, Any], hidden: int, index: int) -> int:
    """Laguna's softplus attention gate: one value per head (gating true or "per-head"), else per channel."""
    del index
    heads = cfg_int(cfg, "num_attention_heads", default=1)
    per_head = cfg.get("gating") is True or cfg.get("gating") == "per-head"
    return hidden * (heads if per_head else heads * (cfg_int(cfg, "head_dim") or hidden // heads))


def doge_dynamic_mask(cfg: dict[str, Any], hidden: int, index: int) -> int:
    """Doge's dynamic mask: per kv head a learnt A, and dt_proj from the values."""
    del hidden, index
    heads = cfg_int(cfg, "num_attention_heads", default=1)
    kv = cfg_int(cfg, "num_key_value_heads", default=heads)
    kv_dim = kv * (cfg_int(cfg, "head_dim") or cfg_int(cfg, "hidden_size") // heads)
    return kv + kv_dim * kv + (kv if cfg.get("attention_bias") else 0)


def dory_gates(cfg: dict[str, Any], hidden: int, index: int) -> int:
    """Dory's attention output gate (gate_proj) and its nGPT scales sqk and s_gate, heads x head_dim each."""
    del index
    heads = cfg_int(cfg, "num_attention_heads", default=1)
    width = heads * (cfg_int(cfg, "head_dim") or hidden // heads)
    return hidden * width + 2 * width


def dsa_indexer(cfg: dict[str, Any], hidden: int, index: int) -> int:
    """DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2, GLM-5): its q from MLA's q_lora_rank
    latent (index_n_heads x index_head_dim), one k head with a LayerNorm, and per-head weights. A layer whose
    ``indexer_types`` entry is "shared" reuses the previous layer's indexer and has none."""
    types = cfg.get("indexer_types")
    if isinstance(types, list) and index < len(types) and types[index] == "shared":
        return 0
    heads, dim = cfg_int(cfg, "index_n_heads"), cfg_int(cfg, "index_head_dim")
    return cfg_int(cfg, "q_lora_rank") * heads * dim + hidden * dim + 2 * dim + hidden * heads


def hy_v4_attention_extras(cfg: dict[str, Any], hidden: int, index: int) -> int:
    """Hy-V4's additions to MLA: a DSA indexer (none on "shared" layers), an output gate of v_head_dim per
    head and one learnt sink per head."""
    heads = cfg_int(cfg, "num_attention_heads", default=1)
    return dsa_indexer(cfg, hidden, index) + hidden * heads * cfg_int(cfg, "v_head_dim") + heads


def hyper_connections(cfg: dict[str, Any], hidden: int) -> int:
    """One layer's two hyper-connections (around attention and MLP) over hc_mult residual streams: each maps
    the streams to 2 x hc_mult pre/post mixes (fn), with their biases and two scales."""
    streams = cfg_int(cfg, "hc_mult")
    return 2 * (2 * streams * streams * hidden + 2 * streams + 2)


def hyper_connection_head(cfg: dict[str, Any], hidden: int) -> int:
    """The hc_head before the final norm: hc_mult mixes of the streams, their biases and a scale."""
    streams = cfg_int(cfg, "hc_mult")
    return streams * streams * hidden + streams + 1


Extra = Callable[[dict[str, Any], int, int], int]


def falcon_h1_mamba(cfg: dict[str, Any], hidden: int, index: int) -> int:
    """Falcon-H1's Mamba-2 mixer, beside attention in every layer (inner width ``mamba_d_ssm``, else
    ``mamba_expand`` x hidden; its gated norm only with ``mamba_rms_norm``)."""
    inner = cfg_int(cfg, "mamba_d_ssm") or cfg_int(cfg, "mamba_expand", default=2) * hidden
    mixer = _mamba2(hidden, inner, cfg_int(cfg, "mamba_n_heads"),
                    2 * cfg_int(cfg, "mamba_n_groups", default=1) * cfg_int(cfg, "mamba_d_state"),
                    cfg_int(cfg, "mamba_d_conv", default=4), bool(cfg.get("mamba_conv_bias", True)),
                    bool(cfg.get("mamba_proj_bias")))
    proj_bias, out_bias = bool(cfg.get("mamba_proj_bias")), bool(cfg.get("projectors_bias"))
    out_bias_diff = (hidden if out_bias else 0) - (hidden if proj_bias else 0)  # out_proj: projectors_bias
    return mixer - (0 if cfg.get("mamba_rms_norm") else inner) + out_bias_diff

#: Modules a (model type, layer kind) adds to the shared softmax attention of layer ``index`` (indexers of
#: sparse attention).
ATTENTION_EXTRAS: dict[tuple[str, str], Extra] = {
    ("minimax_m3_vl_text", "minimax_m3_sparse"): minimax_m3_indexer,
    ("bailing_hybrid", "full_attention"): head_gate, ("doge", "full_attention"): doge_dynamic_mask,
    ("laguna", "full_attention"): laguna_gate, ("laguna", "sliding_attention"): laguna_gate,
    ("lfm3", "full_attention"): optional_head_gate, ("lfm3", "sliding_attention"): optional_head_gate,
    **{(t, "indexed_attention"): dsa_indexer for t in ("deepseek_v32", "glm_moe_dsa", "axk2")},
    ("dory", "full_attention"): dory_gates, ("dory", "sliding_attention"): dory_gates,
    ("hy_v4", "indexed_attention"): hy_v4_attention_extras,
    ("falcon_h1", "full_attention"): falcon_h1_mamba,
}
