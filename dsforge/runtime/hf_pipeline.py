"""Pipeline stages of an HF causal LM from its own ``base_model_pp_plan``, with the base model's forward glue.

The plan names the pieces (``embed_tokens``, ``layers``, ``norm``; the head's ``lm_head``); what HF's
forward does between them is not in the plan, so this module reproduces the glue that transformers'
decoder-only models share: position ids from 0, rotary embeddings recomputed from them on each stage
(per layer type where the rotary module takes one), the causal or sliding-window mask per layer type
(transformers.masking_utils, the functions the models call), and the head on the final norm's output.
Anything else a family's forward does between the pieces (an embedding multiplier applied outside the
embedding module, logit scaling or soft-capping in the head, per-layer extra inputs) is not guessed:
``glue_problem`` runs a tiny random copy of the family (same config, 128-token vocabulary, one layer per
layer type) through the whole HF forward and through these stages, in float64, and a difference
refuses the family (the planner reports it with the rewrite's rule, DSF607).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import Tensor, nn

from dsforge.compiler.model.hf_plans import HfPlans, pp_plan_problem_of

#: float64 stage chain against the whole forward: only re-association, never a missing operation.
GLUE_RTOL = 1e-9


def pp_plan_problem(model: nn.Module) -> str | None:
    """Why the model's classes state no pipeline plan of the shape these stages build (None when they do)."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None) or getattr(type(config), "base_model_pp_plan", None)
    # the installed classes' plan, judged by the same check validate runs on the generated table (DSF173)
    return pp_plan_problem_of(HfPlans(str(getattr(config, "model_type", "?")), pp=dict(plan or {})))


def base_prefix(model: nn.Module) -> str:
    """The causal LM's attribute holding the base model (``model`` for almost every family)."""
    prefix = str(getattr(model, "base_model_prefix", "") or "model")
    return prefix if hasattr(model, prefix) else "model"


def layer_mask(config: Any, hidden: Tensor, position_ids: Tensor, sliding: bool) -> Any:
    """The attention mask HF's base model gives a layer over ``position_ids`` (causal, or sliding-window
    causal): None where the attention kernel is causal by itself (sdpa, flash), a tensor where it is not
    (eager attends everywhere when given no mask)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    make = create_sliding_window_causal_mask if sliding else create_causal_mask
    shaped = hidden.new_empty(hidden.shape[0], position_ids.shape[-1], 1)  # the mask's batch, length, dtype
    return make(config=config, inputs_embeds=shaped, attention_mask=None, cache=None,
                position_ids=position_ids)


class HfDecoderStage(nn.Module):
    """One HF decoder layer on hidden states, given its mask and rotary positions as the base model would."""

    def __init__(self, layer: nn.Module, config: Any, layer_type: str, rotary: nn.Module | None) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary
        self.config, self.layer_type = config, layer_type
        self.typed_rotary = (rotary is not None
                             and "layer_type" in inspect.signature(rotary.forward).parameters)

    def forward(self, hidden: Tensor) -> Tensor:
        """The layer's output hidden states (contiguous: DeepSpeed sends them point to point)."""
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = layer_mask(self.config, hidden, position_ids, self.layer_type == "sliding_attention")
        kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": position_ids}
        if self.rotary is not None:
            kwargs["position_embeddings"] = (self.rotary(hidden, position_ids, self.layer_type)
                                             if self.typed_rotary else self.rotary(hidden, position_ids))
        out = self.layer(hidden, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return out.contiguous()


def layer_types(config: Any, layers: int) -> list[str]:
    """Each decoder layer's attention type as the config states it (full attention where it states none)."""
    types = getattr(config, "layer_types", None)
    return list(types)[:layers] if isinstance(types, (list, tuple)) and len(types) >= layers \
        else ["full_attention"] * layers


def hf_pieces(model: nn.Module) -> tuple[nn.Module, list[HfDecoderStage], nn.Module, nn.Module]:
    """The embedding, one stage per decoder layer, the final norm and the LM head of an HF causal LM."""
    base = model.get_submodule(base_prefix(model))
    config = model.config
    rotary = getattr(base, "rotary_emb", None)
    decoders = list(base.get_submodule("layers"))
    types = layer_types(config, len(decoders))
    stages = [HfDecoderStage(layer, config, t, rotary) for layer, t in zip(decoders, types, strict=True)]
    embed, norm = base.get_submodule("embed_tokens"), base.get_submodule("norm")
    return embed, stages, norm, model.get_submodule("lm_head")


def staged_logits(model: nn.Module, ids: Tensor) -> Tensor:
    """Logits of the model computed piece by piece, as the pipeline stages compute them."""
    embed, stages, norm, head = hf_pieces(model)
    hidden = embed(ids)
    for stage in stages:
        hidden = stage(hidden)
    return head(norm(hidden))


def _tiny_copy(model: nn.Module) -> nn.Module:
    """A random float64 model of the same family and widths: 128-token vocabulary, every layer type kept."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    layers = int(config.num_hidden_layers)
    types = layer_types(config, layers)
    keep = sorted({types.index(t) for t in types} | {0, min(1, layers - 1)})
    keep = list(range(max(keep) + 1))
    config.num_hidden_layers = len(keep)
    if isinstance(getattr(config, "layer_types", None), (list, tuple)):
        config.layer_types = [types[i] for i in keep]
    config.vocab_size = 128
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(config, name, None), int) and getattr(config, name) >= 128:
            setattr(config, name, 0)
    torch.manual_seed(0)
    with torch.device("cpu"):
        # experts by HF's eager loop: torch's grouped matmul takes no float64, and the loop is the same sum
        tiny = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                experts_implementation="eager")
    return tiny.double().eval()


def _outside_pieces(model: nn.Module) -> str | None:
    """The parameters no pp-plan piece holds (phi4_multimodal's audio and image embedders), which stages would
    drop; None when the pieces hold every one."""
    embed, stages, norm, head = hf_pieces(model)
    held = {id(p) for piece in (embed, *(s.layer for s in stages), norm, head) for p in piece.parameters()}
    base = base_prefix(model)

    def top(name: str) -> str:  # the base model's (or the wrapper's) child the parameter sits in
        inner = name[len(base) + 1:] if base and name.startswith(base + ".") else None
        return f"{base}.{inner.split('.')[0]}" if inner else name.split(".")[0]

    outside = sorted({top(n) for n, p in model.named_parameters() if id(p) not in held})
    if not outside:
        return None
    more = " ..." if len(outside) > 4 else ""
    return (f"`{model.config.model_type}` holds parameters outside its base_model_pp_plan pieces "
            f"(embed_tokens, layers, norm, lm_head): {', '.join(outside[:4])}{more}; pipeline stages "
            f"would not carry them")


def glue_problem(model: nn.Module) -> str | None:
    """Why stages built from the pp plan would not compute the model's forward (None when they do exactly).

    The check runs a tiny float64 copy (``_tiny_copy``) through HF's whole forward and through
    ``staged_logits`` on 2 x 12 random tokens, so it holds for the family's forward code, not for one
    checkpoint's values.
    """
    problem = pp_plan_problem(model) or _outside_pieces(model)
    if problem is not None:
        return problem
    mtype = model.config.model_type
    try:
        tiny = _tiny_copy(model)
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            whole = tiny(input_ids=ids).logits
            staged = staged_logits(tiny, ids)
    except Exception as exc:  # noqa: BLE001 - any failure of the family's code on the stage inputs is a refusal
        return (f"the stages of `{mtype}` from its base_model_pp_plan cannot run its layers: "
                f"{type(exc).__name__}: {exc}"[:400])
    scale = float(whole.abs().max()) or 1.0
    diff = float((whole - staged).abs().max()) / scale
    if not diff <= GLUE_RTOL:
        return (f"the forward of `{mtype}` does something between its base_model_pp_plan pieces "
                f"(embed_tokens, layers, norm, lm_head) that the stage glue (positions, rotary, causal or "
                f"sliding masks) does not reproduce: a stage-split tiny copy differs from the whole forward "
                f"by {diff:.1e} of the logits' scale (e.g. an embedding multiplier outside the embedding, "
                f"logit scaling or soft-capping)")
    return None
