"""Context parallelism inside HF transformers models: their attention call routed to ring or Ulysses
attention.

HF models (gpt2, llama, mixtral in transformers 5) look their attention function up by name in
``ALL_ATTENTION_FUNCTIONS`` (``config._attn_implementation``) and build the causal mask through the
matching entry of ``ALL_MASK_ATTENTION_FUNCTIONS``. dsforge registers one name, ``dsforge_cp``: its
mask function returns no mask (ring and Ulysses apply the causal mask themselves, over the global
positions), and its attention function hands the projected q, k, v of this rank's tokens to the
context-parallel layer attached to the attention module. Positions come in as ``position_ids`` so
RoPE and learned position tables see the global token positions (dsforge.runtime.data lays them out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dsforge.runtime.attention import UlyssesAttention, ring_attention
from dsforge.runtime.errors import RuntimeRefusal

NAME = "dsforge_cp"
_ATTR = "_dsforge_context_parallel"
_SIZE = "_dsforge_context_parallel_size"


class ContextParallelError(RuntimeRefusal, ValueError):
    """The model has no attention module the context-parallel hook can reach."""


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
               scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """HF attention interface: [b, h, s_local, d] q/k/v -> ([b, s_local, h, d], no weights)."""
    impl: Callable[[Tensor, Tensor, Tensor, float | None], Tensor] | None = getattr(module, _ATTR, None)
    if impl is None:
        raise ContextParallelError(f"{type(module).__name__} runs with attn_implementation {NAME!r} but has "
                                   f"no context-parallel layer attached "
                                   "(install_context_parallel was not called on it)")
    if dropout:
        raise ContextParallelError("context-parallel attention has no attention dropout; set it to 0")
    # Ring and Ulysses attention are plain causal softmax attention: anything else the model asks for
    # would be dropped silently, so it is refused (Gemma's soft-capping, a window shorter than the sequence).
    # check_plain_causal refuses these models when the rank starts; this is the guard behind it.
    if kwargs.get("softcap") is not None:
        raise ContextParallelError(f"{type(module).__name__} soft-caps its attention scores (softcap="
                                   f"{kwargs['softcap']}); context-parallel attention does not: use cp 1")
    window = kwargs.get("sliding_window")
    total = query.shape[2] * getattr(module, _SIZE, 1)
    if window is not None and window < total:
        raise ContextParallelError(f"{type(module).__name__} attends within a sliding window of {window} "
                                   f"tokens, shorter than the sequence of {total}; context-parallel "
                                   f"attention is fully causal: use cp 1 or "
                                   f"a sequence no longer than the window")
    return impl(query, key, value, scaling), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask interface: none (the context-parallel layers mask causally over global positions)."""
    return


def register() -> None:
    """Register the ``dsforge_cp`` attention and mask functions with transformers (idempotent)."""
    try:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
    except ImportError as exc:  # both registries exist from transformers 4.53 on
        raise ContextParallelError(f"context parallelism needs transformers >= 4.53 (its attention and mask "
                                   f"registries): {exc}") from exc
    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _no_mask)


def _ring(group: dist.ProcessGroup) -> Callable[[Tensor, Tensor, Tensor, float | None], Tensor]:
    def attend(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
        return ring_attention(q, k, v, group, causal=True, scale=scale, load_balanced=True).transpose(1, 2)
    return attend


def _ulysses(group: dist.ProcessGroup) -> tuple[nn.Module,
                                                Callable[[Tensor, Tensor, Tensor, float | None], Tensor]]:
    scales: list[float | None] = [None]

    def local(q: Tensor, k: Tensor, v: Tensor, *args: object, **kwargs: object) -> Tensor:
        # [b, s, h, d] after the all-to-all: the whole sequence, this rank's heads.
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=scales[0],
                                             enable_gqa=k.shape[2] != q.shape[2])
        return out.transpose(1, 2)

    layer = UlyssesAttention(group, local_attention=local)

    def attend(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
        scales[0] = scale
        return layer(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return layer, attend


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that call HF's attention interface (their class name ends in ``Attention``)."""
    return [(n, m) for n,
            m in model.named_modules() if type(m).__name__.endswith("Attention") and hasattr(m, "config")]


def _window_of(module: nn.Module) -> Any:
    """The sliding window an HF attention module passes to the attention call (None: full causal)."""
    if hasattr(module, "sliding_window"):  # Gemma2/3, Qwen2/3: per layer, None on the full-attention layers
        return module.sliding_window
    return getattr(module.config, "sliding_window", None)  # Mistral, Phi3: the config's, on every layer


def plain_causal_problems(model: nn.Module, seq_len: int) -> list[str]:
    """What the model's attention computes beyond plain causal softmax attention over ``seq_len`` tokens.

    Ring and Ulysses attention compute exactly that and nothing more, so each entry (soft-capped
    scores, a sliding window shorter than the sequence, attention dropout) names something a
    context-parallel run would drop. Only the modules' attributes are read: a meta-device model will do,
    which is how compile checks a job (DSF144) before any rank starts.
    """
    found: dict[str, list[str]] = {}
    for name, module in attention_modules(model):
        softcap = getattr(module, "attn_logit_softcapping", None)
        if softcap is not None:
            found.setdefault(f"soft-capped attention scores (attn_logit_softcapping={softcap})",
                             []).append(name)
        window = _window_of(module)
        if isinstance(window, int) and not isinstance(window, bool) and window < seq_len:
            found.setdefault(f"a sliding window of {window} tokens (the sequence has {seq_len})",
                             []).append(name)
        dropout = getattr(module, "attention_dropout", 0.0)
        if isinstance(dropout, (int, float)) and dropout > 0:
            found.setdefault(f"attention dropout {dropout}", []).append(name)
        # GPT-OSS: a learnt logit per head in the softmax
        if isinstance(getattr(module, "sinks", None), Tensor):
            found.setdefault("attention sinks (a learnt logit per head joins each softmax)", []).append(name)
    from dsforge.runtime.rewrite.walk import group_names  # the rewrite package imports this module

    return [f"{what} in {', '.join(group_names(names))}" for what, names in found.items()]


def check_plain_causal(model: nn.Module, seq_len: int) -> None:
    """Refuse, when the rank starts, a model whose attention context parallelism would change (DSF144)."""
    problems = plain_causal_problems(model, seq_len)
    if problems:
        raise ContextParallelError("context-parallel attention is plain causal softmax attention, but the "
                                   f"model has {'; '.join(problems)}: use cp 1")


def install_context_parallel(model: nn.Module, kind: str, group: dist.ProcessGroup) -> int:
    """Route every attention of an HF model through ring (``kind="ring"``) or Ulysses attention over
    ``group``.

    Returns the number of attention modules rewired; raises ContextParallelError when there are none.
    """
    if kind not in ("ring", "ulysses"):
        raise ContextParallelError(f"context_parallel.kind must be ring or ulysses, not {kind!r}")
    found = attention_modules(model)
    if not found:
        raise ContextParallelError(f"{type(model).__name__} has no HF attention module (class name ending in "
                                   "'Attention' with a config); context parallelism needs one")
    register()
    for _, module in found:
        if kind == "ring":
            impl = _ring(group)
        else:
            layer, impl = _ulysses(group)
            module.add_module("context_parallel", layer)  # no parameters; kept for repr and device moves
        setattr(module, _ATTR, impl)
        setattr(module, _SIZE, dist.get_world_size(group))
    configs: list[Any] = [m.config for _, m in found] + [getattr(model, "config", None)]
    for cfg in {id(c): c for c in configs if c is not None}.values():
        cfg._attn_implementation = NAME
    return len(found)
