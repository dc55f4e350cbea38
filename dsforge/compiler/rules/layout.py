"""DSF10x: the parallel degrees against the world size, the order string, experts and stages."""

from __future__ import annotations

from collections.abc import Iterator

from dsforge.compiler.rules.registry import Context, Finding, rule
from dsforge.compiler.rules.util import choices, divisors
from dsforge.diagnostics import Severity

MEGATRON_PS = "Megatron-LM megatron/core/parallel_state.py (initialize_model_parallel, RankGenerator)"


@rule("DSF101", "the parallel degrees multiply to the world size", source=MEGATRON_PS)
def degrees_fill_world(ctx: Context) -> Iterator[Finding]:
    """Every rank belongs to exactly one (tp, cp, dp, pp) coordinate, so tp x pp x dp x cp must equal
    nodes x gpus_per_node. Otherwise ranks are left idle or the layout needs ranks that do not exist;
    DeepSpeed finds out only inside `deepspeed.initialize` (PipelineModule's `world_size % num_stages`,
    AutoTP's DeviceMesh IndexError)."""
    p, d = ctx.plan, ctx.plan.degrees
    if d is None or ctx.spec.parallel.dp == "auto" or d.product == p.world_size:
        return
    other = d.tp * d.pp * d.cp
    fix = (f"set `dp: auto`, or dp={p.world_size // other}" if p.world_size % other == 0
           else f"set nodes x gpus_per_node to a multiple of tp*pp*cp={other}")
    yield Finding(f"tp*pp*dp*cp = {d.tp}*{d.pp}*{d.dp}*{d.cp} = {d.product} ranks, but the hardware has "
                  f"{p.nodes} node(s) x {p.gpus_per_node} = {p.world_size}", fix, ("parallel", "dp"))


@rule("DSF102", "dp: auto needs tp*pp*cp to divide the world size", source=MEGATRON_PS)
def auto_dp_divides(ctx: Context) -> Iterator[Finding]:
    """With `dp: auto` the data-parallel degree is world / (tp x pp x cp); it must be a whole number >= 1."""
    p, d = ctx.plan, ctx.plan.degrees
    if d is None or ctx.spec.parallel.dp != "auto":
        return
    other = d.tp * d.pp * d.cp
    if p.world_size % other:
        opts = divisors(p.world_size)
        # Point at the degree the user wrote (dp: auto is usually the default, written nowhere).
        key = next((k for k in ("dp", "tp", "pp", "cp") if ctx.written(("parallel", k))), "dp")
        yield Finding(f"dp: auto needs tp*pp*cp = {d.tp}*{d.pp}*{d.cp} = {other} to divide the world size "
                      f"{p.nodes} node(s) x {p.gpus_per_node} = {p.world_size}",
                      f"choose tp*pp*cp in {choices(opts)}, or change the node count", ("parallel", key))


@rule("DSF120", "only dp may be `auto` in validate", source="dsforge")
def other_auto(ctx: Context) -> Iterator[Finding]:
    """`auto` for tp, pp, cp, ep or zero asks dsforge to choose the degree by searching the layouts that
    fit; validation of one concrete layout needs those degrees fixed."""
    par = ctx.spec.parallel
    for key in ("tp", "pp", "cp", "ep", "zero"):
        if getattr(par, key) == "auto":
            yield Finding(f"parallel.{key} is `auto`; a single layout can only be checked with it fixed",
                          f"set parallel.{key} to a number (the layout search will fill `auto` degrees)",
                          ("parallel", key))


@rule("DSF117", "parallel.order places every axis, with ep next to dp", source=MEGATRON_PS)
def order_valid(ctx: Context) -> Iterator[Finding]:
    """The order string lists the axes fastest-varying first (Megatron's RankGenerator); it may omit
    axes of size 1 only, and ep must sit next to dp because expert groups are carved out of dp."""
    why = ctx.plan.order_error()
    if why:
        yield Finding(why, "use the default order tp-cp-ep-dp-pp, or list each axis once with ep beside dp "
                      "(and cp, ep, dp together when both cp and ep are > 1)",
                      ("parallel", "order"))


@rule("DSF113", "ep divides the number of experts", source="deepspeed/moe/layer.py MoE.__init__")
def ep_divides_experts(ctx: Context) -> Iterator[Finding]:
    """Each expert-parallel rank holds experts/ep whole experts; DeepSpeed's MoE asserts
    `num_experts % ep_size == 0` when the model is built."""
    d, moe = ctx.plan.degrees, ctx.spec.model.moe
    if d is None or moe is None or moe.experts % d.ep == 0:
        return
    yield Finding(f"ep={d.ep} does not divide experts={moe.experts}: each rank must hold whole experts",
                  f"use ep in {choices(divisors(moe.experts))}", ("parallel", "ep"))


@rule("DSF114", "ep fits inside the data-parallel ranks (divides dp x cp)",
      source="deepspeed/utils/groups.py _create_expert_and_data_parallel; Megatron expert_data_parallel_size")
def ep_divides_dp(ctx: Context) -> Iterator[Finding]:
    """Expert parallelism reuses data-parallel (and context-parallel) ranks: ep must divide dp x cp.
    DeepSpeed checks `(world / pp) % ep_size` with a bare "is not divisible" only at initialize."""
    d = ctx.plan.degrees
    if d is None or not ctx.plan.layout_ok or d.ep == 1 or (d.dp * d.cp) % d.ep == 0:
        return  # with a layout that does not fill the world, dp is not settled yet (DSF101/DSF102 say why)
    yield Finding(f"ep={d.ep} does not divide dp*cp = {d.dp}*{d.cp} = {d.dp * d.cp}: expert ranks are carved out "
                  "of the data-parallel ranks", f"use ep in {choices(divisors(d.dp * d.cp))}", ("parallel", "ep"))


@rule("DSF115", "ep > 1 needs a mixture-of-experts model", source="dsforge")
def ep_without_moe(ctx: Context) -> Iterator[Finding]:
    """Expert parallelism shards experts; a dense model has none, so ep > 1 would only waste ranks."""
    d = ctx.plan.degrees
    if d is not None and d.ep > 1 and ctx.spec.model.moe is None:
        yield Finding(f"ep={d.ep} but the model has no `moe:` section", "set ep: 1, or describe the MoE layers",
                      ("parallel", "ep"))


@rule("DSF109", "layers split over pp x virtual_stages", source="Narayanan et al. 2021 sec. 2.2; Megatron "
      "(num_layers % (pp * vp) for the interleaved schedule)")
def layers_split(ctx: Context) -> Iterator[Finding]:
    """Every pipeline chunk needs at least one layer; the interleaved schedule needs an equal number of
    layers per chunk, and an uneven split elsewhere leaves the slowest stage setting the pace."""
    d, par, m = ctx.plan.degrees, ctx.spec.parallel, ctx.spec.model
    if d is None or isinstance(par.pipeline.partition, list):
        return
    chunks = d.pp * par.pipeline.virtual_stages
    what = f"pp*virtual_stages = {d.pp}*{par.pipeline.virtual_stages} = {chunks}"
    if m.layers < chunks:
        yield Finding(f"layers={m.layers} cannot fill {what} pipeline chunks: some would hold no layer",
                      f"use pp*virtual_stages <= {m.layers}", ("parallel", "pp"))
    elif m.layers % chunks and par.pipeline.schedule == "interleaved":
        yield Finding(f"the interleaved schedule needs layers={m.layers} divisible by {what}",
                      f"use pp*virtual_stages in {choices(divisors(m.layers))}", ("parallel", "pipeline",
                                                                                       "virtual_stages"))
    elif m.layers % chunks and par.pipeline.partition == "uniform":
        yield Finding(f"layers={m.layers} do not split evenly over {what} stages "
                      f"({ctx.plan.stage_layers}): the largest stage sets the pace",
                      f"use pp in {choices(divisors(m.layers))}", ("parallel", "pp"), Severity.WARNING)


@rule("DSF119", "an explicit partition lists layers per chunk and sums to the layers",
      source="deepspeed/runtime/pipe/module.py PipelineModule._partition_layers")
def explicit_partition(ctx: Context) -> Iterator[Finding]:
    """`pipeline.partition` as a list gives the layer count of each pipeline chunk in order; it needs one
    entry per chunk (pp x virtual_stages) and must account for every layer exactly once."""
    d, par, m = ctx.plan.degrees, ctx.spec.parallel, ctx.spec.model
    part = par.pipeline.partition
    if d is None or not isinstance(part, list):
        return
    chunks = d.pp * par.pipeline.virtual_stages
    if len(part) != chunks:
        yield Finding(f"pipeline.partition has {len(part)} entries but there are pp*virtual_stages = {chunks} chunks",
                      f"give {chunks} layer counts", ("parallel", "pipeline", "partition"))
    elif sum(part) != m.layers:
        yield Finding(f"pipeline.partition sums to {sum(part)} layers but the model has {m.layers}",
                      f"make the counts add up to {m.layers}", ("parallel", "pipeline", "partition"))


@rule("DSF110", "sequence parallelism needs tp > 1", severity=Severity.WARNING,
      source="Korthikanti et al. 2022 sec. 4.2.2")
def sp_without_tp(ctx: Context) -> Iterator[Finding]:
    """Megatron sequence parallelism splits the norm and dropout regions over the tensor-parallel group;
    with tp = 1 there is no group and the flag does nothing."""
    d = ctx.plan.degrees
    if d is not None and ctx.spec.parallel.sequence_parallel and d.tp == 1:
        yield Finding("sequence_parallel is on but tp=1: there is no tensor-parallel group to split over",
                      "set tp > 1, or sequence_parallel: false", ("parallel", "sequence_parallel"))
