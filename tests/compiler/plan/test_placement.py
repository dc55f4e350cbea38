"""Rank placement follows Megatron-LM's RankGenerator (golden groups from its parallel_state docstring)."""

from __future__ import annotations

import pytest

from dsforge.compiler.plan.placement import OrderError, place


def test_megatron_docstring_example_tp2_pp4_dp2() -> None:
    # megatron/core/parallel_state.py initialize_model_parallel docstring: 16 GPUs, TP 2, PP 4.
    p = place(tp=2, pp=4, dp=2, cp=1, ep=1, gpus_per_node=8)
    assert p.groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert p.groups["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert p.groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert p.groups["tp-pp"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]


def test_every_rank_in_exactly_one_group_of_each_kind() -> None:
    p = place(tp=2, pp=2, dp=4, cp=2, ep=4, gpus_per_node=8)
    for kind, groups in p.groups.items():
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(32)), kind


def test_expert_groups_are_carved_from_data_parallel_ranks() -> None:
    p = place(tp=1, pp=1, dp=4, cp=1, ep=2, gpus_per_node=4)
    assert p.groups["ep"] == [[0, 1], [2, 3]]
    assert p.groups["edp"] == [[0, 2], [1, 3]]
    for g in p.groups["ep"]:
        assert set(g) <= set(p.group_of("dp", g[0]))


def test_order_changes_which_axis_is_contiguous() -> None:
    p = place(tp=2, pp=1, dp=2, cp=1, ep=1, gpus_per_node=2, order="dp-tp-pp")
    assert p.groups["dp"] == [[0, 1], [2, 3]]
    assert p.groups["tp"] == [[0, 2], [1, 3]]
    assert p.crosses_nodes("tp") and not p.crosses_nodes("dp")


@pytest.mark.parametrize("order, words", [
    ("tp-xx-dp", "unknown axis"), ("tp-tp-dp-pp", "twice"), ("tp-pp", "omits"), ("tp-ep-pp-dp", "pp-last"),
    ("tp--dp-pp", "empty")])
def test_bad_orders(order: str, words: str) -> None:
    with pytest.raises(OrderError, match=words):
        place(tp=2, pp=2, dp=2, cp=1, ep=2, gpus_per_node=8, order=order)
