"""Long pipeline steps: the GPipe closed form and the verified period of 1F1B equal the event simulation.

``simulate`` steps through at most ``max_passes`` passes; these tests force its shortcuts with a
small budget on steps short enough to simulate pass by pass too, and compare every rank's end.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.estimate.schedule import MAX_PASSES, event_simulation, simulate

TIMES = st.sampled_from([0.5, 1.0, 1.25, 2.0, 3.0])


def _times(draw: st.DrawFn, p: int, v: int) -> tuple[list[list[float]], list[list[float]]]:
    fwd = [[draw(TIMES) for _ in range(v)] for _ in range(p)]
    bwd = [[2 * draw(TIMES) for _ in range(v)] for _ in range(p)]
    return fwd, bwd


@st.composite
def steps(draw: st.DrawFn, schedules: tuple[str, ...]) -> tuple[str, list[list[float]], list[list[float]],
                                                                int, float]:
    schedule = draw(st.sampled_from(schedules))
    p = draw(st.integers(1, 6))
    v = (
        draw(st.integers(2, 3))
        if schedule == "interleaved"
        else draw(st.integers(1, 2 if schedule == "gpipe" else 1))
    )
    fwd, bwd = _times(draw, p, v)
    m = draw(st.integers(1, 120))
    if v > 1 and schedule != "gpipe":
        m = max(1, m // p) * p  # whole groups (rule DSF203): the interleaved programs deadlock otherwise
    return schedule, fwd, bwd, m, draw(st.sampled_from([0.0, 0.1, 0.7]))


def _same_ends(short, full, p: int) -> None:
    for s in range(p):
        assert short.end_of(s) == pytest.approx(full.end_of(s), rel=1e-9, abs=1e-9)
        assert short.busy(s) == pytest.approx(full.busy(s), rel=1e-9)
    assert short.bubble_fraction == pytest.approx(full.bubble_fraction, rel=1e-6, abs=1e-9)


@settings(max_examples=150, deadline=None)
@given(step=steps(("gpipe",)), budget=st.integers(2, 40))
def test_gpipe_closed_form_equals_the_event_simulation(step, budget: int) -> None:
    schedule, fwd, bwd, m, transfer = step
    p, v = len(fwd), len(fwd[0])
    short = simulate(schedule, fwd, bwd, m, transfer, max_passes=2 * p * v * budget)
    assert short.exact
    _same_ends(short, event_simulation(schedule, fwd, bwd, m, transfer), p)


@settings(max_examples=200, deadline=None)
@given(step=steps(("1f1b", "interleaved")), budget=st.integers(40, 400))
def test_verified_period_equals_the_event_simulation(step, budget: int) -> None:
    schedule, fwd, bwd, m, transfer = step
    p, v = len(fwd), len(fwd[0])
    short = simulate(schedule, fwd, bwd, m, transfer, max_passes=2 * p * v * budget)
    full = event_simulation(schedule, fwd, bwd, m, transfer)
    if short.exact:
        _same_ends(short, full, p)
    else:  # the pace estimate of pipelines too deep for the budget: close, and never below the slowest rank
        assert short.makespan == pytest.approx(full.makespan, rel=0.25)
        assert short.makespan >= max(short.busy(s) for s in range(p)) - 1e-9


def test_the_period_is_found_for_a_long_step() -> None:
    fwd, bwd = [[1.2], [1.0], [1.0], [1.5]], [[2.4], [2.0], [2.0], [3.0]]
    m = 5_000  # 40,000 passes: simulated in full and shortened from a step of ~50 micro-batches
    short, full = simulate("1f1b", fwd, bwd, m, 0.05,
                           max_passes=2_000), event_simulation("1f1b", fwd, bwd, m, 0.05)
    assert short.exact and short.shown_micro_batches is not None and short.shown_micro_batches < 200
    _same_ends(short, full, 4)


def test_equal_stages_pace_estimate_is_exact() -> None:
    p, m = 200, 10**9  # far too deep to simulate to its steady state within the default budget
    t = simulate("1f1b", [[1.0]] * p, [[2.0]] * p, m)
    assert t.makespan == pytest.approx((m + p - 1) * 3.0, rel=1e-12)
    assert len(t.stages) == p


@pytest.mark.parametrize("schedule,p,v",
                         [("1f1b", 2, 1), ("1f1b", 8, 1), ("interleaved", 4, 2), ("gpipe", 8, 2),
                                          ("1f1b", 1024, 1), ("interleaved", 1024, 9), ("gpipe", 1024, 9)])
def test_a_step_of_a_trillion_micro_batches_takes_well_under_a_second(schedule: str, p: int, v: int) -> None:
    m = 2**40 - (2**40 % p if v > 1 else 0)
    fwd = [[1.0 + 0.25 * (s == 0) + 0.5 * (s == p - 1)] * v for s in range(p)]
    bwd = [[2 * x for x in row] for row in fwd]
    began = time.process_time()  # CPU seconds: wall time on a loaded 2-core machine measured the load (2.8 s
                                 # once)
    t = simulate(schedule, fwd, bwd, m, 0.01)
    assert time.process_time() - began < 2.0  # ~0.1-0.5 s
    slowest = max(sum(f) + sum(b) for f, b in zip(fwd, bwd))
    assert m * slowest <= t.makespan <= m * slowest * 1.01
    assert sum(len(row) for row in t.stages) <= MAX_PASSES
