"""`model.pretrained` of a dense HF family without a hand-written policy: placed by its own tp plan (no
torch).

config.json's ``model_type`` names a row of the generated plan table (dsforge.compiler.model.hf_plans);
when its plans derive a policy, the job's model keys are read from the usual HF config names with
``arch: auto`` (the runtime builds the checkpoint's own HF model and `arch: auto` places it by that
policy, so the training mathematics is HF's forward). The keys feed the estimates and the layout
rules only; the features they cannot state (biases, norms with bias, logit scales, ...) make the
estimates approximate, which explain states from the meta build's exact count.

Refused here (DSF012, with the reason): a type without a derived policy (no plan, or a style without
an exact placement), MoE types other than PROVEN_MOE (their checkpoints' expert layouts and routers
are proven for the hand-written families and these only), and a sliding window, wherever config.json states
one, shorter than model.seq_len.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsforge.compiler.model.hf_plans import PlanRefusal, derive_policy, plans_for_type

#: MoE types without a hand-written family that `model.pretrained` loads by their HF plans, each proven exact
#: against plain HF from_pretrained in tests/runtime_e2e/pretrained_moe.py (tp2; OLMoE dp2 too): OLMoE
#: (experts one tensor each on disk), GraniteMoE (router.layer, input_linear / output_linear stacks), Llama 4
#: text (stacked gate_up_proj [E, hidden, 2F], a shared expert, NoPE layers). Every layer must be sparse.
#: Under ep > 1 the rewrite decides (DSF607 names a router DeepSpeed's gate has no exact twin of).
PROVEN_MOE = frozenset({"olmoe", "granitemoe", "llama4_text"})
#: config.json keys that mark a mixture of experts in the families transformers ships.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_ALIASES = {"hidden": ("hidden_size", "n_embd", "d_model"),
            "layers": ("num_hidden_layers", "n_layer", "num_layers"),
            "heads": ("num_attention_heads", "n_head"),
            "ffn_hidden": ("intermediate_size", "n_inner", "ffn_hidden_size"),
            "seq_len": ("max_position_embeddings", "n_positions")}


class DerivedRefusal(Exception):
    """Why a model_type cannot be loaded by its derived policy (the loader reports it as DSF012)."""


def _first(cfg: dict[str, Any], names: tuple[str, ...]) -> Any:
    return next((cfg[n] for n in names if cfg.get(n) is not None), None)


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def derived_keys(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """The model keys of a dense checkpoint whose family only its HF plan places; DerivedRefusal when it
    cannot."""
    mtype = str(cfg.get("model_type"))
    plans = plans_for_type(mtype)
    if plans is None:
        raise DerivedRefusal(f"model_type {mtype!r} is not a causal LM of transformers' auto mapping")
    try:
        derive_policy(plans)
    except PlanRefusal as exc:
        raise DerivedRefusal(f"{exc.message} ({exc.rule})") from None
    moe = plans.ep or any(_positive(cfg.get(k)) and int(cfg[k]) > 1 for k in _MOE_KEYS)
    if moe and mtype not in PROVEN_MOE:
        raise DerivedRefusal(f"model_type {mtype!r} is a mixture of experts: its checkpoint's expert tensors "
                             f"are read for mixtral, qwen2_moe, qwen3_moe and "
                             f"{', '.join(sorted(PROVEN_MOE))} only")
    keys: dict[str, Any] = {"arch": "auto"}
    for key, names in _ALIASES.items():
        value = _first(cfg, names)
        if key == "ffn_hidden" and value is None:
            continue
        if not _positive(value):
            raise DerivedRefusal(f"{path}: {names[0]} is {value!r}, not a positive integer")
        keys[key] = value
    vocab = cfg.get("vocab_size")
    if not _positive(vocab):
        raise DerivedRefusal(f"{path}: vocab_size is {vocab!r}, not a positive integer")
    keys["vocab"] = vocab
    kv = cfg.get("num_key_value_heads", cfg.get("num_kv_heads"))
    keys["kv_heads"] = kv if _positive(kv) else keys["heads"]
    head_dim = cfg.get("head_dim")
    keys["head_dim"] = head_dim if _positive(head_dim) else keys["hidden"] // keys["heads"]
    keys["tied_embeddings"] = bool(cfg.get("tie_word_embeddings", True))
    act = str(cfg.get("hidden_act", cfg.get("activation_function", "silu")))
    keys["activation"] = "swiglu" if act in ("silu", "swish") else "gelu"
    keys["position"] = "rope"
    if moe:
        keys["moe"] = _moe_section(cfg, path)
    return keys


def _moe_section(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """The moe: keys of a PROVEN_MOE config.json: every layer sparse, the experts intermediate_size wide."""
    experts = _first(cfg, _MOE_KEYS)
    top_k = cfg.get("num_experts_per_tok")
    ffn = _first(cfg, ("moe_intermediate_size", "intermediate_size"))
    for name, value in (("num_experts", experts), ("num_experts_per_tok", top_k), ("intermediate_size", ffn)):
        if not _positive(value):
            raise DerivedRefusal(f"{path}: {name} is {value!r}, not a positive integer")
    step, dense = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
    layers = cfg.get("num_hidden_layers")
    moe_layers = cfg.get("moe_layers")  # Llama 4: the sparse layers' indices (interleave_moe_layer_step
                                        # apart)
    if isinstance(moe_layers, list) and isinstance(layers, int) and sorted(moe_layers) != list(range(layers)):
        dense = [i for i in range(layers) if i not in moe_layers]
    if step != 1 or dense or cfg.get("first_k_dense_replace") or cfg.get("interleave_moe_layer_step", 1) != 1:
        raise DerivedRefusal(f"{path}: dense MLP layers between the sparse ones are not loaded")
    moe: dict[str, Any] = {"experts": experts, "top_k": top_k, "ffn_hidden": ffn, "every": 1}
    if cfg.get("model_type") == "llama4_text":  # every Llama 4 MoE block has one shared expert as wide as the
                                                # others
        moe |= {"shared_experts": 1, "shared_ffn_hidden": ffn}
    return moe


def derived_window(cfg: dict[str, Any]) -> int | None:
    """The sliding window of a derived family: any positive ``sliding_window`` config.json states counts as
    used.

    Families differ in how they switch it on (every layer, alternate layers, ``layer_types``); taking
    every stated window as applied refuses a few jobs that would have been exact, never runs one that is not.
    """
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    sliding_layers = isinstance(layer_types, list) and "sliding_attention" in layer_types
    if window is None or (cfg.get("use_sliding_window") is False and not sliding_layers):
        return None
    return window if _positive(window) else 0
