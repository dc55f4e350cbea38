"""The blocking-send model of DeepSpeed's pipeline (`steptime.blocking_send_s`) against a rendezvous
simulation of the instructions DeepSpeed's own TrainSchedule issues: every send and its receive start
together, once both ranks reach them, and hold both ranks for the transfer."""

from __future__ import annotations

import pytest

from dsforge.compiler.estimate.schedule import simulate

pipe_schedule = pytest.importorskip("deepspeed.runtime.pipe.schedule")


def _programs(stages: int, micro_batches: int) -> list[list[tuple[str, tuple[int, int, str] | None]]]:
    """Per stage, DeepSpeed's TrainSchedule as (kind, channel) ops: F, B, or C (a send or receive)."""
    channel = {"SendActivation": lambda s: (s, s + 1, "a"), "RecvActivation": lambda s: (s - 1, s, "a"),
               "SendGrad": lambda s: (s, s - 1, "g"), "RecvGrad": lambda s: (s + 1, s, "g")}
    out = []
    for s in range(stages):
        ops: list[tuple[str, tuple[int, int, str] | None]] = []
        schedule = pipe_schedule.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=s)
        for step in schedule.steps():
            for cmd in step:
                name = type(cmd).__name__
                if name in ("ForwardPass", "BackwardPass"):
                    ops.append((name[0], None))
                elif name in channel:
                    ops.append(("C", channel[name](s)))
        out.append(ops)
    return out


def _rendezvous(stages: int, micro_batches: int, fwd: float, bwd: float, transfer: float) -> float:
    """Makespan of the TrainSchedule with synchronous sends (the n-th send on a channel meets its n-th
    receive)."""
    progs = _programs(stages, micro_batches)
    clock, at = [0.0] * stages, [0] * stages
    count: dict[tuple[tuple[int, int, str], str], int] = {}
    arrived: dict[tuple[tuple[int, int, str], int], dict[str, float]] = {}
    waiting: list[tuple[tuple[int, int, str], int] | None] = [None] * stages
    while any(at[s] < len(progs[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while at[s] < len(progs[s]):
                kind, chan = progs[s][at[s]]
                if chan is None:
                    clock[s] += fwd if kind == "F" else bwd
                else:
                    side = "send" if chan[0] == s else "recv"
                    if waiting[s] is None:
                        n = count.get((chan, side), 0)
                        count[(chan, side)] = n + 1
                        arrived.setdefault((chan, n), {})[side] = clock[s]
                        waiting[s] = (chan, n)
                    met = arrived[waiting[s]]
                    if len(met) < 2:
                        break
                    clock[s], waiting[s] = max(met.values()) + transfer, None
                at[s] += 1
                moved = True
        assert moved, "the schedule deadlocked"
    return max(clock)


@pytest.mark.parametrize(("stages", "micro_batches", "transfer"),
                         [(35, 240, 0.12), (12, 128, 0.037), (4, 16, 0.3), (8, 8, 0.2), (2, 4, 0.5)])
def test_sender_held_for_its_transfer_tracks_the_rendezvous(stages: int, micro_batches: int,
                                                             transfer: float) -> None:
    fwd, bwd = 1.0, 3.0  # a full-recompute backward
    held_f = [[fwd + (transfer if s < stages - 1 else 0.0)] for s in range(stages)]
    held_b = [[bwd + (transfer if s > 0 else 0.0)] for s in range(stages)]
    modelled = simulate("1f1b", held_f, held_b, micro_batches, transfer).makespan
    exact = _rendezvous(stages, micro_batches, fwd, bwd, transfer)
    only_delay = simulate("1f1b", [[fwd]] * stages, [[bwd]] * stages, micro_batches, transfer).makespan
    assert modelled == pytest.approx(exact, rel=0.05)
    assert abs(modelled - exact) < abs(only_delay - exact)


def test_free_transfers_make_deepspeed_schedule_plain_1f1b() -> None:
    # with instant sends DeepSpeed's TrainSchedule is 1F1B: (m + p - 1) (f + b)
    assert _rendezvous(12, 128, 1.0, 3.0, 0.0) == pytest.approx((128 + 11) * 4.0)
