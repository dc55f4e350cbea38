"""The GPipe schedule dsforge runs on DeepSpeed's PipelineEngine, checked as instruction streams (no launch).

Each stage's stream is replayed against its neighbours' with blocking (rendezvous) send/recv: every
stream must run to its end (no deadlock), every micro-batch must be loaded, run forward and then
backward exactly once per stage, the last stage must backpropagate the loss of the micro-batch it
runs backward on, and the pipeline buffers the engine reserves must equal the activations the cost
model counts for GPipe (all m micro-batches in flight). Equal training against the single-process
model is tests/runtime_e2e/test_equivalence.py's `pp2-gpipe` layout.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from deepspeed.runtime.pipe import schedule as ds

from dsforge.compiler.estimate.activations import in_flight
from dsforge.runtime.gpipe import GPipeSchedule, KeepLoss, RestoreLoss

pytestmark = pytest.mark.slow  # imports DeepSpeed (~3 s CPU)

SEND = {ds.SendActivation: ("act", +1), ds.SendGrad: ("grad", -1)}
RECV = {ds.RecvActivation: ("act", -1), ds.RecvGrad: ("grad", +1)}


def streams(micro: int, stages: int) -> list[list[object]]:
    return [[cmd for step in GPipeSchedule(micro, stages, s).steps() for cmd in step] for s in range(stages)]


def replay(micro: int, stages: int) -> list[list[tuple[str, int]]]:
    """Run every stage's stream with blocking send/recv; each stage's (event, micro-batch) log, in order."""
    todo = streams(micro, stages)
    pos = [0] * stages
    logs: list[list[tuple[str, int]]] = [[] for _ in range(stages)]
    loss_of: dict[int, int] = {}
    kept: dict[int, int] = {}
    while any(pos[s] < len(todo[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while pos[s] < len(todo[s]):
                cmd = todo[s][pos[s]]
                if type(cmd) in SEND:
                    kind, step = SEND[type(cmd)]
                    peer = s + step
                    other = todo[peer][pos[peer]] if pos[peer] < len(todo[peer]) else None
                    if other is None or RECV.get(type(other)) != (kind, -step):
                        break  # the receiver is not there yet: a blocking send waits
                    assert other.buffer_id == cmd.buffer_id, (s, cmd, other)  # type: ignore[attr-defined]
                    logs[peer].append((f"recv-{kind}", other.buffer_id))  # type: ignore[attr-defined]
                    pos[peer] += 1
                elif type(cmd) in RECV:
                    break  # completed by the matching send
                elif isinstance(cmd, ds.ForwardPass):
                    loss_of[s] = cmd.buffer_id  # the engine's single `loss` attribute
                elif isinstance(cmd, KeepLoss):
                    kept[cmd.buffer_id] = loss_of[s]
                elif isinstance(cmd, RestoreLoss):
                    loss_of[s] = kept.pop(cmd.buffer_id)
                elif isinstance(cmd, ds.BackwardPass) and s == stages - 1:
                    assert loss_of[s] == cmd.buffer_id, (f"backward of {cmd.buffer_id} "
                                                         f"on the loss of {loss_of[s]}")
                name = type(cmd).__name__
                logs[s].append((name, getattr(cmd, "buffer_id", -1)))
                pos[s] += 1
                moved = True
        if not moved:
            raise AssertionError(f"deadlock: stages wait at "
                                 f"{[todo[s][pos[s]] for s in range(stages) if pos[s] < len(todo[s])]}")
    return logs


@settings(max_examples=60, deadline=None)
@given(micro=st.integers(1, 12), stages=st.integers(2, 6))
def test_every_stage_runs_all_forwards_then_all_backwards_without_deadlock(micro: int, stages: int) -> None:
    logs = replay(micro, stages)
    for s, log in enumerate(logs):
        passes = [(e, m) for e, m in log if e in ("ForwardPass", "BackwardPass")]
        assert passes == [("ForwardPass",
                           m) for m in range(micro)] + [("BackwardPass", m) for m in reversed(range(micro))]
        loads = [m for e, m in log if e == "LoadMicroBatch"]
        assert loads == (list(range(micro)) if s in (0, stages - 1) else [])
        tail = [e for e, _ in log[-3:]]
        assert tail == ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]
        if s > 0:
            assert [m for e, m in log if e == "recv-act"] == list(range(micro))
        if s < stages - 1:
            assert [m for e, m in log if e == "recv-grad"] == list(reversed(range(micro)))


@given(micro=st.integers(1, 64), stages=st.integers(2, 16), data=st.data())
def test_the_buffers_it_keeps_are_the_activations_the_cost_model_counts(micro: int, stages: int,
                                                                        data: st.DataObject) -> None:
    stage = data.draw(st.integers(0, stages - 1))
    buffers = GPipeSchedule(micro, stages, stage).num_pipe_buffers()
    assert in_flight("gpipe", stages, stage, micro, 1) == micro
    assert buffers == max(2, micro)  # DeepSpeed reserves at least 2; a buffer never used holds nothing
    # DeepSpeed's own 1F1B keeps fewer: what the GPipe estimate's extra memory is for
    assert ds.TrainSchedule(micro, stages, stage).num_pipe_buffers() <= buffers
