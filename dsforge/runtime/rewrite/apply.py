"""Applying a rewrite plan: each planned module of a real model swapped for its parallel variant.

One applier over the plan's rows (picotron's "a table and one applier"): column / row / vocab
modules are replaced through the ``from_dense`` constructors of dsforge.runtime.layers, so the
rewritten model holds exactly this rank's shards of the dense weights; norms are tagged for
sequence parallelism; replicated modules stay as they are. Afterwards the attributes the HF
forward reads as global widths (GPT-2's ``split_size``) become local ones, a tied LM head shares
the sharded embedding, and every parameter is checked against the plan's shard shape.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

from torch import nn

from dsforge.runtime.groups import ParallelGroups
from dsforge.runtime.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    mark_sequence_parallel,
)
from dsforge.runtime.layers.norms import ShardedRMSNorm, sum_grads_over_tp
from dsforge.runtime.rewrite.planner import ModulePlan, RewriteError, RewritePlan
from dsforge.runtime.rewrite.sequence import wrap_sequence_parallel
from dsforge.runtime.rewrite.shard import head_unit


@dataclass(frozen=True)
class Context:
    """What every builder needs: the plan, this rank's groups, and whether the LM head gathers its logits."""

    rp: RewritePlan
    groups: ParallelGroups
    gather_logits: bool


Builder = Callable[[nn.Module, ModulePlan, Context], nn.Module]


def _unit(entry: ModulePlan, rp: RewritePlan) -> int:
    """Whole heads per shard for head-split projections, single features otherwise."""
    if entry.widths:
        return rp.head_dim
    return head_unit(entry.heads, rp.head_dim) if entry.heads else 1


def _even(entry: ModulePlan, ctx: Context) -> None:
    """The layers cut every block evenly; a planned shard that is not 1/tp (replicated KV heads) is
    refused."""
    for p in entry.params:
        if p.dim is not None and p.shard[p.dim] * ctx.rp.tp != p.shape[p.dim]:
            raise RewriteError(ctx.rp.arch, [(f"{entry.name}: the planned shard {p.shard} of {p.name} "
                                              f"{p.shape} is not 1/{ctx.rp.tp} of it (replicated KV heads); "
                                              f"the tensor-parallel layers cannot build it")])


def _column(dense: nn.Module, entry: ModulePlan, ctx: Context) -> nn.Module:
    _even(entry, ctx)
    # Under sequence parallelism the block around it gathers the sequence (rewrite.sequence), not the layer.
    blocks = list(entry.widths) if entry.widths else entry.fused
    return ColumnParallelLinear.from_dense(dense, ctx.groups, blocks=blocks, unit=_unit(entry, ctx.rp))


def _row(dense: nn.Module, entry: ModulePlan, ctx: Context) -> nn.Module:
    return RowParallelLinear.from_dense(dense, ctx.groups, input_is_parallel=True, unit=_unit(entry, ctx.rp),
                                        sequence_parallel=ctx.rp.sequence_parallel)


def _vocab(dense: nn.Module, entry: ModulePlan, ctx: Context) -> nn.Module:
    # Under sequence parallelism both ends see the whole sequence (rewrite.sequence): no SP mode here.
    if isinstance(dense, nn.Embedding):
        return VocabParallelEmbedding.from_dense(dense, ctx.groups)
    if isinstance(dense, nn.Linear):
        return VocabParallelLMHead.from_dense(dense, ctx.groups, gather_output=ctx.gather_logits)
    raise RewriteError(ctx.rp.arch, [(f"{entry.name}: `vocab` needs an nn.Embedding or nn.Linear, not "
                                      f"{type(dense).__name__}")])


def _norm(module: nn.Module, entry: ModulePlan, ctx: Context) -> nn.Module:
    if ctx.rp.sequence_parallel:
        for p in module.parameters():
            mark_sequence_parallel(p)
    return module


def _keep(module: nn.Module, entry: ModulePlan, ctx: Context) -> nn.Module:
    return module


def _head_norm(module: nn.Module, entry: ModulePlan, ctx: Context) -> nn.Module:
    # Replicated, but each rank normalises only its own heads: the gradients are partial sums over heads.
    sum_grads_over_tp(module, ctx.groups.tp)
    return module


def _scalars(module: nn.Module, entry: ModulePlan, ctx: Context) -> nn.Module:
    # Learnt constants of an elementwise function on split channels: each rank's gradient covers its channels.
    sum_grads_over_tp(module, ctx.groups.tp)
    return module


def _shard_norm(module: nn.Module, entry: ModulePlan, ctx: Context) -> nn.Module:
    _even(entry, ctx)
    (weight,) = entry.params
    local = weight.shard[0]
    return ShardedRMSNorm.from_dense(module, ctx.groups.tp, ctx.groups.index("tp") * local, local)


def _expert(module: nn.Module, entry: ModulePlan, ctx: Context) -> nn.Module:
    if ctx.rp.ep == 1:
        return module  # every expert is local: the dense module is already this rank's shard
    raise RewriteError(ctx.rp.arch, [(f"{entry.name}: expert parallelism (ep={ctx.rp.ep}) replaces the whole "
                                      f"MoE block; the applier does that for HF Mixtral blocks only")])


def _moe_block(model: nn.Module, entry: ModulePlan, ctx: Context) -> str | None:
    """Swap the HF MoE block holding ``entry``'s experts for DeepSpeed's expert-parallel MoE; its name.

    DeepSpeed's MoE layer owns the router and the all-to-all, so the unit replaced is the block (router
    and experts together), not the experts alone; a shared expert and its gate (Qwen2-MoE, DeepSeek)
    stay beside it under their own names (ExpertParallelMoE.keep_shared). None when the experts
    stay dense (ep = 1).
    """
    if ctx.rp.ep == 1:
        return None
    block_name = entry.name.rpartition(".")[0]
    block = model.get_submodule(block_name)
    if not (hasattr(block, "gate") and hasattr(block, "experts")):
        _expert(block, entry, ctx)  # raises: not a Mixtral-style block
    from dsforge.runtime.moe import from_hf_block  # needs DeepSpeed; imported only for ep > 1

    routing = ctx.rp.moe
    try:
        new = from_hf_block(block, ctx.groups, top_k=routing.top_k if routing else None,
                            drop_tokens=routing.drop_tokens if routing else False,
                            capacity_factor=routing.capacity_factor if routing else 1.0)
    except ValueError as exc:
        raise RewriteError(ctx.rp.arch, [f"{block_name}: {exc}"]) from exc
    _swap(model, block_name, new)
    return block_name


APPLIERS: dict[str, Builder] = {"column": _column, "row": _row, "vocab": _vocab, "norm": _norm,
                                "head_norm": _head_norm, "shard_norm": _shard_norm, "scalars": _scalars,
                                "replicate": _keep, "expert": _expert}


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _scale_attr(module: nn.Module, attr: str, tp: int) -> None:
    """A global width the forward reads becomes the local one; ``config.x`` on a copy of the module's
    config."""
    if attr.startswith("config."):
        if not getattr(module, "_dsforge_local_config", False):
            # The config object is shared by every module of the model: give this one its own copy.
            module.config = copy.copy(module.config)
            module._dsforge_local_config = True  # type: ignore[assignment]  # a plain flag on the module
        holder: Any = module.config
        attr = attr.partition(".")[2]
    else:
        holder = module
    setattr(holder, attr, getattr(holder, attr) // tp)


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _check_shapes(model: nn.Module, entry: ModulePlan, problems: list[str]) -> None:
    """The module now holds exactly the plan's shards (HF Conv1D shards are planned in its (in, out)
    layout)."""
    module = model.get_submodule(entry.name)
    held = dict(module.named_parameters())
    for p in entry.params:
        got = held.get(p.name)
        want = tuple(reversed(p.shard)) if entry.kind == "conv1d" and p.name == "weight" else p.shard
        if got is None or tuple(got.shape) != want:
            problems.append(f"{entry.name}.{p.name}: holds {None if got is None else tuple(got.shape)}, "
                            f"the plan says {want}")


def _check_moe(model: nn.Module, block_name: str, entry: ModulePlan, problems: list[str]) -> None:
    """An expert-parallel block holds the plan's number of local experts, each one expert's slice of every
    tensor."""
    moe = model.get_submodule(block_name)
    local = list(cast(nn.ModuleList, moe.local_experts))  # an ExpertParallelMoE's experts on this rank
    planned = {p.name: p.shard for p in entry.params}
    count = {s[0] for s in planned.values()}
    sizes = sorted(sum(t.numel() for t in e.parameters()) for e in local)
    want = sum(_numel(s[1:]) for s in planned.values())
    if count != {len(local)} or any(n != want for n in sizes):
        problems.append(f"{block_name}: holds {len(local)} experts of {sizes[:1]} parameters, the plan says "
                        f"{sorted(count)} of {want}")


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def apply_rewrite(model: nn.Module, rp: RewritePlan, groups: ParallelGroups,
                  only: Iterable[str] | None = None, gather_logits: bool = True) -> nn.Module:
    """Rewrite ``model`` in place by the plan for this rank's groups (``only``: these modules); returns it.

    The plan's degrees must be the groups' (tp, ep); the dense weights must be the same on every rank
    (same seed or checkpoint) since each rank keeps its slice of them. ``gather_logits=False`` leaves
    the LM head's logits split over the vocabulary (for ``vocab_parallel_cross_entropy``).
    """
    if groups.size("tp") != rp.tp or (rp.ep > 1 and groups.size("ep") != rp.ep):
        raise RewriteError(rp.arch, [(f"the plan is for tp={rp.tp}, ep={rp.ep} but this rank's groups have "
                                      f"tp={groups.size('tp')}, ep={groups.size('ep')}")])
    wanted = set(only) if only is not None else None
    entries = [m for m in rp.modules if wanted is None or m.name in wanted]
    ctx = Context(rp, groups, gather_logits)
    built: dict[str, nn.Module] = {}
    blocks: dict[str, str] = {}  # expert entry -> the MoE block replaced for it
    for entry in entries:
        if entry.name.startswith(tuple(b + "." for b in blocks.values())) and not _has(model, entry.name):
            continue  # inside an MoE block already replaced whole: its router (a shared expert stays)
        if entry.variant == "expert" and (block := _moe_block(model, entry, ctx)) is not None:
            blocks[entry.name] = block
        elif entry.tied_to is None or entry.tied_to not in built:  # a tied head is made once its owner is
            built[entry.name] = APPLIERS[entry.variant](model.get_submodule(entry.name), entry, ctx)
            _swap(model, entry.name, built[entry.name])
    for entry in entries:
        if entry.tied_to in built:
            _tie(model, entry, built[entry.tied_to], ctx)
    for name, attr in rp.attr_scales:
        if wanted is None or any(n.startswith(name + ".") for n in wanted):
            _scale_attr(model.get_submodule(name), attr, rp.tp)
    _verify(model, entries, blocks, rp)
    if rp.sequence_parallel:
        wrap_sequence_parallel(model, rp, groups, wanted)
    return model


def _verify(model: nn.Module, entries: list[ModulePlan], blocks: dict[str, str], rp: RewritePlan) -> None:
    """Raise unless every rewritten module holds exactly its planned shards (routers inside MoE blocks
    moved)."""
    problems: list[str] = []
    gone = tuple(b + "." for b in blocks.values())
    for entry in entries:
        if entry.name in blocks:
            _check_moe(model, blocks[entry.name], entry, problems)
        elif not entry.name.startswith(gone) or _has(model, entry.name):
            _check_shapes(model, entry, problems)
    if problems:
        raise RewriteError(rp.arch, problems)


def _tie(model: nn.Module, entry: ModulePlan, owner: nn.Module, ctx: Context) -> None:
    """A tied LM head becomes a vocab-parallel head sharing the sharded embedding's weight."""
    if entry.variant != "vocab" or not isinstance(owner, VocabParallelEmbedding):
        _swap(model, entry.name, owner)  # a tie between other variants shares the whole rewritten module
        return
    if getattr(model.get_submodule(entry.name), "bias", None) is not None:
        raise RewriteError(ctx.rp.arch,
                           [f"{entry.name}: a tied LM head with a bias cannot be vocab-parallel"])
    head = VocabParallelLMHead(owner.embedding_dim, owner.vocab, owner.pg, gather_output=ctx.gather_logits,
                               reset=False, dtype=owner.weight.dtype)
    head.tie_to(owner)
    _swap(model, entry.name, head.to(owner.weight.device))


__all__ = ["APPLIERS", "Context", "apply_rewrite"]
