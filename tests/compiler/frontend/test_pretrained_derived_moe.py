"""`model.pretrained` of a MoE type without a hand-written family: PROVEN_MOE is read by its plans, the others
refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dsforge.compiler.frontend.pretrained import PretrainedError, model_keys

OLMOE: dict[str, Any] = {"model_type": "olmoe", "hidden_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32,
                         "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256,
                         "max_position_embeddings": 64, "hidden_act": "silu", "output_router_logits": False,
                         "router_aux_loss_coef": 0.01, "tie_word_embeddings": False}


def test_olmoe_gets_a_moe_section_from_config_json() -> None:
    keys = model_keys(OLMOE, Path("config.json"))
    assert keys["arch"] == "auto"
    assert keys["moe"] == {"experts": 4, "top_k": 2, "ffn_hidden": 32, "every": 1}


def test_llama4_text_has_its_shared_expert_and_granitemoe_its_local_experts() -> None:
    llama4 = {**OLMOE, "model_type": "llama4_text", "moe_layers": [0, 1], "interleave_moe_layer_step": 1}
    assert model_keys(llama4, Path("config.json"))["moe"] == {"experts": 4, "top_k": 2, "ffn_hidden": 32,
                                                              "every": 1, "shared_experts": 1,
                                                              "shared_ffn_hidden": 32}
    granite = {k: v for k, v in OLMOE.items() if k != "num_experts"} | {"model_type": "granitemoe",
                                                                        "num_local_experts": 8}
    assert model_keys(granite, Path("config.json"))["moe"]["experts"] == 8


@pytest.mark.parametrize(("change", "rule", "words"), [
    ({"output_router_logits": True}, "DSF015", "load-balancing loss"),
    ({"decoder_sparse_step": 2}, "DSF012", "dense MLP layers"),
    ({"num_experts_per_tok": 0}, "DSF012", "num_experts_per_tok"),
    ({"model_type": "flex_olmo", "num_local_experts": 4}, "DSF012", "mixture of experts"),
    ({"model_type": "llama4_text", "interleave_moe_layer_step": 2}, "DSF012", "dense MLP layers"),
    ({"model_type": "llama4_text", "moe_layers": [1]}, "DSF012", "dense MLP layers"),
])
def test_what_cannot_be_read_exactly_is_refused(change: dict[str, Any], rule: str, words: str) -> None:
    with pytest.raises(PretrainedError) as err:
        model_keys({**OLMOE, **change}, Path("config.json"))
    assert err.value.rule == rule and words in err.value.message
