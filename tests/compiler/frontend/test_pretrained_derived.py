"""`model.pretrained` of a dense family only its HF plan places: keys from config.json, arch auto; refusals
named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dsforge.compiler.frontend.pretrained import PretrainedError, model_keys, sliding_window
from dsforge.compiler.frontend.pretrained_derived import derived_window
from tests.compiler.frontend.test_pretrained_config import checkpoint_dir, job_file, rules_of


def starcoder2_config(**over: Any) -> dict[str, Any]:
    """A config.json of a small StarCoder2 (no hand-written policy; its tp plan places it)."""
    cfg = {"model_type": "starcoder2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128,
           "max_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True,
           "sliding_window": None}
    cfg.update(over)
    return cfg


def test_a_dense_family_with_a_plan_gives_its_keys_under_arch_auto(tmp_path: Path) -> None:
    keys = model_keys(starcoder2_config(), tmp_path / "config.json")
    assert keys == {"arch": "auto", "hidden": 64, "layers": 2, "heads": 4, "ffn_hidden": 96, "seq_len": 64,
                    "vocab": 128, "kv_heads": 2, "head_dim": 16, "tied_embeddings": True,
                    "activation": "gelu", "position": "rope"}
    checkpoint_dir(tmp_path, starcoder2_config())
    assert rules_of(job_file(tmp_path, {"pretrained": "ckpt", "seq_len": 32})) == []


@pytest.mark.parametrize(("cfg", "said"), [
    # olmoe, granitemoe: PROVEN_MOE
    ({"model_type": "flex_olmo", "num_local_experts": 8}, "mixture of experts"),
    ({"model_type": "bert"}, "no tensor- or expert-parallel plan"),
    ({"model_type": "longcat_flash"}, "'moe_identity_expert'"),
    ({"model_type": "not_a_model"}, "not a causal LM"),
    ({"num_attention_heads": 0}, "num_attention_heads is 0"),
])
def test_what_the_derived_path_cannot_load_is_dsf012_with_the_reason(tmp_path: Path, cfg: dict[str, Any],
                                                                      said: str) -> None:
    with pytest.raises(PretrainedError) as exc:
        model_keys(starcoder2_config(**cfg), tmp_path / "config.json")
    assert exc.value.rule == "DSF012" and said in exc.value.message


def test_any_window_a_derived_family_states_counts_as_applied(tmp_path: Path) -> None:
    assert sliding_window(starcoder2_config(sliding_window=8)) == 8
    assert derived_window({"sliding_window": 8, "use_sliding_window": False}) is None
    assert derived_window({"sliding_window": 8, "use_sliding_window": False,
                           "layer_types": ["sliding_attention", "full_attention"]}) == 8
    assert derived_window({"sliding_window": -1}) == 0
    checkpoint_dir(tmp_path, starcoder2_config(sliding_window=8))
    found = rules_of(job_file(tmp_path, {"pretrained": "ckpt", "seq_len": 32}))
    assert [r for r, _ in found] == ["DSF012"] and "sliding_window 8" in found[0][1]
