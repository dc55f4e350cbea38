"""Event simulation of pipeline schedules: GPipe, 1F1B and interleaved 1F1B.

Each pipeline rank runs a fixed program (its order of forward and backward passes); the simulator
starts every pass at the later of "the rank is free" and "its input has arrived": the forward of
micro-batch i on model chunk k needs chunk k-1's forward of i, the backward of i on chunk k needs
chunk k+1's backward of i (the last chunk's backward follows its own forward), plus the point-to-
point transfer time when the two chunks sit on different ranks. Programs follow the papers:

* GPipe (Huang et al. 2019): every forward, then every backward.
* 1F1B / PipeDream-Flush (Narayanan et al. 2021, sec. 2.2.1): p-s-1 warm-up forwards on stage s,
  then one forward and one backward alternately, then the remaining backwards.
* Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2.2; Megatron-LM
  ``forward_backward_pipelining_with_interleaving``): v chunks per rank, chunk j of rank s being
  model chunk j·p + s; micro-batches run in groups of p through each chunk in turn, with
  (p-s-1)·2 + (v-1)·p warm-up forwards.

For equal stages and free transfers the idle fraction is (p-1)/(m+p-1), and about (p-1)/(v·m+p-1)
interleaved (the closed form in `dsforge.compiler.bubble`); uneven partitions and transfer times
are what the simulation adds.
"""

from __future__ import annotations

from dataclasses import dataclass


class ScheduleError(ValueError):
    """The schedule cannot run these sizes (it would deadlock, or the inputs are inconsistent)."""


@dataclass(frozen=True)
class Slot:
    """One pass on one pipeline rank: kind "F" or "B", micro-batch, the rank's chunk index, start and end (s)."""

    kind: str
    micro_batch: int
    chunk: int
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Per-rank passes of one step, in execution order."""

    stages: list[list[Slot]]

    @property
    def makespan(self) -> float:
        """Time from the first forward to the last backward (s)."""
        return max((s[-1].end for s in self.stages if s), default=0.0)

    def busy(self, stage: int) -> float:
        """Seconds rank ``stage`` spends computing."""
        return sum(slot.end - slot.start for slot in self.stages[stage])

    def end_of(self, stage: int) -> float:
        """When rank ``stage`` finishes its last pass (s)."""
        return self.stages[stage][-1].end if self.stages[stage] else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks over the makespan: 1 - sum(busy) / (p x makespan)."""
        span = self.makespan
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy(s) for s in range(len(self.stages))) / (len(self.stages) * span)


Op = tuple[str, int, int]  # (kind, micro-batch, chunk)


def _interleaved_order(m: int, p: int, v: int, reverse: bool) -> list[tuple[int, int]]:
    """(micro-batch, chunk) order of a rank's forwards (or backwards, chunks reversed): groups of p micro-batches."""
    order = []
    for group in range(0, m, p):
        batch = range(group, min(group + p, m))
        for c in (reversed(range(v)) if reverse else range(v)):
            order += [(i, c) for i in batch]
    return order


def program(schedule: str, stages: int, micro_batches: int, chunks: int, stage: int) -> list[Op]:
    """The ordered passes rank ``stage`` runs under ``schedule`` (gpipe | 1f1b | interleaved)."""
    p, m, v = stages, micro_batches, chunks
    if schedule == "gpipe":
        fwd = [("F", i, c) for c in range(v) for i in range(m)]
        return fwd + [("B", i, c) for c in reversed(range(v)) for i in range(m)]
    if schedule not in ("1f1b", "interleaved"):
        raise ScheduleError(f"unknown pipeline schedule {schedule!r}")
    fwd = [("F", i, c) for i, c in _interleaved_order(m, p, v, reverse=False)]
    bwd = [("B", i, c) for i, c in _interleaved_order(m, p, v, reverse=True)]
    warmup = (p - stage - 1) if v == 1 else (p - stage - 1) * 2 + (v - 1) * p
    warmup = min(warmup, len(fwd))
    ops = fwd[:warmup]
    for k in range(len(fwd) - warmup):
        ops += [fwd[warmup + k], bwd[k]]
    return ops + bwd[len(fwd) - warmup:]


def _dependency(op: Op, stage: int, p: int, v: int) -> tuple[Op, int] | None:
    """The pass (and its rank) whose output ``op`` consumes, or None for the first chunk's forward."""
    kind, i, c = op
    k = c * p + stage  # the model chunk this pass runs
    if kind == "F":
        return None if k == 0 else (("F", i, (k - 1) // p), (k - 1) % p)
    if k == p * v - 1:
        return ("F", i, c), stage
    return ("B", i, (k + 1) // p), (k + 1) % p


def simulate(schedule: str, forward_s: list[list[float]], backward_s: list[list[float]], micro_batches: int,
             transfer_s: float = 0.0) -> Timeline:
    """Run a schedule: ``forward_s[s][c]`` / ``backward_s[s][c]`` are rank s's pass times on its chunk c (s).

    ``transfer_s`` is the point-to-point time of one activation (or gradient) between two ranks.
    Raises ScheduleError if the programs deadlock or the inputs disagree.
    """
    p = len(forward_s)
    v = len(forward_s[0]) if p else 0
    if p == 0 or micro_batches < 1 or any(len(f) != v or len(b) != v for f, b in zip(forward_s, backward_s)):
        raise ScheduleError("need per-stage forward and backward times for the same number of chunks")
    programs = [program(schedule, p, micro_batches, v, s) for s in range(p)]
    done: dict[tuple[Op, int], float] = {}
    next_op, free = [0] * p, [0.0] * p
    slots: list[list[Slot]] = [[] for _ in range(p)]
    remaining = sum(len(prog) for prog in programs)
    while remaining:
        progressed = False
        for s in range(p):
            while next_op[s] < len(programs[s]):
                op = programs[s][next_op[s]]
                dep = _dependency(op, s, p, v)
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (transfer_s if dep[1] != s else 0.0)
                start = max(free[s], ready)
                length = (forward_s if op[0] == "F" else backward_s)[s][op[2]]
                free[s] = done[(op, s)] = start + length
                slots[s].append(Slot(op[0], op[1], op[2], start, start + length))
                next_op[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError(f"the {schedule} schedule deadlocks with p={p}, m={micro_batches}, v={v}")
    return Timeline(slots)
