"""A rewritten HF decoder as DeepSpeed pipeline layers, cut where the plan's partition says.

DeepSpeed's AutoTP does not work inside a PipelineModule, so for TP x PP dsforge shards the
modules itself (dsforge.runtime.rewrite.apply) and hands DeepSpeed a flat layer list: embedding
first, one entry per decoder layer, final norm and LM head last (Narayanan et al. 2021 sec. 2.2;
DeepSpeed runtime/pipe/module.py). A tied LM head is a TiedLayerSpec sharing the embedding stage,
so DeepSpeed all-reduces the tied weight's gradient between the first and last stage. Stage
boundaries come from ``plan.stage_layers``, not from DeepSpeed's own partitioner, so the stages
that run are the stages the compiler estimated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsforge.compiler.deepspeed.ds_settings import pipeline_partitioning
from dsforge.compiler.plan.plan import ResolvedPlan
from dsforge.runtime.groups import ParallelGroups
from dsforge.runtime.layers import VocabParallelEmbedding, VocabParallelLMHead
from dsforge.runtime.rewrite.apply import apply_rewrite
from dsforge.runtime.rewrite.planner import RewriteError, RewritePlan
from dsforge.runtime.rewrite.sequence import SequenceEntry
from dsforge.runtime.stage_structures import STRUCTURES, derived_pipeline


class EmbeddingStage(nn.Module):
    """Token ids -> hidden states; also the tied LM head, so a TiedLayerSpec can share just this table."""

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed
        self.head: VocabParallelLMHead | None = None
        if isinstance(embed, VocabParallelEmbedding):
            self.head = VocabParallelLMHead(embed.embedding_dim, embed.vocab, embed.pg, gather_output=True,
                                            reset=False, dtype=embed.weight.dtype)
            self.head.tie_to(embed)

    def forward(self, ids: Tensor) -> Tensor:
        """Embeddings of the whole sequence (sequence parallelism splits them at the first decoder layer)."""
        return self.embed(ids)

    def logits(self, hidden: Tensor) -> Tensor:
        """Hidden states times the (sharded) embedding table: full-vocabulary logits."""
        if self.head is not None:
            return self.head(hidden)
        return F.linear(hidden, cast(Tensor, self.embed.weight))


def tied_logits(stage: EmbeddingStage, hidden: Tensor) -> Tensor:
    """TiedLayerSpec forward_fn of the last stage: logits through the embedding's weight."""
    return stage.logits(hidden)


class PositionStage(nn.Module):
    """Adds learned positions (and embedding dropout) to the whole-sequence embeddings."""

    def __init__(self, pos: nn.Module, drop: nn.Module | None = None) -> None:
        super().__init__()
        self.pos, self.drop = pos, drop

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden + the position table's first rows."""
        hidden = hidden + self.pos(torch.arange(hidden.shape[1], device=hidden.device)).unsqueeze(0)
        return self.drop(hidden) if self.drop is not None else hidden


class DecoderStage(nn.Module):
    """One decoder layer on hidden states; rotary positions and the attention mask recomputed here since only
    hidden crosses stages."""

    def __init__(self, layer: nn.Module, rotary: nn.Module | None = None, seq_factor: int = 1,
                 config: Any = None) -> None:
        super().__init__()
        # The rotary module (shared by every layer) holds only a non-persistent buffer.
        self.layer, self.rotary, self.seq_factor = layer, rotary, seq_factor
        # Mistral-style configs (Mixtral's) slide every layer's window when they state one.
        self.config, self.sliding = config, getattr(config, "sliding_window", None) is not None

    def forward(self, hidden: Tensor) -> Tensor:
        """Causal self-attention and MLP, masked as HF's base model masks it; returns hidden states."""
        from dsforge.runtime.hf_pipeline import layer_mask

        seq = hidden.shape[1] * self.seq_factor  # sequence-parallel hidden holds 1/tp of the positions
        position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)
        kwargs: dict[str, Any] = {}
        if self.config is not None:  # eager attention attends everywhere without a mask
            kwargs["attention_mask"] = layer_mask(self.config, hidden, position_ids, self.sliding)
        if self.rotary is not None:
            kwargs.update(position_ids=position_ids, position_embeddings=self.rotary(hidden, position_ids))
        out = self.layer(hidden, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return out.contiguous()  # DeepSpeed sends stage outputs point-to-point, which needs contiguous memory


class HeadStage(nn.Module):
    """Final norm, then the LM head when it is not tied (a tied head follows as its own layer)."""

    def __init__(self, norm: nn.Module, head: nn.Module | None = None) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, hidden: Tensor) -> Tensor:
        """Normalised hidden states, or logits."""
        hidden = self.norm(hidden)
        return self.head(hidden) if self.head is not None else hidden


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Next-token cross entropy averaged over the non-ignored tokens (HF's ForCausalLMLoss on full logits)."""
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.float().flatten(0, -2), shifted.flatten(), ignore_index=-100)


def stage_modules(rp: RewritePlan, stage: int) -> set[str]:
    """Modules one pipeline stage holds: its own, plus the owners of weights tied into it."""
    own = {m.name for m in rp.modules if m.stage == stage}
    return own | {m.tied_to for m in rp.modules if m.name in own and m.tied_to}


def layer_list(model: nn.Module, rp: RewritePlan) -> tuple[list[Any], int, int]:
    """DeepSpeed's flat layer list for a rewritten HF model, with the entries before and after the decoder
    layers."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    if rp.arch not in STRUCTURES and derived_pipeline(rp.arch, model):
        return _derived_layer_list(model, rp)
    s = STRUCTURES.get(rp.arch)
    if s is None:
        raise RewriteError(rp.arch, [(f"pipeline stages know the HF families {sorted(STRUCTURES)}; a "
                                      f"`{rp.arch}` model must come as a PipelineModule from its factory")])
    get = model.get_submodule
    embed = get(s.embed)
    tied = rp.module(s.head).tied_to == s.embed
    sp = rp.sequence_parallel
    lead: list[Any] = [TiedLayerSpec("embed", EmbeddingStage, embed, tied_weight_attr="embed.weight") if tied
                       else LayerSpec(EmbeddingStage, embed)]
    if s.pos:
        lead.append(LayerSpec(PositionStage, get(s.pos), get(s.drop) if s.drop else None))
    rotary = get(s.rotary) if s.rotary else None
    # Under sequence parallelism a layer's input holds 1/tp of the positions, except the entry layer's.
    config = getattr(model, "config", None)
    decoders = [DecoderStage(layer, rotary, rp.tp if sp and not isinstance(layer, SequenceEntry) else 1,
                             config) for layer in cast(nn.ModuleList, get(s.layers))]
    tail: list[Any] = [LayerSpec(HeadStage, get(s.norm), None if tied else get(s.head))]
    if tied:
        tail.append(TiedLayerSpec("embed", EmbeddingStage, embed, forward_fn=tied_logits,
                                  tied_weight_attr="embed.weight"))
    return [*lead, *decoders, *tail], len(lead), len(tail)


def _derived_layer_list(model: nn.Module, rp: RewritePlan) -> tuple[list[Any], int, int]:
    """The layer list of a model placed by its HF plans: the pieces its base_model_pp_plan names
    (dsforge.runtime.hf_pipeline), the planner having checked that their glue reproduces its forward."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    from dsforge.runtime.hf_pipeline import base_prefix, hf_pieces

    embed, decoders, norm, head = hf_pieces(model)
    embed_name = f"{base_prefix(model)}.embed_tokens"
    tied = rp.module("lm_head").tied_to == embed_name
    lead: list[Any] = [TiedLayerSpec("embed", EmbeddingStage, embed, tied_weight_attr="embed.weight") if tied
                       else LayerSpec(EmbeddingStage, embed)]
    tail: list[Any] = [LayerSpec(HeadStage, norm, None if tied else head)]
    if tied:
        tail.append(TiedLayerSpec("embed", EmbeddingStage, embed, forward_fn=tied_logits,
                                  tied_weight_attr="embed.weight"))
    return [*lead, *decoders, *tail], len(lead), len(tail)


def boundaries(plan: ResolvedPlan, layers: int, lead: int, tail: int) -> list[int]:
    """DeepSpeed's ``parts``: the layer-list index where each stage starts (lead entries with stage 0, tail
    last)."""
    pp = plan.degrees.pp if plan.degrees else 1
    if plan.virtual_stages != 1:
        raise RewriteError("pipeline", [(f"virtual_stages={plan.virtual_stages}: DeepSpeed's PipelineModule "
                                         f"runs one chunk per stage (no interleaved schedule)")])
    chunks = plan.stage_layers or ([layers] if pp == 1 else [])
    if len(chunks) != pp or sum(chunks) != layers:
        raise RewriteError("pipeline", [(f"the plan's partition {chunks} does not "
                                         f"split {layers} layers into pp={pp}")])
    parts = [0, lead + chunks[0]]
    for n in chunks[1:-1]:
        parts.append(parts[-1] + n)
    return parts + [lead + layers + tail] if pp > 1 else [0, lead + layers + tail]


def ds_pipeline_config(rp: RewritePlan) -> dict[str, bool]:
    """The ds_config ``pipeline`` keys these stages need: the compiler's rule, which `dsforge compile` emits.

    DeepSpeed's PipelineEngine assumes stage activations are replicated over the TP group and by
    default sends 1/tp of them and all-gathers on arrival (``pipe_partitioned``, runtime/pipe/engine.py);
    with sequence parallelism each TP rank's activation is its own sequence slice, so that must be off.
    """
    return pipeline_partitioning(rp.sequence_parallel, rp.tp)


def build_pipeline(model: nn.Module, rp: RewritePlan, plan: ResolvedPlan, groups: ParallelGroups,
                   loss_fn: Callable[[Tensor, Tensor], Tensor] = causal_lm_loss,
                   on_meta: Callable[[], Any] | None = None,
                   after_rewrite: Callable[[nn.Module, set[str]], Any] | None = None,
                   **kwargs: Any) -> nn.Module:
    """Rewrite this rank's stage of a dense HF model and wrap the model as a PipelineModule cut by the plan.

    ``on_meta`` (a context manager factory) wraps the rewrite of a model whose parameters are on the
    meta device; ``after_rewrite(model, stage's modules)`` then gives the stage's parameters their values.
    """
    from deepspeed.pipe import PipelineModule

    stage = groups.index("pp")
    only = stage_modules(rp, stage)
    with on_meta() if on_meta is not None else contextlib.nullcontext():
        apply_rewrite(model, rp, groups, only=only)
    if after_rewrite is not None:
        after_rewrite(model, only)
    specs, lead, tail = layer_list(model, rp)
    parts = boundaries(plan, len(specs) - lead - tail, lead, tail)

    class PlannedPipelineModule(PipelineModule):  # type: ignore[misc]
        """PipelineModule whose stage boundaries are the plan's (DeepSpeed has no explicit-partition
        option)."""

        def _partition_layers(self, method: str = "uniform") -> None:
            self.parts = parts
            me = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=parts[me], stop=parts[me + 1])

    return PlannedPipelineModule(specs, topology=groups.pipe_topology(), loss_fn=loss_fn, **kwargs)
