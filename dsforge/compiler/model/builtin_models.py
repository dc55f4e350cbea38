"""Which model specs dsforge builds itself (no `model.factory`, no `model.pretrained`): torch-free, so
validate refuses what dsforge.runtime.models would refuse at compile or at start-up, with the same words.

dsforge builds three HF families from the job's model keys: GPT-2, Llama (Qwen2 when q, k and v carry
biases) and Mixtral. Each HF config can express some shapes only; ``builtin_family`` names the family an
`arch` builds and ``builtin_problem`` the first thing the family cannot express.
"""

from __future__ import annotations

from dsforge.compiler.model.resolved import ResolvedModel

#: The archs dsforge builds from the model keys; the others need model.factory or model.pretrained.
BUILT_IN = ("gpt2", "llama", "mixtral")


class NotBuiltIn(ValueError):
    """The spec names no family dsforge builds itself (the message says what to write instead)."""


def builtin_family(model: ResolvedModel) -> str:
    """The HF family that builds this spec: its arch, or for `auto` the one its fields describe."""
    if model.arch in BUILT_IN:
        return model.arch
    if model.arch == "custom":
        raise NotBuiltIn("arch: custom needs model.factory (\"package.module:callable\") to build the model")
    if model.arch != "auto":  # the other families' rewrite policies exist; dsforge builds none of them itself
        raise NotBuiltIn(f"arch: {model.arch} is built from model.factory (\"package.module:callable\") or "
                         f"an HF directory (model.pretrained); dsforge "
                         "builds only gpt2, llama and mixtral itself")
    if model.moe is not None:
        return "mixtral"
    return "gpt2" if model.activation == "gelu" and model.position == "learned" else "llama"


def _gpt2(model: ResolvedModel) -> str | None:
    if model.kv_heads != model.heads:
        return f"GPT-2 has no grouped-query attention (kv_heads={model.kv_heads}, heads={model.heads})"
    if model.activation != "gelu" or model.position != "learned":
        return "GPT-2 uses a GELU MLP and learned positions"
    if model.moe is not None:
        return "GPT-2 has no MoE layers (use a factory)"
    if model.head_dim * model.heads != model.hidden:
        return (f"GPT-2's fused QKV is hidden x 3 hidden (head_dim {model.head_dim} x heads {model.heads} != "
                f"hidden {model.hidden})")
    if not model.qkv_bias:
        return "GPT-2's fused QKV always carries a bias (qkv_bias: false)"
    return None


def _llama_or_mixtral(arch: str, model: ResolvedModel) -> str | None:
    if model.activation != "swiglu" or model.position != "rope":
        return "Llama-style models use a SwiGLU MLP and RoPE"
    if arch == "llama":
        return "Llama has no MoE layers (use arch: mixtral)" if model.moe is not None else None
    if model.moe is None or model.moe.every != 1:
        return "it needs `moe:` with every: 1 (every layer is a sparse MoE block)"
    if model.qkv_bias:
        return "Mixtral's q, k and v projections have no biases (qkv_bias: false)"
    return None


def builtin_problem(model: ResolvedModel) -> tuple[str, str] | None:
    """(family, what it cannot express) for a spec dsforge builds itself but whose family cannot hold it; None
    when it can (or when a factory or a pretrained directory builds the model instead)."""
    if model.factory or model.pretrained:
        return None
    arch = builtin_family(model)
    problem = family_problem(arch, model)
    return (arch, problem) if problem else None


def family_problem(arch: str, model: ResolvedModel) -> str | None:
    """What the HF ``arch`` config (gpt2, llama or mixtral) cannot express of the spec, or None."""
    return _gpt2(model) if arch == "gpt2" else _llama_or_mixtral(arch, model)
