"""Parameter counts of HF causal LMs from config.json (dsforge.compiler.model.hf_params) and DSF180's note."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.emit.rewrite_doc import meta_count_note
from dsforge.compiler.frontend.pretrained import model_keys
from dsforge.compiler.frontend.pretrained_params import param_count_note
from dsforge.compiler.model.hf_params import EXACT_TYPES, hf_param_count
from dsforge.compiler.model.params import total_params
from dsforge.compiler.model.resolved import resolve_model
from dsforge.compiler.spec.schema import ModelSpec

ROOT = Path(__file__).resolve().parents[3]
PRETRAINED = ROOT / "tests" / "fixtures" / "pretrained"


def stored_params(path: Path) -> int:
    """Elements of every tensor a safetensors file stores (its JSON header; a tied head is stored once)."""
    with open(path, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mixtral", "tiny-olmo2"])
def test_count_equals_the_checkpoints_tensors(name: str) -> None:
    directory = PRETRAINED / name
    cfg = json.loads((directory / "config.json").read_text())
    count = hf_param_count(cfg)
    assert count.exact
    assert count.total == stored_params(directory / "model.safetensors")


_LLAMA_LIKE = st.fixed_dictionaries({
    "model_type": st.sampled_from(["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe",
                                   "qwen2_moe"]),
    "heads": st.integers(1, 8), "group": st.integers(1, 4), "head_dim": st.sampled_from([4, 8, 12]),
    "hidden": st.sampled_from([16, 24, 32]), "layers": st.integers(1, 4), "ffn": st.integers(1, 64),
    "vocab": st.integers(2, 300), "tied": st.booleans(), "experts": st.integers(2, 6),
    "moe_ffn": st.integers(1, 32)})


@settings(max_examples=60, deadline=None)
@given(_LLAMA_LIKE)
def test_structural_count_agrees_with_the_model_keys_formula(p: dict[str, object]) -> None:
    """For the hand-written families both counts state every weight, so two independent formulas agree."""
    heads, group = int(p["heads"]), int(p["group"])  # type: ignore[call-overload]
    cfg = {"model_type": p["model_type"], "hidden_size": p["hidden"], "num_hidden_layers": p["layers"],
           "num_attention_heads": heads * group, "num_key_value_heads": heads, "head_dim": p["head_dim"],
           "intermediate_size": p["ffn"], "vocab_size": p["vocab"], "max_position_embeddings": 64,
           "tie_word_embeddings": p["tied"], "hidden_act": "silu"}
    if p["model_type"] == "mixtral":  # its experts are intermediate_size wide
        cfg |= {"num_local_experts": p["experts"], "num_experts_per_tok": 1}
    elif p["model_type"] in ("qwen2_moe", "qwen3_moe"):
        cfg |= {"num_experts": p["experts"], "num_experts_per_tok": 1, "moe_intermediate_size": p["moe_ffn"]}
        if p["model_type"] == "qwen2_moe":
            cfg["shared_expert_intermediate_size"] = p["moe_ffn"]
    keys = model_keys(cfg, Path("config.json"))
    spec = ModelSpec(**keys)
    assert hf_param_count(cfg).total == total_params(resolve_model(spec))


def test_note_is_silent_when_the_formula_is_exact_and_says_the_difference_otherwise() -> None:
    llama = PRETRAINED / "tiny-llama"
    exact = hf_param_count(json.loads((llama / "config.json").read_text())).total
    assert param_count_note(str(llama), exact) is None
    note = param_count_note(str(llama), exact - 10)
    assert note is not None and f"{exact:,}" in note and "-10" in note
    assert param_count_note(None, 5) is None


_REAL_SIZE = json.loads((ROOT / "tests" / "fixtures" / "hf_param_configs.json").read_text())


@pytest.mark.parametrize("model_type", sorted(_REAL_SIZE))
def test_real_size_configs_count_as_hf_does(model_type: str) -> None:
    """The default (flagship-size) config of each type whose layers hf_params prices by kind (Gated DeltaNet,
    Mamba-2, KDA, lightning and short-conv mixers, sparse-attention indexers, hyper-connections, ...), as
    config.json; num_parameters is HF's count of that config built on the meta device (transformers 5.24)."""
    case = _REAL_SIZE[model_type]
    count = hf_param_count(case["config"])
    assert count.exact
    assert count.total == case["num_parameters"]


def test_older_config_json_without_layer_types() -> None:
    """Older checkpoints state the layer pattern in the keys the config class derives layer_types from."""
    qwen = dict(_REAL_SIZE["qwen3_next"]["config"])
    kinds = qwen.pop("layer_types")
    assert kinds == ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(len(kinds))]
    count = hf_param_count(qwen | {"full_attention_interval": 4})
    assert count.exact and count.total == _REAL_SIZE["qwen3_next"]["num_parameters"]
    nemotron = dict(_REAL_SIZE["nemotron_h"]["config"])
    code = {"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}
    pattern = "".join(code[k] for k in nemotron.pop("layers_block_type"))
    count = hf_param_count(nemotron | {"hybrid_override_pattern": pattern})
    assert count.exact and count.total == _REAL_SIZE["nemotron_h"]["num_parameters"]
    lfm2 = dict(_REAL_SIZE["lfm2"]["config"])
    full = [i for i, k in enumerate(lfm2.pop("layer_types")) if k == "full_attention"]
    assert hf_param_count(lfm2 | {"full_attn_idxs": full}).total == _REAL_SIZE["lfm2"]["num_parameters"]
    olmo = {k: v for k, v in _REAL_SIZE["olmo_hybrid"]["config"].items() if k != "layer_types"}
    count = hf_param_count(olmo)
    assert not count.exact and "no layer_types" in count.unpriced[0]


def test_hybrid_layer_kinds_are_priced_per_layer() -> None:
    """A Gated DeltaNet layer and a gated-q softmax layer of Qwen3-Next, each from its own config keys."""
    base = {"model_type": "qwen3_next", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10, "intermediate_size": 8,
            "tie_word_embeddings": True, "linear_num_key_heads": 2, "linear_key_head_dim": 4,
            "linear_num_value_heads": 4, "linear_value_head_dim": 2, "linear_conv_kernel_dim": 3}
    mlp_norms = 3 * 16 * 8 + 2 * 16
    linear = hf_param_count(base | {"layer_types": ["linear_attention"]}).layers - mlp_norms
    # in_proj_qkvz (2 x 8 + 2 x 8 wide), in_proj_ba (2 x 4), conv1d (24 channels x 3), dt_bias, A_log, norm,
    # out_proj
    assert linear == 16 * 32 + 16 * 8 + 24 * 3 + 4 + 4 + 2 + 8 * 16
    full = hf_param_count(base | {"layer_types": ["full_attention"]}).layers - mlp_norms
    assert full == 16 * 16 + 2 * 16 * 4 + 8 * 16 + 2 * 4  # q_proj twice as wide (gate), k, v, o, q/k norms


def test_every_approximate_type_names_what_it_leaves_out() -> None:
    small = {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 4}
    unknown = hf_param_count({"model_type": "some_new_lm"} | small)
    assert not unknown.exact and "some_new_lm" in unknown.unpriced[0]
    # Phi-4-multimodal's encoders are priced from vision_config / audio_config; without them, named
    bare = hf_param_count({"model_type": "phi4_multimodal"} | small)
    assert not bare.exact and "audio" in bare.unpriced[0]


def test_unmatched_type_is_named_approximate() -> None:
    cfg = {"model_type": "some_hybrid", "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
           "vocab_size": 32, "intermediate_size": 16, "layer_types": ["linear_attention", "full_attention"]}
    count = hf_param_count(cfg)
    assert not count.exact and "linear_attention" in count.unpriced[0]


def test_meta_count_note() -> None:
    assert meta_count_note({"params": {"total": 100, "formula_total": 100}}) == []
    assert meta_count_note({"params": {"total": 100}}) == []
    (note,) = meta_count_note({"params": {"total": 200, "formula_total": 190}})
    assert "200" in note and "-10" in note and "-5.00%" in note


@pytest.mark.slow
def test_exact_types_are_those_that_match_hf_num_parameters() -> None:
    """Over the zoo's tiny configs, a type is in EXACT_TYPES if and only if its count equals HF's."""
    pytest.importorskip("transformers")
    from benchmarks.hf_param_counts import measure
    from benchmarks.hf_zoo import zoo_types

    rows = [measure(t) for t in zoo_types()]
    built = {r["type"]: r for r in rows if r["hf"] is not None}
    wrong = {t: r["diff"] for t, r in built.items() if (r["diff"] == 0) != (t in EXACT_TYPES)}
    assert not wrong
    assert EXACT_TYPES <= set(built)
    silent = [t for t, r in built.items() if r["diff"] != 0 and not r["unpriced"]]
    assert not silent  # an approximate count always names the feature it does not price


def test_mla_and_linear_attention_layers_are_named_with_their_flop_gap(tmp_path: Path) -> None:
    from dsforge.compiler.frontend.pretrained_params import attention_core_gaps

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "minicpm3", "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
        "v_head_dim": 24, "layer_types": ["linear_attention", "full_attention", "full_attention"]}))
    (mla, mla_gap), (linear, linear_gap) = attention_core_gaps(str(tmp_path), seq_len=32, heads=4, head_dim=8,
                                                               layers=3)
    # per token and head, scores cost 2 x seq x (q.k width) and the weighted sum 2 x seq x v width; x3 for
    # backward
    per_layer = sum(3 * 2 * 32 * 4 * w for w in (16, 24)) - sum(3 * 2 * 32 * 4 * w for w in (8, 8))
    assert mla_gap == 3 * per_layer and "16 channels" in mla and "over 24" in mla
    assert linear_gap == -(3 * 2 * 32 * 4 * 8 * 2) and linear.startswith("1 of 3 layers")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert attention_core_gaps(str(tmp_path), 32, 4, 8, 3) == []
