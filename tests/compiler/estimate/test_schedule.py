"""Pipeline schedule simulation: closed-form bubbles for equal stages, dependencies, memory, uneven stages."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.estimate.schedule import ScheduleError, Timeline, program, simulate
from dsforge.compiler.plan.bubble import bubble_fraction


def equal(p: int, v: int, tf: float = 1.0, tb: float = 2.0) -> tuple[list[list[float]], list[list[float]]]:
    """Per-stage per-chunk times of a model split into p x v equal chunks."""
    return [[tf / v] * v for _ in range(p)], [[tb / v] * v for _ in range(p)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 16), (8, 8), (8, 64), (16, 192)])
def test_equal_stages_bubble_is_closed_form(schedule: str, p: int, m: int) -> None:
    t = simulate(schedule, *equal(p, 1), m)
    assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert t.makespan == pytest.approx((m + p - 1) * 3.0)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 16, 3), (8, 16, 2), (8, 32, 4)])
def test_interleaving_divides_the_bubble_by_about_v(p: int, m: int, v: int) -> None:
    inter = simulate("interleaved", *equal(p, v), m)
    plain = simulate("1f1b", *equal(p, 1), m)
    assert inter.bubble_fraction == pytest.approx(bubble_fraction(p, m, v), abs=1e-9)
    # bubble time (p-1)(tf+tb)/v instead of (p-1)(tf+tb): smaller by exactly v in absolute time
    idle = inter.makespan - m * 3.0
    assert idle == pytest.approx((plain.makespan - m * 3.0) / v)


def _check_invariants(t: Timeline, schedule: str, p: int, m: int, v: int, transfer: float) -> None:
    ends = {(s.kind, s.micro_batch, s.chunk * p + stage): s for stage,
            row in enumerate(t.stages) for s in row}
    assert len(ends) == 2 * m * p * v  # every pass exactly once
    for stage, row in enumerate(t.stages):
        for a, b in itertools.pairwise(row):
            assert b.start >= a.end - 1e-12  # one pass at a time per rank
        for s in row:
            k = s.chunk * p + stage
            if s.kind == "F" and k > 0:
                prev = ends[("F", s.micro_batch, k - 1)]
                hop = transfer if (k - 1) % p != stage else 0.0
                assert s.start >= prev.end + hop - 1e-12
            if s.kind == "B":
                dep = ends[("F", s.micro_batch, k)] if k == p * v - 1 else ends[("B", s.micro_batch, k + 1)]
                assert s.start >= dep.end - 1e-12


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), groups=st.integers(1, 4), v=st.integers(1, 3),
       transfer=st.sampled_from([0.0, 0.05]), times=st.lists(st.floats(0.1, 3.0), min_size=36, max_size=36))
def test_any_schedule_respects_dependencies(p: int, groups: int, v: int, transfer: float,
                                            times: list[float]) -> None:
    m = groups * p  # the interleaved schedule needs m to be a multiple of p (rule DSF203)
    fwd = [[times[(s * v + c) % 36] for c in range(v)] for s in range(p)]
    bwd = [[2 * times[(s * v + c + 7) % 36] for c in range(v)] for s in range(p)]
    for schedule in (["gpipe", "1f1b"] if v == 1 else ["gpipe", "interleaved"]):
        t = simulate(schedule, fwd, bwd, m, transfer)
        _check_invariants(t, schedule, p, m, v, transfer)
        slowest = max(sum(f) + sum(b) for f, b in zip(fwd, bwd))
        assert t.makespan >= m * slowest - 1e-9  # the slowest rank bounds the step


def in_flight(row: list, m: int) -> int:
    """The most micro-batches whose forward has run and whose backward has not, on one rank."""
    live = peak = 0
    for s in row:
        live += 1 if s.kind == "F" else -1
        peak = max(peak, live)
    return peak


def test_1f1b_keeps_at_most_p_micro_batches_in_flight_gpipe_keeps_all() -> None:
    p, m = 4, 16
    one = simulate("1f1b", *equal(p, 1), m)
    gpipe = simulate("gpipe", *equal(p, 1), m)
    assert [in_flight(row, m) for row in one.stages] == [4, 3, 2, 1]
    assert all(in_flight(row, m) == m for row in gpipe.stages)


def test_1f1b_program_is_warmup_then_alternation() -> None:
    ops = program("1f1b", 4, 6, 1, 1)
    kinds = "".join(k for k, _, _ in ops)
    assert kinds == "FF" + "FB" * 4 + "BB"
    assert [i for k, i, _ in ops if k == "B"] == list(range(6))


def test_uneven_stage_paces_the_pipeline() -> None:
    m = 32
    fwd, bwd = [[1.0], [1.0], [1.5], [1.0]], [[2.0], [2.0], [3.0], [2.0]]
    t = simulate("1f1b", fwd, bwd, m)
    # steady state runs at the slow stage's pace; warm-up and drain add the others once
    assert t.makespan == pytest.approx(m * 4.5 + 3 * 3.0, rel=0.02)
    assert t.bubble_fraction > bubble_fraction(4, m)


def test_transfers_delay_the_dependency_chain() -> None:
    p, d = 4, 0.1
    # GPipe streams: only the fill and the drain cross the p-1 links, once each way
    base = simulate("gpipe", *equal(p, 1), 8)
    slow = simulate("gpipe", *equal(p, 1), 8, transfer_s=d)
    assert slow.makespan == pytest.approx(base.makespan + 2 * (p - 1) * d)
    # 1F1B has no slack in steady state: its p micro-batches in flight wait for a 2(p-1)-hop round trip,
    # so every further micro-batch costs (tf + tb) + 2(p-1)/p transfers
    short, long = (simulate("1f1b", *equal(p, 1), m, transfer_s=d).makespan for m in (16, 32))
    assert long - short == pytest.approx(16 * (3.0 + 2 * (p - 1) / p * d))


def test_bad_inputs_are_reported() -> None:
    with pytest.raises(ScheduleError):
        simulate("1f1b", [[1.0], [1.0, 1.0]], [[1.0], [1.0, 1.0]], 4)
    with pytest.raises(ScheduleError):
        simulate("zero-bubble", *equal(2, 1), 4)
    with pytest.raises(ScheduleError):
        simulate("1f1b", [], [], 4)
