"""Parameters of the vision and audio encoders a causal LM builds inside itself (Phi-4-multimodal's
``embed_tokens_extend``), from the ``vision_config`` and ``audio_config`` of config.json alone (no torch)."""

from __future__ import annotations

import math
from typing import Any

from dsforge.compiler.model.hf_mixers import cfg_int


def _linear(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


def _vision_tower(vc: dict[str, Any]) -> int:
    """A SigLIP tower: patch and position embeddings, pre-norm encoder layers (biased q/k/v/out and a
    two-matrix MLP, two LayerNorms), the post LayerNorm and the attention-pooling head (probe, fused
    in_proj, out_proj, LayerNorm, MLP)."""
    width, ffn = cfg_int(vc, "hidden_size"), cfg_int(vc, "intermediate_size")
    patch = cfg_int(vc, "patch_size", default=14)
    embeddings = _linear(cfg_int(vc, "num_channels", default=3) * patch * patch, width)
    embeddings += (cfg_int(vc, "image_size") // patch) ** 2 * width
    mlp = _linear(width, ffn) + _linear(ffn, width)
    layer = 4 * width + 4 * _linear(width, width) + mlp
    head = width + _linear(width, 3 * width) + _linear(width, width) + 2 * width + mlp
    return embeddings + cfg_int(vc, "num_hidden_layers") * layer + 2 * width + head


def phi4_image_embedding(vc: dict[str, Any], hidden: int) -> int:
    """Phi-4-multimodal's image embedding: the vision tower, its two projections to the LM's width and the
    global and sub-image separator features."""
    width = cfg_int(vc, "hidden_size")
    return _vision_tower(vc) + _linear(width, hidden) + _linear(hidden, hidden) + 2 * width


def _conformer_block(ac: dict[str, Any]) -> int:
    """A conformer block: two macaron feed-forwards (LayerNorm, biased gate_up and down), biased attention,
    the convolution module (LayerNorm, GLU pointwise conv with b1/b2, depthwise-separable conv, pointwise
    conv) and two LayerNorms."""
    width, ffn = cfg_int(ac, "hidden_size"), cfg_int(ac, "intermediate_size")
    ext = cfg_int(ac, "ext_pw_out_channel")
    depth = width * cfg_int(ac, "depthwise_multiplier", default=1)
    feed_forward = 2 * width + _linear(width, 2 * ffn) + _linear(ffn, width)
    conv = 2 * width + _linear(width, 2 * ext) + 2 * ext
    conv += depth * cfg_int(ac, "kernel_size", default=3) + depth
    conv += _linear(depth, cfg_int(ac, "depthwise_separable_out_channel")) + _linear(width, ext)
    return 2 * feed_forward + 4 * _linear(width, width) + conv + 4 * width


def phi4_audio_embedding(ac: dict[str, Any], hidden: int) -> int:
    """Phi-4-multimodal's audio embedding: NeMo conv subsampling (log2(time_reduction) stride-2 stages), the
    relative attention bias table, the conformer blocks and the speech / vision-speech projections."""
    width, channels = cfg_int(ac, "hidden_size"), cfg_int(ac, "nemo_conv_channels")
    stages = int(math.log2(cfg_int(ac, "time_reduction", default=8)))
    subsampling = 10 * channels + (stages - 1) * (10 * channels + _linear(channels, channels))
    subsampling += _linear(channels * cfg_int(ac, "nemo_final_size"), width)
    buckets = cfg_int(ac, "bias_max_distance") * (1 if ac.get("bias_symmetric") else 2)
    blocks = cfg_int(ac, "num_blocks") * _conformer_block(ac)
    encoder = subsampling + buckets * cfg_int(ac, "num_attention_heads") + blocks
    speech_in = width * cfg_int(ac, "downsample_rate", default=1)
    return encoder + 2 * (_linear(speech_in, hidden) + _linear(hidden, hidden))


def phi4_encoders(cfg: dict[str, Any], hidden: int) -> int | None:
    """Both encoders of a Phi-4-multimodal config.json, or None when it does not carry their configs."""
    vision, audio = cfg.get("vision_config"), cfg.get("audio_config")
    if not isinstance(vision, dict) or not isinstance(audio, dict):
        return None
    return phi4_image_embedding(vision, hidden) + phi4_audio_embedding(audio, hidden)
