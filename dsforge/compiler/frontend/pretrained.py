"""`model.pretrained`: the `model:` keys of an HF model directory, read from its config.json alone (no torch).

The loader calls ``expand_pretrained`` after presets are merged and before the schema sees the job:
every model key the job does not state is taken from config.json, and a key it states (or its
preset supplies) that disagrees with config.json is an error naming both values (DSF013), never a
silent choice of one. Only config.json and the names of the weight files are read, so validate,
explain and compile plan a 70B checkpoint in milliseconds; the runtime (dsforge.runtime.pretrained)
reads each rank's slices of the weights.

Supported families are those whose HF modules the rewrite policies place and whose tensors the
runtime reads: llama, mistral and qwen2 (the `llama` policy: the same module names; qwen2's q/k/v
biases are cut with their weights, and stated as model.qkv_bias), gpt2, qwen3 (per-head q/k norms),
and the MoE families mixtral, qwen2_moe (a gated shared expert) and qwen3_moe, whose per-expert
tensors are read as the stacks transformers builds of them, each rank only its experts' (see
dsforge.runtime.pretrained). A head_dim other than hidden / heads (Qwen3-style widths) fills
model.head_dim. A sliding window is accepted where it does not bite: when it covers model.seq_len,
attention over the sequence is exactly full causal attention (DSF016 says so); a shorter window is
refused (DSF012). A router that trains otherwise than dsforge's MoE layers (jitter noise, an
auxiliary loss added to the loss) is refused (DSF015).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsforge.compiler.frontend.job_paths import base_directory
from dsforge.compiler.frontend.pretrained_derived import (
    PROVEN_MOE,
    DerivedRefusal,
    derived_keys,
    derived_window,
)
from dsforge.compiler.frontend.source import SourceMap
from dsforge.diagnostics import Diagnostic, Severity

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
MAX_CONFIG_BYTES = 4 << 20  # config.json files are a few kB; an index of 10^5 shards is ~10 MB (read at
                            # runtime)
KEY = ("model", "pretrained")

#: model_type -> the dsforge arch whose rewrite policy places its modules.
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gpt2": "gpt2", "mixtral": "mixtral",
            "qwen3": "qwen3", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe"}
#: Families whose MoE blocks route tokens to experts (their config.json keys for the moe: section differ).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
#: Families that bias q, k and v (and not o_proj): Qwen2 and Qwen2-MoE, always.
_QKV_BIASED = ("qwen2", "qwen2_moe")
#: Families whose window applies only with use_sliding_window (or a sliding layer in layer_types).
_OPT_IN_WINDOW = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
_SWIGLU_ACTS = ("silu", "swish")
_GELU_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast")


@dataclass
class PretrainedError(Exception):
    """config.json (or the directory) cannot give the model's keys; ``rule`` is the id to report."""

    rule: str
    message: str
    fix: str


def resolve_directory(value: str, smap: SourceMap) -> Path:
    """The directory `model.pretrained` names: relative to the job file that wrote it, `~` expanded."""
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = base_directory(smap.locate(KEY, value=True).file) / path
    return Path(os.path.normpath(path))


def read_config(directory: Path) -> dict[str, Any]:
    """config.json of an HF model directory as a dict; PretrainedError (DSF011) when it cannot be read."""
    fix = "point model.pretrained at a directory written by `save_pretrained` (config.json and the weights)"
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is not a directory"
        raise PretrainedError("DSF011", f"model.pretrained {directory} {what}", fix)
    path = directory / CONFIG
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise PretrainedError("DSF011", f"model.pretrained: cannot read {path} ({exc.strerror or exc})",
                              fix) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise PretrainedError("DSF011", f"{path} is over {MAX_CONFIG_BYTES >> 20} MiB: not an HF config", fix)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise PretrainedError("DSF011", f"{path} is not valid JSON ({exc})", fix) from None
    if not isinstance(doc, dict):
        raise PretrainedError("DSF011", f"{path} holds a {type(doc).__name__}, not a JSON object", fix)
    return doc


def weight_files(directory: Path) -> list[Path]:
    """The weight files of the directory (an index's shards, or the single file); DSF014 when there are none.

    Only names and the index are read: an index naming a shard that is missing is refused here,
    before a job is launched, rather than on every rank at start-up.
    """
    for index_name in (SAFETENSORS_INDEX, TORCH_INDEX):
        index = directory / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                names = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise PretrainedError("DSF014", f"{index} is not an HF weight index "
                                                f"({type(exc).__name__}: {exc})",
                                      "rewrite the checkpoint with `save_pretrained`") from None
            missing = [n for n in names if not (directory / str(n)).is_file()]
            if missing:
                raise PretrainedError("DSF014", f"{index} names {len(missing)} shard(s) that are not in "
                                      f"{directory}: {', '.join(map(str, missing[:4]))}",
                                      "copy the missing shards next to the index")
            return [directory / str(n) for n in names]
    for single in (SAFETENSORS, TORCH_BIN):
        if (directory / single).is_file():
            return [directory / single]
    raise PretrainedError("DSF014", f"model.pretrained {directory} holds no weights ({SAFETENSORS}, "
                          f"{SAFETENSORS_INDEX}, {TORCH_BIN} or {TORCH_INDEX})",
                          "save the model there with `save_pretrained`, "
                          "or point model.pretrained at its directory")


def _int(cfg: dict[str, Any], key: str, path: Path) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PretrainedError("DSF012", f"{path}: {key} is {value!r}, not a positive integer",
                              "use an HF config.json of a supported family")
    return value


def model_keys(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """The job-file `model:` keys config.json describes; DSF012 for a model dsforge cannot express exactly."""
    mtype = cfg.get("model_type")
    if mtype not in FAMILIES:
        if mtype in PROVEN_MOE:
            router = router_problem(cfg)
            if router is not None:
                raise PretrainedError("DSF015", f"{path}: {router[0]}", router[1])
        try:  # a family only its own HF tp plan places (dsforge.compiler.frontend.pretrained_derived)
            return derived_keys(cfg, path)
        except DerivedRefusal as why:
            raise PretrainedError("DSF012", f"{path}: model_type {mtype!r} is not a family dsforge can "
                                  f"rewrite (hand-written: {', '.join(sorted(FAMILIES))}; "
                                  f"by its HF plan: {why})",
                                  "use a checkpoint of a supported family, or model.factory with `rewrite:` "
                                  "rules for another") from None
    arch = FAMILIES[str(mtype)]
    if arch in MOE_FAMILIES:
        router = router_problem(cfg)
        if router is not None:
            raise PretrainedError("DSF015", f"{path}: {router[0]}", router[1])
    unsupported = _unsupported(cfg, str(mtype))
    if unsupported:
        raise PretrainedError("DSF012", f"{path}: {unsupported}; dsforge's "
                                        f"model keys cannot describe it exactly",
                              "use a checkpoint without that feature")
    if arch == "gpt2":
        act = cfg.get("activation_function", "gelu_new")
        if act not in _GELU_ACTS:
            raise PretrainedError("DSF012", f"{path}: activation_function {act!r} is not a GELU",
                                  "use a checkpoint with a GELU MLP")
        hidden = _int(cfg, "n_embd", path)
        inner = cfg.get("n_inner")
        return {"arch": arch, "layers": _int(cfg, "n_layer", path), "hidden": hidden,
                "heads": _int(cfg, "n_head", path), "kv_heads": _int(cfg, "n_head", path),
                "head_dim": hidden // _int(cfg, "n_head", path), "qkv_bias": True,
                "ffn_hidden": inner if isinstance(inner, int) and inner > 0 else 4 * hidden,
                "vocab": _int(cfg, "vocab_size", path), "seq_len": _int(cfg, "n_positions", path),
                "tied_embeddings": bool(cfg.get("tie_word_embeddings", True)), "activation": "gelu",
                "position": "learned"}
    act = cfg.get("hidden_act", "silu")
    if act not in _SWIGLU_ACTS:
        raise PretrainedError("DSF012", f"{path}: hidden_act {act!r}: dsforge's {arch} models use a SwiGLU "
                              f"MLP (silu)", "use a checkpoint with a SiLU-gated MLP")
    heads, hidden = _int(cfg, "num_attention_heads", path), _int(cfg, "hidden_size", path)
    # transformers takes head_dim = hidden_size / num_attention_heads when config.json leaves it out (or null)
    head_dim = _int(cfg, "head_dim", path) if cfg.get("head_dim") is not None else hidden // heads
    keys: dict[str, Any] = {
        "arch": arch, "layers": _int(cfg, "num_hidden_layers", path), "hidden": hidden, "heads": heads,
        "kv_heads": _int(cfg, "num_key_value_heads",
                         path) if cfg.get("num_key_value_heads") is not None else heads,
        # Qwen2 biases q, k and v always, Qwen2-MoE unless its qkv_bias says not; the others never
        "head_dim": head_dim, "qkv_bias": mtype in _QKV_BIASED and bool(cfg.get("qkv_bias", True)),
        "vocab": _int(cfg, "vocab_size", path), "seq_len": _int(cfg, "max_position_embeddings", path),
        "tied_embeddings": bool(cfg.get("tie_word_embeddings", False)), "activation": "swiglu",
        "position": "rope"}
    keys["ffn_hidden"] = _int(cfg, "intermediate_size", path)
    if arch == "mixtral":
        keys["moe"] = {"experts": _int(cfg, "num_local_experts", path),
                       "top_k": _int(cfg, "num_experts_per_tok", path), "ffn_hidden": keys["ffn_hidden"],
                       "every": 1}
    elif arch in MOE_FAMILIES:
        keys["moe"] = _qwen_moe(cfg, path, arch)
    return keys


def _qwen_moe(cfg: dict[str, Any], path: Path, arch: str) -> dict[str, Any]:
    """The moe: section of a Qwen2-MoE / Qwen3-MoE config.json (Qwen2-MoE: one gated shared expert).

    Only checkpoints whose every decoder layer is sparse are read: decoder_sparse_step 1 and no
    mlp_only_layers (HF's rule (i + 1) % step == 0 is model.moe.every's, but dsforge's MoE runtime
    is proven on all-sparse stacks only).
    """
    step, dense_layers = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
    if step != 1 or dense_layers:
        raise PretrainedError("DSF012", f"{path}: decoder_sparse_step {step!r}, mlp_only_layers "
                              f"{dense_layers!r}: dense MLP layers between the sparse ones are not loaded",
                              "use a checkpoint whose " "every layer is a sparse MoE block "
                                                        "(decoder_sparse_step 1, mlp_only_layers [])")
    # Qwen3-MoE's transformers config writes num_local_experts, the hub's config.json files num_experts
    experts = _int(cfg, "num_experts" if cfg.get("num_experts") is not None else "num_local_experts", path)
    moe: dict[str, Any] = {"experts": experts, "top_k": _int(cfg, "num_experts_per_tok", path),
                           "ffn_hidden": _int(cfg, "moe_intermediate_size", path), "every": 1}
    if arch == "qwen2_moe":
        moe |= {"shared_experts": 1, "shared_ffn_hidden": _int(cfg, "shared_expert_intermediate_size", path)}
    return moe


def router_problem(cfg: dict[str, Any]) -> tuple[str, str] | None:
    """(what, fix) for a MoE router setting (Mixtral, Qwen-MoE) under which HF would train otherwise than
    dsforge.

    dsforge's MoE layers (HF's own block at ep 1, DeepSpeed's gate under ep > 1: dsforge.runtime.moe)
    route without noise and train on the language-model loss alone; HF multiplies the router's input by
    uniform noise in training when router_jitter_noise > 0, and adds router_aux_loss_coef x the
    load-balancing loss when output_router_logits is true. Mixtral has no capacity: both are dropless.
    """
    jitter = cfg.get("router_jitter_noise", 0.0)
    if not isinstance(jitter, (int, float)) or isinstance(jitter, bool) or jitter != 0:
        return ((f"router_jitter_noise is {jitter!r}: HF multiplies each router input by random noise in "
                 f"training, which dsforge's MoE layers do not (their routing is exact and repeatable)"),
                "set router_jitter_noise to 0.0 in a copy of config.json (Mixtral's own checkpoints use 0.0)")
    coef = cfg.get("router_aux_loss_coef", 0.0)
    if cfg.get("output_router_logits") and coef != 0:
        return ((f"output_router_logits is true with router_aux_loss_coef {coef!r}: HF adds that multiple of "
                 f"the load-balancing loss to the training loss, "
                 f"dsforge trains on the language-model loss alone"),
                ("set output_router_logits to false in a copy of "
                 "config.json (as Mixtral's own checkpoints do)"))
    return None


def sliding_window(cfg: dict[str, Any]) -> int | None:
    """The sliding window (tokens a query sees, itself included) config.json's attention applies, None if
    none.

    Mistral and Mixtral window every layer when ``sliding_window`` is set; the Qwen families only with
    ``use_sliding_window`` (or a ``layer_types`` entry ``sliding_attention``), whatever ``sliding_window``
    says. A value that is not a positive integer is returned as 0, which no sequence fits.
    """
    mtype = cfg.get("model_type")
    window = cfg.get("sliding_window")
    if mtype not in FAMILIES:
        return derived_window(cfg)
    if mtype in _OPT_IN_WINDOW:
        layer_types = cfg.get("layer_types")
        used = bool(cfg.get("use_sliding_window")) or (
            isinstance(layer_types, list) and "sliding_attention" in layer_types)
    else:
        used = mtype in ("mistral", "mixtral") or bool(cfg.get("use_sliding_window"))
    if not used or window is None:
        return None
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else 0


def _unsupported(cfg: dict[str, Any], mtype: str) -> str | None:
    """A config feature the job's model keys (and so the estimates and the plan) cannot state, if any."""
    if int(cfg.get("pretraining_tp", 1) or 1) != 1:
        return f"pretraining_tp {cfg.get('pretraining_tp')} (Llama's sliced linear layers)"
    if mtype in ("llama", "qwen3", "qwen3_moe") and cfg.get("attention_bias"):
        return "attention_bias true (biases on q, k, v and o_proj; model.qkv_bias states q, k and v only)"
    if mtype == "llama" and cfg.get("mlp_bias"):
        return "mlp_bias true (biases on the MLP's projections)"
    if mtype == "gpt2" and cfg.get("add_cross_attention"):
        return "cross-attention layers"
    return None


#: Keys where the job's value may be smaller than config.json's (a shorter training sequence).
_AT_MOST = {"seq_len"}


def _contradictions(stated: dict[str, Any], found: dict[str, Any], cfg_name: str,
                    section: str = "model") -> list[tuple[tuple[str, ...], str]]:
    """(key path, sentence) for each stated key whose value differs from config.json's."""
    out: list[tuple[tuple[str, ...], str]] = []
    for key, want in found.items():
        if key not in stated or stated[key] is None:
            continue
        have = stated[key]
        if key == "moe":
            if not isinstance(have, dict):
                continue
            out += [(("moe", *p), s) for p, s in _contradictions(have, want, cfg_name, f"{section}.moe")]
            continue
        if key == "arch" and have == "auto":
            continue
        if key in _AT_MOST and isinstance(have, int) and not isinstance(have, bool):
            if found.get("position") == "learned" and have != want:
                out.append(((key,), (f"{section}.{key} {have} contradicts {cfg_name}: the checkpoint's "
                                     f"learned position table has {want} rows (n_positions)")))
            elif have > want:
                out.append(((key,), (f"{section}.{key} {have} contradicts {cfg_name}: "
                                     f"max_position_embeddings is {want}")))
            continue
        if have != want:
            out.append(((key,), f"{section}.{key} {have!r} contradicts {cfg_name}, which says {want!r}"))
    if "moe" in stated and stated["moe"] is not None and "moe" not in found:
        out.append((("moe",), f"{section}.moe is set but {cfg_name} describes a dense model"))
    return out


def expand_pretrained(data: dict[str, Any], raw: dict[str, Any],
                      smap: SourceMap) -> tuple[dict[str, Any], list[Diagnostic]]:
    """The merged job data with `model:` filled from config.json, or the diagnostics that prevent it.

    ``raw`` is what the job file (and its bases) wrote, to point a contradiction at the stated key
    or, for a value a preset supplied, at the `preset:` line.
    """
    model = data.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("pretrained"), str) or not model["pretrained"]:
        return data, []  # absent, or a wrong type the schema reports
    directory = resolve_directory(model["pretrained"], smap)
    where = smap.locate(KEY, value=True)
    try:
        cfg = read_config(directory)
        found = model_keys(cfg, directory / CONFIG)
        weight_files(directory)
    except PretrainedError as exc:
        return data, [Diagnostic(exc.rule, Severity.ERROR, exc.message, where, exc.fix, KEY)]
    written = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    diags = []
    for path, sentence in _contradictions(model, found, str(directory / CONFIG)):
        full = ("model", *path)
        stated_here = _written(written, path)
        loc = smap.locate(full, value=True) if stated_here else smap.locate(("model", "preset"), value=True)
        origin = "" if stated_here else f" (from model preset {model.get('preset')!r})"
        diags.append(Diagnostic("DSF013", Severity.ERROR, sentence + origin, loc,
                                f"remove model.{'.'.join(path)} (config.json supplies it) or correct it",
                                full))
    if diags:
        return data, diags
    filled = dict(found)
    moe = found.get("moe")
    for key, value in model.items():
        if key == "moe" and isinstance(value, dict) and isinstance(moe, dict):
            filled["moe"] = {**moe, **value}
        elif value is not None or key not in found:
            filled[key] = value
    window, seq_len = sliding_window(cfg), filled.get("seq_len")
    if window is not None and isinstance(seq_len, int) and window < seq_len:
        stated = _written(written, ("seq_len",))
        loc = smap.locate(("model", "seq_len"), value=True) if stated else where
        said = "" if stated else " (config.json's max_position_embeddings: the job states no seq_len)"
        return data, [Diagnostic("DSF012", Severity.ERROR, f"{directory / CONFIG}: sliding_window {window} "
                                 f"is shorter than model.seq_len {seq_len}{said}: each token would attend to "
                                 f"only the last {window}, which the job's model keys (estimates, context "
                                 f"parallelism) cannot state", loc,
                                 f"set model.seq_len to at most {window}: the window then covers the whole "
                                 f"sequence and attention is exactly full causal attention",
                                 ("model", "seq_len"))]
    return {**data, "model": filled}, []


def _written(section: Any, path: tuple[str, ...]) -> bool:
    node = section
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def checkpoint_dtype(directory: Path) -> str | None:
    """The dtype config.json says the weights are stored in (``torch_dtype`` or ``dtype``), if it says."""
    try:
        cfg = read_config(directory)
    except PretrainedError:
        return None
    value = cfg.get("dtype", cfg.get("torch_dtype"))
    return value if isinstance(value, str) else None
