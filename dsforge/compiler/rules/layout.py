"""DSF10x: the parallel degrees against the world size, the order string, experts and stages."""

from __future__ import annotations

from collections.abc import Iterator

from dsforge.compiler.plan.placement import OrderError, place
from dsforge.compiler.rules.registry import Context, Finding, report_id, rule
from dsforge.compiler.rules.util import choices, divisors
from dsforge.diagnostics import Severity

MEGATRON_PS = "Megatron-LM megatron/core/parallel_state.py (initialize_model_parallel, RankGenerator)"


@rule("DSF101", "the parallel degrees multiply to the world size", source=MEGATRON_PS,
      reads=("tp", "pp", "dp", "cp"))
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


@rule("DSF102", "dp: auto needs tp*pp*cp to divide the world size", source=MEGATRON_PS,
      reads=("tp", "pp", "cp"))
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


@rule("DSF120", "an `auto` field the layout search cannot resolve", source="dsforge/compiler/search",
      reads=("tp", "pp", "cp", "ep", "zero"))
def other_auto(ctx: Context) -> Iterator[Finding]:
    """validate, explain and compile resolve `auto` with the layout search (dsforge/compiler/search) before
    the rules run, so a check meets `auto` only where no search ran (a job checked directly, without
    validate's resolution); `hardware.nodes: auto` with an objective other than min_gpus is reported under
    this id by the search itself, since more GPUs always run faster."""
    par = ctx.spec.parallel
    for key in ("tp", "pp", "cp", "ep", "zero"):
        if getattr(par, key) == "auto":
            yield Finding(f"parallel.{key} is `auto` and no layout search resolved it",
                          f"validate the file with `dsforge validate` (it runs the search), or set "
                          f"parallel.{key} to a number (`dsforge search` ranks the choices)",
                          ("parallel", key))


def _order_refusal(ctx: Context) -> OrderError | None:
    """Why place() refuses the job's order (the plan keeps only the message; the rule id is on the error)."""
    d = ctx.plan.degrees
    if d is None or ctx.plan.order_error() is None:
        return None
    try:
        place(d.tp, d.pp, d.dp, d.cp, d.ep, ctx.plan.gpus_per_node, ctx.spec.parallel.order)
    except OrderError as exc:
        return exc
    return None


def _order_findings(ctx: Context, rule_id: str, fix: str) -> Iterator[Finding]:
    refusal = _order_refusal(ctx)
    if refusal is not None and refusal.rule == rule_id:
        yield Finding(str(refusal), fix, ("parallel", "order"))


@rule("DSF117", "parallel.order names each axis once, every axis above 1 included", source=MEGATRON_PS,
      reads=("tp", "pp", "dp", "cp", "ep"))
def order_valid(ctx: Context) -> Iterator[Finding]:
    """The order string lists the axes fastest-varying first (Megatron's RankGenerator), each once; it may
    omit axes of size 1 only (they are appended, as Megatron appends them), and dp counts as above 1 when
    the expert layers' data-parallel size dp*cp/ep is. Megatron stops on an axis it does not know or an
    axis of size > 1 it is not given; dsforge also refuses an axis named twice or an empty name."""
    yield from _order_findings(ctx, "DSF117", "list each axis once, every axis above 1 included (the default "
                               "order is tp-cp-ep-dp-pp)")


@rule("DSF124", "pp is last in parallel.order unless the expert data-parallel size equals dp",
      source="Megatron-LM megatron/core/parallel_state.py initialize_model_parallel (pp-last assertion)",
      reads=("tp", "pp", "dp", "cp", "ep"))
def order_pp_last(ctx: Context) -> Iterator[Finding]:
    """Megatron lays the expert layers out on a second grid over the same order (cp = 1, ep, dp*cp/ep) and
    asserts that the order ends with pp, or pp = 1, or dp*cp/ep = dp: otherwise the two grids can put the
    pipeline stages on different ranks, and the expert data-parallel groups can even be the pipeline groups
    (tp1 pp2 cp2 with tp-cp-ep-pp-dp: expert gradients averaged across stages). dsforge refuses what Megatron
    refuses, for dense models too, since Megatron refuses it for them."""
    yield from _order_findings(ctx, "DSF124", "put pp last (e.g. tp-cp-ep-dp-pp), or make ep equal cp so "
                               "that dp*cp/ep = dp")


@rule("DSF125", "the expert and dense layers get the same pipeline groups",
      source="Megatron-LM megatron/core/parallel_state.py "
             "initialize_model_parallel (pipeline-group assertion)",
      reads=("tp", "pp", "dp", "cp", "ep"))
def order_same_pipeline(ctx: Context) -> Iterator[Finding]:
    """With pp not last, the axes before pp have other sizes in the expert grid (cp = 1, ep, dp*cp/ep) than
    in the dense grid (cp, ep = 1, dp), so a stage's ranks would differ between expert and dense layers;
    Megatron asserts the pipeline groups are equal, and dsforge refuses the same orders."""
    yield from _order_findings(ctx, "DSF125", "put pp after cp, ep and dp (pp last: tp-cp-ep-dp-pp)")


@rule("DSF126", "MoE layers keep the dense tensor-parallel groups (no expert tensor parallelism)",
      source="Megatron-LM parallel_state.py expert RankGenerator (expert_tensor_parallel_size, MoE parallel "
             "folding); dsforge/runtime/moe.py", reads=("tp", "pp", "dp", "cp", "ep"))
def order_expert_tp(ctx: Context) -> Iterator[Finding]:
    """With cp, ep or dp before tp in the order, Megatron's expert grid (cp = 1) gives the expert layers
    other tensor-parallel groups than the attention layers: expert tensor parallelism apart from tp, which
    Megatron calls MoE parallel folding (its `expert_tensor_parallel_size`). dsforge has no such group: its
    runtime runs DeepSpeed's MoE layer with every tp rank holding its experts whole, and there is no
    `parallel.etp`. A MoE model with such an order is refused; a dense model keeps it (it needs no expert
    grid, and its `edp` groups are the dp-cp groups)."""
    fix = "put tp before cp, ep and dp (tp first, e.g. tp-cp-ep-dp-pp)"
    yield from _order_findings(ctx, "DSF126", fix)
    p = ctx.plan.placement
    if p is not None and p.expert_note and ctx.spec.model.moe is not None:
        yield Finding(f"{p.expert_note}; the model has `moe:` layers", fix, ("parallel", "order"))


@rule("DSF113", "ep divides the number of experts", source="deepspeed/moe/layer.py MoE.__init__",
      reads=("ep",))
def ep_divides_experts(ctx: Context) -> Iterator[Finding]:
    """Each expert-parallel rank holds experts/ep whole experts; DeepSpeed's MoE asserts
    `num_experts % ep_size == 0` when the model is built."""
    d, moe = ctx.plan.degrees, ctx.spec.model.moe
    if d is None or moe is None or moe.experts % d.ep == 0:
        return
    yield Finding(f"ep={d.ep} does not divide experts={moe.experts}: each rank must hold whole experts",
                  f"use ep in {choices(divisors(moe.experts))}", ("parallel", "ep"))


@rule("DSF114", "ep fits inside the data-parallel ranks (divides dp x cp)",
      source="deepspeed/utils/groups.py _create_expert_and_data_parallel; Megatron-Core parallel_state.py "
      "initialize_model_parallel (world % (expert_tp x ep x pp), expert_tp = tp by default)",
      reads=("dp", "cp", "ep"))
def ep_divides_dp(ctx: Context) -> Iterator[Finding]:
    """Expert parallelism reuses data-parallel (and context-parallel) ranks: ep must divide dp x cp.
    DeepSpeed checks `(world / pp) % ep_size` with a bare "is not divisible" only at initialize. Both
    stacks have the rule: Megatron-Core builds its expert grid as world / (expert_tp x ep x pp) with
    expert_tp = tp (what the megatron-te profile assumes: experts split over TP), which divides exactly
    when ep divides dp x cp."""
    d = ctx.plan.degrees
    if d is None or not ctx.plan.layout_ok or d.ep == 1 or (d.dp * d.cp) % d.ep == 0:
        return  # with a layout that does not fill the world, dp is not settled yet (DSF101/DSF102 say why)
    yield Finding(f"ep={d.ep} does not divide dp*cp = {d.dp}*{d.cp} = {d.dp * d.cp}: expert ranks are carved "
                  f"out of the data-parallel ranks", f"use ep in {choices(divisors(d.dp * d.cp))}",
                  ("parallel", "ep"))


@rule("DSF115", "ep > 1 needs a mixture-of-experts model", source="dsforge", reads=("ep",))
def ep_without_moe(ctx: Context) -> Iterator[Finding]:
    """Expert parallelism shards experts; a dense model has none, so ep > 1 would only waste ranks."""
    d = ctx.plan.degrees
    if d is not None and d.ep > 1 and ctx.spec.model.moe is None:
        yield Finding(f"ep={d.ep} but the model has no `moe:` section",
                      "set ep: 1, or describe the MoE layers", ("parallel", "ep"))


@rule("DSF109", "layers split over pp x virtual_stages", source="Narayanan et al. 2021 sec. 2.2; Megatron-LM "
      "megatron/training/arguments.py (num_layers % pp, and per stage % vp, unless the ends are uneven)",
      reads=("pp", "virtual_stages", "schedule"))
def layers_split(ctx: Context) -> Iterator[Finding]:
    """Every pipeline chunk needs at least one layer; the interleaved schedule needs an equal number of
    layers per chunk, and an uneven split elsewhere leaves the slowest stage setting the pace. By stack:
    Megatron-Core (`stack: megatron-te`) splits layers evenly and refuses num_layers not divisible by pp
    (arguments.py "Number of layers should be divisible by the pipeline-model-parallel size"), so there it
    is an error for any partition but an explicit list (Megatron's pipeline_model_parallel_layout);
    DeepSpeed's PipelineModule (`stack: dsforge`) balances parameters or splits uniformly, so an uneven
    uniform split is only a warning. `first_stage_layers`/`last_stage_layers` are DSF305's."""
    d, par, m = ctx.plan.degrees, ctx.spec.parallel, ctx.spec.model
    pipe = par.pipeline
    if d is None or isinstance(pipe.partition, list) or (pipe.first_stage_layers,
                                                         pipe.last_stage_layers) != (None, None):
        return
    if getattr(pipe, "account_for_embedding", False) or getattr(pipe, "account_for_loss", False):
        return  # Megatron-Core's embedding/loss-counting split is DSF306's
    chunks = d.pp * par.pipeline.virtual_stages
    what = f"pp*virtual_stages = {d.pp}*{par.pipeline.virtual_stages} = {chunks}"
    if m.layers < chunks:
        yield Finding(f"layers={m.layers} cannot fill {what} pipeline chunks: some would hold no layer",
                      f"use pp*virtual_stages <= {m.layers}", ("parallel", "pp"))
    elif m.layers % chunks and ctx.spec.stack == "megatron-te":
        yield Finding(f"Megatron-Core splits layers evenly: layers={m.layers} are not divisible by {what}",
                      f"use pp*virtual_stages in {choices(divisors(m.layers))}, or give the end stages their "
                      f"own counts (parallel.pipeline.first_stage_layers / last_stage_layers), or count the "
                      "embedding and loss as layers (account_for_embedding / account_for_loss)",
                      ("parallel", "pp"))
    elif m.layers % chunks and par.pipeline.schedule == "interleaved":
        yield Finding(f"the interleaved schedule needs layers={m.layers} divisible by {what}",
                      f"use pp*virtual_stages in {choices(divisors(m.layers))}", ("parallel", "pipeline",
                                                                                       "virtual_stages"))
    elif m.layers % chunks and par.pipeline.partition == "uniform":
        yield Finding(f"layers={m.layers} do not split evenly over {what} stages "
                      f"({ctx.plan.stage_layers}): the largest stage sets the pace",
                      f"use pp in {choices(divisors(m.layers))}", ("parallel", "pp"), Severity.WARNING)


@rule("DSF119", "an explicit partition lists layers per chunk and sums to the layers",
      source="deepspeed/runtime/pipe/module.py PipelineModule._partition_layers",
      reads=("pp", "virtual_stages"))
def explicit_partition(ctx: Context) -> Iterator[Finding]:
    """`pipeline.partition` as a list gives the layer count of each pipeline chunk in order; it needs one
    entry per chunk (pp x virtual_stages) and must account for every layer exactly once."""
    d, par, m = ctx.plan.degrees, ctx.spec.parallel, ctx.spec.model
    part = par.pipeline.partition
    if d is None or not isinstance(part, list):
        return
    chunks = d.pp * par.pipeline.virtual_stages
    if len(part) != chunks:
        yield Finding(f"pipeline.partition has {len(part)} entries but "
                      f"there are pp*virtual_stages = {chunks} chunks",
                      f"give {chunks} layer counts", ("parallel", "pipeline", "partition"))
    elif sum(part) != m.layers:
        yield Finding(f"pipeline.partition sums to {sum(part)} layers but the model has {m.layers}",
                      f"make the counts add up to {m.layers}", ("parallel", "pipeline", "partition"))


@rule("DSF110", "sequence parallelism needs tp > 1", severity=Severity.WARNING,
      source="Korthikanti et al. 2022 sec. 4.2.2", reads=())
def sp_without_tp(ctx: Context) -> Iterator[Finding]:
    """Megatron sequence parallelism splits the norm and dropout regions over the tensor-parallel group;
    with tp = 1 there is no group and the flag does nothing."""
    d = ctx.plan.degrees
    if d is not None and ctx.spec.parallel.sequence_parallel and d.tp == 1:
        yield Finding("sequence_parallel is on but tp=1: there is no tensor-parallel group to split over",
                      "set tp > 1, or sequence_parallel: false", ("parallel", "sequence_parallel"))


# Reported by the layout search (dsforge/compiler/search/resolve.py) where validate resolves `auto`.
report_id("DSF130", "the layout search finds a candidate that fits",
          "Every combination of the `auto` fields that is legal by construction was checked with validate's "
          "rules and the memory estimate; none passed. The "
          "message names the closest misses and what each lacks.",
          "dsforge/compiler/search (Narayanan et al. 2021 sec. "
          "3: the smallest model-parallel degree that fits)")
report_id("DSF131", "the search objective has the inputs it needs",
          "cost needs `search.price_per_gpu_hour`, min_gpus needs `search.deadline_hours`; without them the "
          "objective cannot rank anything.", "dsforge/compiler/search/objective.py")
report_id("DSF132", "the layout search space is small enough to search",
          "A space of more than 500,000 candidates would take minutes; fixing a few fields (or "
          "search.max_tp) keeps validate interactive.", "dsforge/compiler/search/engine.py MAX_CANDIDATES")
report_id("DSF133", "which layout the search chose for the `auto` fields, and why",
          "validate, explain and compile resolve `auto` with the same search as `dsforge search` and say "
          "which layout they chose, its objective value and the runner-up, so the choice is never silent.",
          "dsforge/compiler/search", severity=Severity.INFO)
