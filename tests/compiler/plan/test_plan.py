"""The plan: degrees, batch split, pipeline partitions and rank placement (invariants by hypothesis)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.frontend.parse import parse_job
from dsforge.compiler.frontend.source import SourceMap
from dsforge.compiler.plan.bubble import bubble_fraction
from dsforge.compiler.plan.placement import AXES, OrderError, place
from dsforge.compiler.plan.plan import (
    Plan,
    ResolvedPlan,
    UnresolvedPlan,
    balanced_partition,
    build_plan,
    uniform_partition,
)


def _plan(parallel: dict[str, Any], training: dict[str, Any] | None = None, gpus: int = 8, nodes: int = 1,
          model: dict[str, Any] | None = None):
    data = {"version": 1, "model": model or {"preset": "tiny-llama"},
            "hardware": {"preset": "cpu-local", "gpus_per_node": gpus, "nodes": nodes},
            "parallel": parallel, "training": training or {"global_batch": 32, "micro_batch": 1}}
    spec, diags = parse_job(data, SourceMap("job.yaml"))
    assert spec is not None, [d.message for d in diags]
    return build_plan(spec)


def test_auto_dp_fills_the_world_and_accumulation_follows() -> None:
    plan = _plan({"tp": 2, "pp": 2}, {"global_batch": 32, "micro_batch": 2})
    d = plan.degrees
    assert d is not None and (d.tp, d.pp, d.dp, d.cp, d.ep) == (2, 2, 2, 1, 1)
    assert plan.world_size == 8 and plan.layout_ok and plan.grad_accum == 8  # 32 / (2 * 2)


def test_batch_that_does_not_split_has_no_accumulation() -> None:
    assert _plan({"tp": 2}, {"global_batch": 10, "micro_batch": 1}).grad_accum is None  # 10 % 4


def test_auto_degree_leaves_degrees_unresolved() -> None:
    plan = _plan({"tp": "auto"})
    assert plan.degrees is None and plan.placement is None and plan.stage_layers == []


def test_resolve_gives_every_derived_value_of_the_lazy_plan() -> None:
    plan = _plan({"tp": 2, "pp": 2}, {"global_batch": 32, "micro_batch": 2})
    resolved = plan.resolve()
    assert isinstance(resolved, ResolvedPlan)
    assert (resolved.degrees, resolved.grad_accum, resolved.stage_layers, resolved.placement,
            resolved.model) == (
        plan.degrees, plan.grad_accum, plan.stage_layers, plan.placement, plan.model)
    assert (resolved.world_size, resolved.zero, resolved.virtual_stages, resolved.nodes) == (
        plan.world_size, plan.zero, plan.virtual_stages, plan.nodes)
    assert resolved.search == {} and resolved == plan.resolve() and hash(resolved) == hash(plan.resolve())
    with pytest.raises(AttributeError):  # frozen
        resolved.grad_accum = 1  # type: ignore[misc]


@pytest.mark.parametrize(("parallel", "training", "missing"), [
    ({"tp": "auto"}, None, "degrees, grad_accum, stage_layers, placement"),
    ({"tp": 2}, {"global_batch": 10, "micro_batch": 1}, "grad_accum"),
    ({"tp": 2, "dp": 2}, None, "placement"),
])
def test_resolve_refuses_a_plan_the_rules_would_refuse_naming_what_is_missing(
        parallel: dict[str, Any], training: dict[str, Any] | None, missing: str) -> None:
    with pytest.raises(UnresolvedPlan, match=f"incomplete [(]{missing} unresolved[)]"):
        _plan(parallel, training).resolve()


def test_shared_model_and_placement_are_what_the_plan_reads_and_change_no_equality() -> None:
    plan = _plan({"tp": 2, "pp": 2})
    shared = Plan(plan.spec, shared_model=plan.model, shared_placement=(plan.placement, None))
    assert shared == plan and shared.model is plan.model and shared.placement is plan.placement
    assert shared.resolve().placement is plan.placement


def test_layout_not_filling_the_world_has_no_placement() -> None:
    plan = _plan({"tp": 2, "dp": 2})
    assert not plan.layout_ok and plan.placement is None


def test_stage_layers_uniform_parameters_and_explicit() -> None:
    model = {"preset": "tiny-llama", "layers": 6}
    assert _plan({"pp": 4, "pipeline": {"partition": "uniform"}}, model=model).stage_layers == [1, 1, 2, 2]
    assert _plan({"pp": 2, "pipeline": {"partition": [2, 4]}}, model=model).stage_layers == [2, 4]
    assert _plan({"pp": 2, "pipeline": {"partition": [2, 3]}}, model=model).stage_layers == []  # sums to 5
    params = _plan({"pp": 2}, model=model).stage_layers
    assert sum(params) == 6 and len(params) == 2
    # the embedding (vocab 256 x 64) weighs on stage 0 and the head on the last: neither gets fewer than 2
    # layers
    interleaved = _plan({"pp": 2, "pipeline": {"schedule": "interleaved", "virtual_stages": 3}}, model=model)
    assert len(interleaved.stage_layers) == 6 and sum(interleaved.stage_layers) == 6


def test_bubble_fraction_matches_narayanan() -> None:
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)  # (p-1)/(m+p-1)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)  # (p-1)/(v*m+p-1)
    with pytest.raises(ValueError):
        bubble_fraction(2, 0)


# ---- partition invariants ----

@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60), st.integers(1, 12))
def test_uniform_partition_invariants(items: int, parts: int) -> None:
    runs = uniform_partition(items, parts)
    assert len(runs) == parts and sum(runs) == items
    assert max(runs) - min(runs) <= 1 and runs == sorted(runs)  # later runs take the remainder


def _best_max(weights: list[int], parts: int) -> int:
    """Brute force: the smallest achievable heaviest run over all contiguous splits."""
    best = None
    for cuts in itertools.combinations(range(1, len(weights)), parts - 1):
        bounds = (0, *cuts, len(weights))
        heaviest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        best = heaviest if best is None else min(best, heaviest)
    assert best is not None
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=9), st.integers(1, 5))
def test_balanced_partition_is_contiguous_complete_and_optimal(weights: list[int], parts: int) -> None:
    runs = balanced_partition(weights, parts)
    if len(weights) < parts:
        assert runs == []
        return
    assert len(runs) == parts and sum(runs) == len(weights) and min(runs) >= 1
    bounds = list(itertools.accumulate([0, *runs]))
    heaviest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
    assert heaviest == _best_max(weights, parts)


# ---- placement invariants ----

_sizes = st.sampled_from([1, 2, 3, 4])


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[int, int, int, int, int, str]:
    tp, pp, dp, cp = draw(_sizes), draw(_sizes), draw(_sizes), draw(_sizes)
    ep = draw(st.sampled_from([e for e in (1, 2, 3, 4, 6, 8) if (dp * cp) % e == 0]))
    rest = [a for a in AXES if a not in ("ep", "dp")]
    order = draw(st.permutations(rest + ["ep-dp"]))
    return tp, pp, dp, cp, ep, "-".join(order)


@settings(max_examples=150, deadline=None)
@given(_layouts(), st.sampled_from([1, 2, 4, 8]))
def test_every_rank_is_in_exactly_one_group_of_each_kind(layout, gpus_per_node: int) -> None:
    tp, pp, dp, cp, ep, order = layout
    try:
        p = place(tp, pp, dp, cp, ep, gpus_per_node, order)
    except OrderError as exc:  # Megatron's refusals (tests/compiler/plan/test_placement_megatron.py says
                               # which, exactly)
        assert exc.rule in ("DSF124", "DSF125", "DSF126"), exc
        return
    world = tp * pp * dp * cp
    sizes = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "dp-cp": dp * cp, "tp-pp": tp * pp, "ep": ep,
             "edp": dp * cp // ep}
    for kind, groups in p.groups.items():
        assert sorted(r for g in groups for r in g) == list(range(world)), kind
        assert all(len(g) == sizes[kind] for g in groups), kind
        assert all(g == sorted(g) for g in groups) and groups == sorted(groups)
    # the coordinates of a rank identify it: no two ranks share all of (tp, pp, dp, cp) positions
    coords = {tuple(p.coordinates(r)[k] for k in ("tp", "pp", "dp", "cp")) for r in range(min(world, 48))}
    assert len(coords) == min(world, 48)
    # expert groups are carved out of the data-parallel (x context-parallel) ranks
    for g in p.groups["ep"]:
        assert set(g) <= set(p.group_of("dp-cp", g[0]))


@settings(max_examples=60, deadline=None)
@given(_sizes, _sizes, _sizes)
def test_default_order_keeps_tensor_parallel_ranks_adjacent(tp: int, pp: int, dp: int) -> None:
    p = place(tp, pp, dp, 1, 1, gpus_per_node=8)
    assert all(g == list(range(g[0], g[0] + tp)) for g in p.groups["tp"])
    assert p.order[0] == "tp" and p.order[-1] == "pp"


def test_nodes_spanned() -> None:
    p = place(tp=4, pp=2, dp=2, cp=1, ep=1, gpus_per_node=4)
    assert not p.crosses_nodes("tp") and p.crosses_nodes("pp") and p.nodes_spanned("pp") == 2


def test_order_errors() -> None:
    with pytest.raises(OrderError, match="ep=3 does not divide"):
        place(tp=1, pp=1, dp=2, cp=1, ep=3, gpus_per_node=8)
