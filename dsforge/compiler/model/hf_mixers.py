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


#: The mixer of each type's ``linear_attention`` layers.
LINEAR_MIXERS: dict[str, Callable[[dict[str, Any], int], int]] = {
    "qwen3_next": gated_delta_net, "qwen3_5_text": gated_delta_net, "qwen3_5_moe_text": gated_delta_net,
    "olmo_hybrid": gated_delta_net, "lara_mini": gated_delta_net,
}
