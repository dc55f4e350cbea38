"""Building the job's model: an HF transformers gpt2 / llama / mixtral from the model spec, or
`model.factory`.

Weights are random (seeded); on the ``meta`` device nothing is allocated, which is how the
compiler plans even a 405B model. The HF configs are derived from the spec field by field so the
parameter count matches ``dsforge.compiler.model.params`` exactly (dropout off, sdpa attention so a
missing mask still means causal).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from dsforge.compiler.model.builtin_models import NotBuiltIn, builtin_family, family_problem
from dsforge.compiler.model.params import padded_vocab
from dsforge.compiler.model.resolved import ResolvedModel, resolve_model
from dsforge.compiler.spec.schema import ModelSpec
from dsforge.runtime.errors import ModelBuildError


def family(model: ResolvedModel) -> str:
    """The HF family that builds this spec: its arch, or for `auto` the one its fields describe."""
    try:
        return builtin_family(model)
    except NotBuiltIn as exc:
        raise ModelBuildError(str(exc)) from None


def _require(arch: str, model: ResolvedModel) -> None:
    """Refuse a spec the HF config of ``arch`` cannot express (validate refuses the same first: DSF145)."""
    what = family_problem(arch, model)
    if what:
        raise ModelBuildError(f"the HF {arch} model cannot express this spec: {what}")


def _common(model: ResolvedModel, tp: int) -> dict[str, Any]:
    return {"vocab_size": padded_vocab(model, tp), "tie_word_embeddings": model.tied_embeddings,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "use_cache": False}


def hf_config(model: ModelSpec | ResolvedModel, tp: int = 1) -> Any:
    """The transformers config of the spec (vocabulary padded for ``tp`` as the compiler counts it)."""
    model = resolve_model(model)
    arch = family(model)
    _require(arch, model)
    kv, ffn = model.kv_heads, model.ffn_hidden
    cfg: Any
    if arch == "gpt2":
        from transformers import GPT2Config
        cfg = GPT2Config(n_positions=model.seq_len, n_embd=model.hidden, n_layer=model.layers,
                         n_head=model.heads, n_inner=ffn, activation_function="gelu_new", resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, **_common(model, tp))
    else:
        common = dict(hidden_size=model.hidden, num_hidden_layers=model.layers,
                      num_attention_heads=model.heads, num_key_value_heads=kv, head_dim=model.head_dim,
                      max_position_embeddings=model.seq_len, attention_dropout=0.0, **_common(model, tp))
        if arch == "llama" and model.qkv_bias:
            # Llama's attention_bias would bias o_proj too; Qwen2 is Llama with biases on q, k and v only
            from transformers import Qwen2Config
            cfg = Qwen2Config(intermediate_size=ffn, use_sliding_window=False, **common)
        elif arch == "llama":
            from transformers import LlamaConfig
            cfg = LlamaConfig(intermediate_size=ffn, attention_bias=False, mlp_bias=False, **common)
        else:
            from transformers import MixtralConfig
            moe = model.moe
            assert moe is not None  # _require: Mixtral needs `moe:`
            cfg = MixtralConfig(intermediate_size=moe.ffn_hidden, num_local_experts=moe.experts,
                                num_experts_per_tok=moe.top_k, output_router_logits=False, **common)
    cfg._attn_implementation = "sdpa"
    return cfg


def model_config(model: ModelSpec | ResolvedModel, tp: int = 1) -> Any:
    """The transformers config that builds the job's model: the pretrained directory's, else the spec's."""
    model = resolve_model(model)
    if model.pretrained:
        from dsforge.runtime.pretrained import hf_config as pretrained_config

        return pretrained_config(model.pretrained)
    return hf_config(model, tp)


def _from_config(cfg: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from dsforge.runtime.attention_impl import attention_of

    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attention_of(cfg))


def build_skeleton(model: ModelSpec | ResolvedModel, tp: int = 1) -> nn.Module:
    """The job's HF model with every parameter on the meta device and its computed buffers real (nothing
    allocated)."""

    from dsforge.runtime.materialize import params_on_meta

    with params_on_meta(), without_hf_zero3_init():
        return _from_config(model_config(model, tp))


@contextlib.contextmanager
def without_hf_zero3_init() -> Iterator[None]:
    """Inside: transformers does not build models under ``deepspeed.zero.Init``.

    Once an HF DeepSpeed config with ZeRO-3 exists (TrainingArguments, accelerate's DeepSpeedPlugin with
    zero3_init_flag), ``from_config`` wraps construction in zero.Init (``is_deepspeed_zero3_enabled``), which
    copies every new parameter to its device and partitions it: a meta skeleton cannot be copied ("Cannot copy
    out of meta tensor"). dsforge partitions each parameter itself as it is filled
    (dsforge.runtime.rank_build.zero3_partitioner), so the skeleton is built with HF's config reference
    unset, and the reference is restored afterwards.
    """
    try:
        from transformers.integrations import deepspeed as hf_ds
    except ImportError:
        yield
        return
    saved = getattr(hf_ds, "_hf_deepspeed_config_weak_ref", None)
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


def seeded_init(skeleton: nn.Module, seed: int) -> Any:
    """The seeded initialisation of a dense HF model (dsforge.runtime.materialize.SeededInit): HF's scheme
    (N(0, initializer_range), GPT-2's residual projections scaled by 1/sqrt(2 x layers)) drawn per
    parameter."""
    from dsforge.runtime.materialize import SeededInit, init_specs

    cfg: Any = getattr(skeleton, "config", None)
    std = float(getattr(cfg, "initializer_range", 0.02))
    scaled, scaled_std = (), None
    if getattr(cfg, "model_type", None) == "gpt2":
        scaled, scaled_std = ("c_proj.weight",), std / (2 * cfg.n_layer) ** 0.5
    return SeededInit(seed, init_specs(skeleton, std, scaled, scaled_std))


def build_hf(model: ModelSpec | ResolvedModel, device: str = "meta", tp: int = 1,
             seed: int | None = None) -> nn.Module:
    """The HF causal-LM of the spec on ``device``, its weights drawn from ``seed`` (or a fresh one).

    The values are those a sharded build gives each rank's slices (dsforge.runtime.materialize), so this
    dense model is the single-process reference of every layout.
    """

    if device == "meta":
        with torch.device(device), without_hf_zero3_init():
            return _from_config(model_config(model, tp))
    from dsforge.runtime.materialize import materialize_dense

    skeleton = build_skeleton(model, tp)
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    materialize_dense(skeleton, seeded_init(skeleton, seed))
    return skeleton.to(device).float()


def load_factory(path: str) -> Callable[..., Any]:
    """The callable named by ``package.module:callable``, with an error that says which part failed."""
    mod_name, _, attr = path.partition(":")
    if not mod_name or not attr:
        raise ModelBuildError(f"model.factory {path!r} must look like \"package.module:callable\"")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as exc:  # an import can fail any way; report it as the factory's problem
        raise ModelBuildError(f"model.factory {path!r}: cannot import module {mod_name!r}: {exc}") from exc
    fn = getattr(mod, attr, None)
    if fn is None:
        raise ModelBuildError(f"model.factory {path!r}: module {mod_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ModelBuildError(f"model.factory {path!r}: {attr!r} is a {type(fn).__name__}, not a callable")
    return fn


def call_factory(path: str, model: ResolvedModel, device: str = "meta", seed: int | None = None) -> nn.Module:
    """Build the module with the factory on ``device``; a factory that takes an argument is given the model
    (a ResolvedModel: the job's model keys with every default filled)."""
    fn = load_factory(path)
    try:
        takes_spec = bool(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins without a signature: call without arguments
        takes_spec = False
    if seed is not None:
        torch.manual_seed(seed)
    try:
        with torch.device(device):
            module = fn(model) if takes_spec else fn()
    except Exception as exc:  # the user's code: wrap so the job says which factory failed
        raise ModelBuildError(f"model.factory {path!r} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(module, nn.Module):
        raise ModelBuildError(f"model.factory {path!r} returned a "
                              f"{type(module).__name__}, not a torch nn.Module")
    return module


def build_model(model: ModelSpec | ResolvedModel, device: str = "meta", tp: int = 1,
                seed: int | None = None) -> nn.Module:
    """The job's model: the factory's module when `model.factory` is set, else the HF model of the spec."""
    model = resolve_model(model)
    if model.factory:
        return call_factory(model.factory, model, device, seed)
    return build_hf(model, device, tp, seed)
