"""What context parallelism cannot reproduce, read from a meta-device model's attention modules (DSF144)."""

from __future__ import annotations

import pytest

from dsforge.runtime.hf_attention import ContextParallelError, check_plain_causal, plain_causal_problems


def _gpt_oss(sliding_window: int = 64):
    import torch
    from transformers import AutoModelForCausalLM, GptOssConfig

    cfg = GptOssConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, intermediate_size=32, vocab_size=64, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=sliding_window,
                       layer_types=["sliding_attention", "full_attention"])
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def test_attention_sinks_are_refused_under_cp_naming_the_modules():
    # ring/Ulysses attention is a plain softmax: GPT-OSS's learnt per-head sink logit would be dropped
    model = _gpt_oss()
    problems = plain_causal_problems(model, 16)
    assert problems == [("attention sinks (a learnt logit per head joins each softmax) in "
                         "model.layers.{0..1}.self_attn")]
    with pytest.raises(ContextParallelError, match="attention sinks"):
        check_plain_causal(model, 16)


def test_a_model_without_sinks_reports_none():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, num_hidden_layers=2,
                                                             num_attention_heads=4, intermediate_size=32,
                                                             vocab_size=64))
    assert plain_causal_problems(model, 16) == []
