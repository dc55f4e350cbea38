"""place() against an independent model of Megatron-Core's rank groups (tests/reference/megatron_groups.py).

For every (layout, order) Megatron accepts, every group kind dsforge defines is Megatron's, rank for
rank, and the node-crossing questions answer as the groups say; every order Megatron refuses, dsforge
refuses with the rule that carries Megatron's reason. The only deliberate differences: dsforge also
refuses an axis named twice (Megatron only trips over it when that axis is > 1), and orders whose
expert grid has other tensor-parallel groups than the dense one (DSF126; with ep = 1 only MoE models
are refused and ``edp`` is the dp-cp group). A planted fault in place() must fail the comparison.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from dsforge.compiler.plan import placement
from dsforge.compiler.plan.placement import OrderError, Placement, place
from tests.reference.megatron_groups import (
    DUPLICATE_AXIS,
    MISSING_AXIS,
    NOT_DIVISIBLE,
    PP_GROUPS,
    PP_LAST,
    UNKNOWN_AXIS,
    MegatronGroups,
    MegatronRefusal,
    initialize,
    masked_orthogonal_groups,
)

#: which dsforge rule reports each of Megatron's refusals
RULE_OF = {MISSING_AXIS: "DSF117", UNKNOWN_AXIS: "DSF117", DUPLICATE_AXIS: "DSF117", NOT_DIVISIBLE: "DSF114",
           PP_LAST: "DSF124", PP_GROUPS: "DSF125"}
#: dsforge's dense kinds and the token Megatron's decoder generator is asked for
DENSE = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "dp-cp": "dp-cp", "tp-pp": "tp-pp"}
#: dsforge's expert kinds and the token Megatron's expert generator is asked for
EXPERT = {"ep": "ep", "edp": "dp"}
AXES = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class Case:
    """One layout and order, and a node size for the crossing questions."""

    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    order: str
    gpus_per_node: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


def compare(case: Case) -> str:
    """Check place() against the reference for one case; return the outcome class it fell in."""
    try:
        ref: MegatronGroups | None = initialize(case.world, case.tp, case.pp, case.cp, case.ep, case.order)
        refusal = None
    except MegatronRefusal as exc:
        ref, refusal = None, exc
    tokens = [t for t in case.order.split("-") if t]
    if len(set(tokens)) < len(tokens):  # the deliberate difference: any repeated axis, checked first
        ref, refusal = None, MegatronRefusal(DUPLICATE_AXIS, "dsforge refuses any repeated axis")
    try:
        got: Placement | None = place(case.tp, case.pp, case.dp, case.cp, case.ep, case.gpus_per_node,
                                      case.order)
        error = None
    except OrderError as exc:
        got, error = None, exc
    if refusal is not None:
        assert error is not None, f"{case}: Megatron refuses ({refusal}) but place() accepts"
        assert error.rule == RULE_OF[refusal.kind], (f"{case}: {error.rule} for "
                                                     f"Megatron's {refusal.kind}: {error}")
        return f"refused {error.rule}"
    assert ref is not None
    folded = case.tp > 1 and ref.experts("tp") != ref.dense("tp")
    if folded and case.ep > 1:
        assert error is not None and error.rule == "DSF126", f"{case}: expert tp groups differ, got {error}"
        return "refused DSF126"
    assert error is None, f"{case}: Megatron accepts but place() refuses: {error}"
    assert got is not None
    for kind, token in DENSE.items():
        assert got.groups[kind] == ref.dense(token), f"{case}: {kind}"
        _check_nodes(case, got, kind, got.groups[kind])
    if folded:  # ep = 1: only a MoE model needs the expert grid, and DSF126 refuses it
        assert got.expert_note and "tp" in got.expert_note, case
        assert got.groups["edp"] == ref.dense("dp-cp"), f"{case}: edp is the dp-cp group with ep = 1"
        assert got.groups["ep"] == [[r] for r in range(case.world)], case
        outcome = "accepted, expert grid folded (MoE refused)"
    else:
        assert got.expert_note is None, case
        for kind, token in EXPERT.items():
            assert got.groups[kind] == ref.experts(token), f"{case}: {kind}"
        outcome = "accepted"
    for kind in EXPERT:
        _check_nodes(case, got, kind, got.groups[kind])
    _check_expert_carving(case, got)
    return outcome


def _check_nodes(case: Case, got: Placement, kind: str, groups: list[list[int]]) -> None:
    per = case.gpus_per_node
    spans = [len({r // per for r in g}) for g in groups]
    crossing = next((g for g, s in zip(groups, spans) if s > 1), None)
    assert got.crosses_nodes(kind) == (crossing is not None), f"{case}: crosses_nodes({kind})"
    assert got.nodes_spanned(kind) == max(spans), f"{case}: nodes_spanned({kind})"
    assert got.crossing_group(kind) == crossing, f"{case}: crossing_group({kind})"
    assert got.first_group(kind) == groups[0], f"{case}: first_group({kind})"


def _check_expert_carving(case: Case, got: Placement) -> None:
    """edp holds the dense dp x cp ranks of one (tp, pp) position that hold the same experts, whatever the
    order."""
    home = {r: i for i, g in enumerate(got.groups["dp-cp"]) for r in g}
    edp_of = {r: i for i, g in enumerate(got.groups["edp"]) for r in g}
    assert all(len(g) == case.dp * case.cp // case.ep for g in got.groups["edp"]), case
    for kind in ("ep", "edp"):
        for g in got.groups[kind]:
            assert len({home[r] for r in g}) == 1, f"{case}: a {kind} group leaves its dp-cp group: {g}"
    for g in got.groups["ep"]:  # one rank of each expert shard in each edp group: ep x edp is the dp-cp group
        assert len({edp_of[r] for r in g}) == len(g), f"{case}: ep group {g} meets an edp group twice"


# --- the layouts -------------------------------------------------------------------------------------------

_degree = st.sampled_from([1, 1, 1, 2, 2, 2, 3, 4, 4, 8])


@st.composite
def cases(draw: st.DrawFn, max_world: int = 4096) -> Case:
    """A random layout (world <= max_world) and an order: mostly valid permutations, sometimes omitting,
    repeating or misspelling an axis, sometimes an ep that does not divide dp x cp."""
    tp, pp, cp = draw(_degree), draw(_degree), draw(_degree)
    dp = draw(st.sampled_from([1, 1, 2, 2, 3, 4, 4, 6, 8, 16]))
    while tp * pp * cp * dp > max_world:
        dp = max(1, dp // 2)
        tp = max(1, tp // 2)
    room = dp * cp
    divisors = [d for d in range(1, room + 1) if room % d == 0]
    ep = draw(st.sampled_from(divisors)) if draw(st.integers(0, 19)) else draw(st.integers(1, 4))
    sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
    named = [a for a in AXES if sizes[a] > 1 or draw(st.booleans())]
    tokens = draw(st.permutations(named))
    fault = draw(st.integers(0, 39))
    if fault == 0 and tokens:  # omit an axis
        tokens = tokens[:-1]
    elif fault == 1:  # repeat one
        tokens = [*tokens, draw(st.sampled_from(AXES))]
    elif fault == 2:  # misspell one
        tokens = [*tokens, draw(st.sampled_from(["xp", "dpp", "ctx"]))]
    world = tp * pp * dp * cp
    per = draw(st.sampled_from(sorted({1, 2, 3, 4, 8, world, max(1, world // 2)})))
    return Case(tp, pp, dp, cp, ep, "-".join(tokens), per)


def run_comparison(examples: int, seen: Counter[str], max_world: int = 4096, derandomize: bool = False,
                   shrink: bool = True) -> None:
    """Compare ``examples`` random cases, counting the outcome classes in ``seen``."""

    @settings(max_examples=examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate, *([Phase.shrink] if shrink else [])])
    @given(cases(max_world))
    def check(case: Case) -> None:
        seen[compare(case)] += 1

    check()


@pytest.mark.slow  # over ~3 s: the fast tier stays near a minute
def test_place_equals_megatron_over_random_layouts(record_property: Callable[[str, Any], None]) -> None:
    seen: Counter[str] = Counter()
    run_comparison(2500, seen, max_world=512)
    total = sum(seen.values())
    record_property("layouts_compared", total)
    print(f"\nplace() vs Megatron reference: {total} (layout, order) cases: {dict(sorted(seen.items()))}")
    assert total >= 2500
    # the generator reaches every outcome, or the comparison proves less than it claims
    for outcome in ("accepted", "accepted, expert grid folded (MoE refused)", "refused DSF117",
                    "refused DSF114", "refused DSF124", "refused DSF125", "refused DSF126"):
        assert seen[outcome] > 0, (outcome, seen)


def _every_order(names: tuple[str, ...] = AXES) -> Iterator[str]:
    from itertools import permutations
    for n in range(1, len(names) + 1):
        for combo in permutations(names, n):
            yield "-".join(combo)


def test_every_order_of_small_layouts() -> None:
    """Exhaustive over every order naming 1 to 5 distinct axes for a few small layouts with every axis > 1."""
    seen: Counter[str] = Counter()
    for tp, pp, dp, cp, ep in [(2, 2, 2, 2, 2), (2, 2, 2, 2, 4), (2, 2, 3, 2, 3), (2, 3, 1, 2, 2),
                               (1, 2, 2, 2, 1)]:
        for order in _every_order():
            seen[compare(Case(tp, pp, dp, cp, ep, order, 4))] += 1
    assert (
        seen["accepted"] and seen["refused DSF124"] and seen["refused DSF125"] and seen["refused DSF126"]
    ), seen


# --- Megatron's published cases ---------------------------------------------------------------------------

def test_megatron_docstring_masked_groups() -> None:
    # generate_masked_orthogonal_rank_groups: order tp-pp-dp, sizes 2-2-2, the dp groups
    assert masked_orthogonal_groups(8, [2, 2, 2], [False, False, True]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    p = place(tp=2, pp=2, dp=2, cp=1, ep=1, gpus_per_node=8, order="tp-pp-dp")
    assert p.groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # the same docstring: sizes [tp, dp, pp] = [2, 3, 4], mask dp
    groups = masked_orthogonal_groups(24, [2, 3, 4], [False, True, False])
    assert groups[0] == [0, 2, 4] and groups[1] == [1, 3, 5] and groups[7] == [19, 21, 23]
    assert place(tp=2, pp=4, dp=3, cp=1, ep=1, gpus_per_node=8, order="tp-dp-pp").groups["dp"] == groups


def test_megatron_docstring_context_parallel() -> None:
    # initialize_model_parallel, context_parallel_size: 8 GPUs, tp 4, cp 2
    p = place(tp=4, pp=1, dp=1, cp=2, ep=1, gpus_per_node=8)
    assert p.groups["cp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


# tests/unit_tests/test_parallel_state.py test_rank_generator_for_tp_dp_pp: (nodes, gpus, tp, pp, cp, ep)
GOLDEN = [(1, 1, 1, 1, 1, 1), (1, 8, 8, 1, 1, 1), (1, 8, 2, 2, 1, 1), (1, 8, 2, 4, 1, 1), (3, 8, 8, 3, 1, 1),
          (4, 8, 2, 4, 1, 1), (8, 8, 8, 8, 1, 1), (8, 8, 2, 1, 1, 4), (8, 8, 2, 2, 2, 4), (8, 8, 2, 1, 4, 8),
          (8, 8, 2, 2, 2, 8), (16, 8, 4, 8, 1, 1), (16, 8, 4, 8, 1, 4), (16, 8, 4, 8, 4, 1),
          (16, 8, 8, 8, 1, 1), (32, 8, 4, 8, 1, 1), (32, 8, 8, 8, 1, 1), (32, 8, 4, 8, 1, 4),
          (32, 8, 8, 8, 4, 1), (64, 8, 4, 2, 8, 8), (64, 8, 4, 8, 1, 1), (64, 8, 8, 8, 1, 1),
          (96, 8, 4, 8, 1, 1), (128, 8, 4, 2, 8, 8), (128, 8, 4, 8, 1, 1), (256, 8, 4, 8, 1, 1),
          (316, 8, 4, 8, 1, 1), (384, 8, 4, 8, 1, 1), (512, 8, 4, 8, 1, 1), (768, 8, 4, 8, 1, 1),
          (1024, 8, 4, 8, 1, 1), (1280, 8, 4, 8, 1, 1), (1344, 8, 4, 8, 1, 1)]


def _strided(start: int, stop: int, step: int) -> list[int]:
    return list(range(start, stop, step))


@pytest.mark.parametrize("nodes, gpus, tp, pp, cp, ep", GOLDEN)
def test_megatron_golden_layouts(nodes: int, gpus: int, tp: int, pp: int, cp: int, ep: int) -> None:
    """The layouts of Megatron's rank-generator test, with the groups its closed forms give (default
    order)."""
    world = nodes * gpus
    dp, stage = world // (tp * pp * cp), world // pp
    p = place(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, gpus_per_node=gpus)
    assert p.groups["tp"] == [_strided(i * tp, (i + 1) * tp, 1) for i in range(world // tp)]
    assert p.groups["pp"] == [_strided(i, world, stage) for i in range(stage)]
    assert p.groups["dp"] == [_strided(s * stage + j, (s + 1) * stage, tp * cp) for s in range(pp)
                              for j in range(tp * cp)]
    assert p.groups["dp-cp"] == [_strided(s * stage + j, (s + 1) * stage,
                                          tp) for s in range(pp) for j in range(tp)]
    assert p.groups["cp"] == [_strided(s * stage + d * tp * cp + k, s * stage + (d + 1) * tp * cp, tp)
                              for s in range(pp) for d in range(dp) for k in range(tp)]
    edp = world // (tp * ep * pp)  # the expert grid as (pp, edp, ep, tp), tp fastest
    assert p.groups["ep"] == [_strided(s * stage + e * ep * tp + k, s * stage + (e + 1) * ep * tp, tp)
                              for s in range(pp) for e in range(edp) for k in range(tp)]
    assert p.groups["edp"] == [_strided(s * stage + k, (s + 1) * stage, ep * tp) for s in range(pp)
                               for k in range(ep * tp)]


# test_different_initialize_order_consistency: tp-ep-dp-pp and tp-pp-ep-dp give the same groups
@pytest.mark.parametrize("tp, pp, ep",
                         [(1, 8, 1), (2, 4, 1), (4, 2, 1), (8, 1, 1), (4, 1, 2), (1, 1, 8), (1, 1, 2),
                                        (2, 1, 4)])
def test_megatron_orders_consistent(tp: int, pp: int, ep: int) -> None:
    a = place(tp=tp, pp=pp, dp=8 // (tp * pp), cp=1, ep=ep, gpus_per_node=8, order="tp-ep-dp-pp")
    b = place(tp=tp, pp=pp, dp=8 // (tp * pp), cp=1, ep=ep, gpus_per_node=8, order="tp-pp-ep-dp")
    assert dict(a.groups.items()) == dict(b.groups.items())


# test_different_initialize_order_unconsistency (its ep = 1 cases): tp and cp agree, dp, pp and tp-pp differ
@pytest.mark.parametrize("tp, pp", [(1, 2), (1, 4), (2, 2)])
def test_megatron_orders_inconsistent(tp: int, pp: int) -> None:
    a = place(tp=tp, pp=pp, dp=8 // (tp * pp), cp=1, ep=1, gpus_per_node=8, order="tp-ep-dp-pp")
    b = place(tp=tp, pp=pp, dp=8 // (tp * pp), cp=1, ep=1, gpus_per_node=8, order="tp-pp-ep-dp")
    assert a.groups["tp"] == b.groups["tp"] and a.groups["cp"] == b.groups["cp"]
    assert a.groups["dp"] != b.groups["dp"] and a.groups["pp"] != b.groups["pp"]
    assert a.groups["tp-pp"] != b.groups["tp-pp"]


def test_the_reported_edp_bug_is_refused() -> None:
    # issue 16: tp1 pp2 cp2 dp1 ep1 with tp-cp-ep-pp-dp gave edp = the pipeline groups
    with pytest.raises(OrderError) as err:
        place(tp=1, pp=2, dp=1, cp=2, ep=1, gpus_per_node=8, order="tp-cp-ep-pp-dp")
    assert err.value.rule == "DSF124" and "pp-last" in str(err.value)
    # tp2 cp2 dp1 with cp-tp-ep-dp-pp gave edp = the tp groups: now the dp-cp groups, and MoE is refused
    p = place(tp=2, pp=1, dp=1, cp=2, ep=1, gpus_per_node=8, order="cp-tp-ep-dp-pp")
    assert p.groups["edp"] == p.groups["dp-cp"] == [[0, 1], [2, 3]] and p.expert_note


def test_orders_differing_in_size_one_axes_are_accepted() -> None:
    # Megatron's own test order tp-cp-pp-ep-dp, and ep away from dp across size-1 axes
    base = place(tp=2, pp=1, dp=4, cp=1, ep=2, gpus_per_node=8)
    for order in ("tp-cp-pp-ep-dp", "tp-ep-cp-dp-pp", "tp-ep-pp-dp", "ep-dp-tp"):
        assert dict(place(tp=2, pp=1, dp=4, cp=1, ep=2, gpus_per_node=8, order=order).groups.items()) == \
            dict(base.groups.items()) or order == "ep-dp-tp", order


# --- a planted fault must fail the comparison ---------------------------------------------------------------

def _skip_megatron_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    real = placement.check_expert_grid

    def lenient(*args: Any) -> str | None:
        try:
            return real(*args)
        except OrderError:
            return None  # the old behaviour: the pp-last and pipeline-group checks missing
    monkeypatch.setattr(placement, "check_expert_grid", lenient)


def _edp_built_as_ep(monkeypatch: pytest.MonkeyPatch) -> None:
    real = placement.rank_groups

    def wrong(axes: list[str], sizes: dict[str, int], members: set[str]) -> list[list[int]]:
        if sizes["ep"] > 1 and members == {"dp"}:
            members = {"ep"}  # the expert data-parallel groups built along the wrong expert axis
        return real(axes, sizes, members)
    monkeypatch.setattr(placement, "rank_groups", wrong)


def _order_read_slowest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    real = placement.parse_order
    monkeypatch.setattr(placement, "parse_order", lambda order, sizes: real(order, sizes)[::-1])


@pytest.mark.parametrize("fault", [_skip_megatron_checks, _edp_built_as_ep, _order_read_slowest_first])
def test_a_planted_fault_fails_the_comparison(fault: Callable[[pytest.MonkeyPatch], None],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    fault(monkeypatch)
    with pytest.raises(AssertionError):
        run_comparison(600, Counter(), max_world=256, derandomize=True, shrink=False)
