"""The node questions (does a group leave its node, which group first, how many nodes) answered from base
residues and gaps equal the answers read off every built group."""

from __future__ import annotations

from itertools import permutations

from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.plan.placement import OrderError, place

KINDS = ("tp", "pp", "dp", "cp", "dp-cp", "tp-pp", "ep", "edp")
ORDERS = ["-".join(p) for p in permutations(("tp", "cp", "ep", "dp", "pp"))]


def _brute(groups: list[list[int]], per: int) -> tuple[bool, list[int] | None, int]:
    nodes = [len({r // per for r in g}) for g in groups]
    crossing = next((g for g, n in zip(groups, nodes) if n > 1), None)
    return crossing is not None, crossing, max(nodes, default=1)


@settings(max_examples=300, deadline=None)
@given(tp=st.integers(1, 6), pp=st.integers(1, 4), dp=st.integers(1, 6), cp=st.integers(1, 4),
       ep=st.integers(1, 4), per=st.integers(1, 12), order=st.sampled_from(ORDERS))
def test_residues_answer_as_the_built_groups(tp: int, pp: int, dp: int, cp: int, ep: int, per: int,
                                             order: str) -> None:
    try:
        placement = place(tp, pp, dp, cp, ep, per, order)
    except OrderError:
        return
    for kind in KINDS:
        groups = sorted(placement.groups[kind], key=lambda g: g[0])
        crosses, first, spanned = _brute(groups, per)
        assert placement.crosses_nodes(kind) == crosses, kind
        assert placement.crossing_group(kind) == first, kind
        assert placement.nodes_spanned(kind) == spanned, kind


def test_a_million_ranks_are_answered_without_listing_them() -> None:
    placement = place(2, 2, 2, 2**17, 1, 8)  # 2^20 ranks; cp groups of 131,072
    assert placement.crosses_nodes("cp") and placement.nodes_spanned("cp") == 2**15
    assert not placement.crosses_nodes("tp") and placement.nodes_spanned("tp") == 1
