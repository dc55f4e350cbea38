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
interleaved (the closed form in `dsforge.compiler.plan.bubble`); uneven partitions and transfer times
are what the simulation adds.

Every micro-batch of a step is the same, so a step of 10^12 micro-batches is not simulated pass by
pass (``simulate`` costs at most ``max_passes`` simulated passes on any input):

* GPipe is two flow shops (every forward, then every backward) and has a closed form: the end of
  chunk k's pass i is a maximum of affine functions of i, carried chunk by chunk (``_gpipe``).
* 1F1B and interleaved 1F1B settle into a periodic steady state: after the warm-up the passes of
  micro-batches i+P start exactly Δ seconds after those of i. A shorter step with the same
  remainder mod P is simulated, the period is verified on a window of passes long enough that
  every later pass depends only on it, and the middle is repeated arithmetically: the ends are
  those of the shorter step plus n·Δ (max-plus systems are shift-invariant). Where no period shows
  within the budget (pipelines of hundreds of stages with long transients), the ends follow from
  the slowest rank's pace (an estimate, flagged by ``Timeline.exact``).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Most passes ``simulate`` steps through for one call (~0.3 s); longer steps are derived or extrapolated, and
#: the shorter step they show as their timeline has at most a quarter of this.
MAX_PASSES = 100_000


class ScheduleError(ValueError):
    """The schedule cannot run these sizes (it would deadlock, or the inputs are inconsistent)."""


@dataclass(frozen=True)
class Slot:
    """One pass on one pipeline rank: kind "F" or "B", micro-batch, the rank's chunk index, start and end
    (s)."""

    kind: str
    micro_batch: int
    chunk: int
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Per-rank passes of one step, in execution order.

    For a long step ``stages`` lists the passes of a representative shorter step (``shown_micro_batches``
    of them) while ``ends`` and ``busy_s`` hold the whole step's figures; ``exact`` is False where the
    steady state was estimated rather than simulated or derived.
    """

    stages: list[list[Slot]]
    ends: tuple[float, ...] | None = None
    busy_s: tuple[float, ...] | None = None
    shown_micro_batches: int | None = None
    exact: bool = True

    @property
    def makespan(self) -> float:
        """Time from the first forward to the last backward (s)."""
        if self.ends is not None:
            return max(self.ends, default=0.0)
        return max((s[-1].end for s in self.stages if s), default=0.0)

    def busy(self, stage: int) -> float:
        """Seconds rank ``stage`` spends computing."""
        if self.busy_s is not None:
            return self.busy_s[stage]
        return sum(slot.end - slot.start for slot in self.stages[stage])

    def end_of(self, stage: int) -> float:
        """When rank ``stage`` finishes its last pass (s)."""
        if self.ends is not None:
            return self.ends[stage]
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
    """(micro-batch, chunk) order of a rank's forwards (or backwards, chunks reversed): groups of p
    micro-batches."""
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
    warmup = _warmup(p, v, stage, len(fwd))
    ops = fwd[:warmup]
    for k in range(len(fwd) - warmup):
        ops += [fwd[warmup + k], bwd[k]]
    return ops + bwd[len(fwd) - warmup:]


def _warmup(p: int, v: int, stage: int, forwards: int) -> int:
    """Forwards rank ``stage`` runs before its first backward (1F1B; Megatron's count when interleaved)."""
    return min((p - stage - 1) if v == 1 else (p - stage - 1) * 2 + (v - 1) * p, forwards)


def _dependency(op: Op, stage: int, p: int, v: int) -> tuple[Op, int] | None:
    """The pass (and its rank) whose output ``op`` consumes, or None for the first chunk's forward."""
    kind, i, c = op
    k = c * p + stage  # the model chunk this pass runs
    if kind == "F":
        return None if k == 0 else (("F", i, (k - 1) // p), (k - 1) % p)
    if k == p * v - 1:
        return ("F", i, c), stage
    return ("B", i, (k + 1) // p), (k + 1) % p


def _check_inputs(forward_s: list[list[float]], backward_s: list[list[float]],
                  micro_batches: int) -> tuple[int, int]:
    p = len(forward_s)
    v = len(forward_s[0]) if p else 0
    if p == 0 or v == 0 or micro_batches < 1 or len(backward_s) != p or any(
            len(f) != v or len(b) != v for f, b in zip(forward_s, backward_s)):
        raise ScheduleError("need per-stage forward and backward times for the same number of chunks")
    return p, v


def simulate(schedule: str, forward_s: list[list[float]], backward_s: list[list[float]], micro_batches: int,
             transfer_s: float = 0.0, max_passes: int = MAX_PASSES) -> Timeline:
    """Run a schedule: ``forward_s[s][c]`` / ``backward_s[s][c]`` are rank s's pass times on its chunk c (s).

    ``transfer_s`` is the point-to-point time of one activation (or gradient) between two ranks.
    Steps of more than ``max_passes`` passes are derived or extrapolated (module docstring), so the cost
    is bounded whatever ``micro_batches`` is. Raises ScheduleError if the programs deadlock or the inputs
    disagree.
    """
    p, v = _check_inputs(forward_s, backward_s, micro_batches)
    if schedule not in ("gpipe", "1f1b", "interleaved"):
        raise ScheduleError(f"unknown pipeline schedule {schedule!r}")
    if 2 * p * v * micro_batches <= max_passes:
        return event_simulation(schedule, forward_s, backward_s, micro_batches, transfer_s)
    if schedule == "gpipe":
        return _gpipe(forward_s, backward_s, micro_batches, transfer_s, max_passes)
    return _periodic(schedule, forward_s, backward_s, micro_batches, transfer_s, max_passes)


def event_simulation(schedule: str, forward_s: list[list[float]], backward_s: list[list[float]],
                     micro_batches: int, transfer_s: float = 0.0) -> Timeline:
    """Step through every pass of every rank (the reference the shortcuts of ``simulate`` must equal).

    A rank runs its program until a pass waits for another rank's output; a rank that made progress
    wakes its two neighbours (the only ranks that consume its outputs), so the cost is linear in the
    number of passes rather than passes x ranks. Each model chunk runs its forwards (and its backwards)
    in micro-batch order, so "has pass i of chunk k ended" is "does chunk k's list of ends hold i".
    """
    p, v = _check_inputs(forward_s, backward_s, micro_batches)
    chunks = p * v
    programs = [program(schedule, p, micro_batches, v, s) for s in range(p)]
    ends: dict[str, list[list[float]]] = {"F": [[] for _ in range(chunks)], "B": [[] for _ in range(chunks)]}
    next_op, free = [0] * p, [0.0] * p
    slots: list[list[Slot]] = [[] for _ in range(p)]
    pending = list(range(p - 1, -1, -1))
    queued = [True] * p
    while pending:
        s = pending.pop()
        queued[s] = False
        prog, times, n, begun = programs[s], {"F": forward_s[s], "B": backward_s[s]}, next_op[s], next_op[s]
        row, clock = slots[s], free[s]
        while n < len(prog):
            kind, i, c = prog[n]
            k = c * p + s
            if kind == "F":
                src, dep_kind = k - 1, "F"
            else:
                src, dep_kind = (k, "F") if k == chunks - 1 else (k + 1, "B")
            if src >= 0:
                dep_ends = ends[dep_kind][src]
                if len(dep_ends) <= i:
                    break
                ready = dep_ends[i] + (transfer_s if src % p != s else 0.0)
                start = max(clock, ready)
            else:
                start = clock
            clock = start + times[kind][c]
            ends[kind][k].append(clock)
            row.append(Slot(kind, i, c, start, clock))
            n += 1
        next_op[s], free[s] = n, clock
        if n > begun:
            for other in ((s + 1) % p, (s - 1) % p):
                if not queued[other] and next_op[other] < len(programs[other]):
                    queued[other] = True
                    pending.append(other)
    if any(next_op[s] < len(programs[s]) for s in range(p)):
        raise ScheduleError(f"the {schedule} schedule deadlocks with p={p}, m={micro_batches}, v={v}")
    return Timeline(slots)


def _busy(forward_s: list[list[float]], backward_s: list[list[float]], m: int) -> tuple[float, ...]:
    return tuple(m * (sum(f) + sum(b)) for f, b in zip(forward_s, backward_s))


# --- GPipe: a closed form -------------------------------------------------------------------------------

Lines = list[tuple[float, float]]  # max over (intercept, slope) of intercept + slope * i, for i in [0, m-1]


def _envelope(lines: Lines, last: int) -> Lines:
    """The lines that reach the maximum somewhere on [0, last] (the others can never matter)."""
    best: dict[float, float] = {}
    for a, b in lines:
        if a > best.get(b, float("-inf")):
            best[b] = a
    kept = sorted((b, a) for b, a in best.items())
    out: list[tuple[float, float]] = []
    for b, a in kept:  # ascending slope: each new line dominates the end of the interval
        while out:
            b0, a0 = out[-1]
            if a0 <= a:  # the new line is higher at 0 and steeper: the old one never wins
                out.pop()
                continue
            # the old line wins up to the crossing; it matters only if that lies inside [0, last]
            if len(out) >= 2:
                b1, a1 = out[-2]
                if (a1 - a) * (b0 - b1) <= (a1 - a0) * (b - b1):
                    out.pop()
                    continue
            break
        out.append((b, a))
    # drop lines whose whole winning range lies beyond `last`
    while len(out) >= 2:
        b1, a1 = out[-2]
        b0, a0 = out[-1]
        if a0 + b0 * last <= a1 + b1 * last:
            out.pop()
        else:
            break
    return [(a, b) for b, a in out]


def _at(lines: Lines, i: int) -> float:
    return max(a + b * i for a, b in lines)


def _flow(dep: Lines | None, hop: float, before: float, d: float, last: int) -> Lines:
    """A chunk's pass i ends at max(its previous pass, the dependency's pass i + hop) + d, as lines in i.

    max over j <= i of (dep(j) + hop) + (i - j + 1)·d is, for one line a + b·j, attained at j = 0 or j = i:
    a + hop + d + max(b, d)·i. The rank's pass before i = 0 ends at ``before``.
    """
    lines: Lines = [(before + d, d)]
    if dep is not None:
        lines += [(a + hop + d, max(b, d)) for a, b in dep]
    return _envelope(lines, last)


def _gpipe(forward_s: list[list[float]], backward_s: list[list[float]], m: int, transfer_s: float,
           max_passes: int) -> Timeline:
    """GPipe's ends in closed form: every forward of every chunk, then every backward, chunk after chunk."""
    p, v = len(forward_s), len(forward_s[0])
    last, chunks = m - 1, p * v
    fwd: list[Lines] = []
    for k in range(chunks):
        s, c = k % p, k // p
        before = _at(fwd[k - p], last) if c > 0 else 0.0
        hop = transfer_s if k > 0 and (k - 1) % p != s else 0.0
        fwd.append(_flow(fwd[k - 1] if k > 0 else None, hop, before, forward_s[s][c], last))
    bwd: list[Lines | None] = [None] * chunks
    for k in reversed(range(chunks)):
        s, c = k % p, k // p
        before = _at(bwd[k + p], last) if c < v - 1 else _at(fwd[k], last)  # type: ignore[arg-type]
        if k == chunks - 1:  # its own forwards are done before its first backward
            bwd[k] = _flow(None, 0.0, before, backward_s[s][c], last)
        else:
            hop = transfer_s if (k + 1) % p != s else 0.0
            bwd[k] = _flow(bwd[k + 1], hop, before, backward_s[s][c], last)
    ends = tuple(_at(bwd[s], last) for s in range(p))  # type: ignore[arg-type]
    shown = max(1, min(m, max_passes // 4 // (2 * p * v)))
    sample = event_simulation("gpipe", forward_s, backward_s, shown,
                              transfer_s) if 2 * p * v * shown <= max_passes \
        else None
    return Timeline(sample.stages if sample else [[] for _ in range(p)], ends,
                    _busy(forward_s, backward_s, m), shown)


# --- 1F1B and interleaved: a verified period --------------------------------------------------------------

def _ends_by_pass(timeline: Timeline) -> dict[tuple[int, str, int], list[float]]:
    """End time of every pass, per (rank, kind, chunk) as a list indexed by micro-batch."""
    out: dict[tuple[int, str, int], list[float]] = {}
    for s, row in enumerate(timeline.stages):
        for slot in row:
            series = out.setdefault((s, slot.kind, slot.chunk), [])
            series.append(slot.end)  # passes of one (rank, kind, chunk) run in micro-batch order
    return out


def _lag(p: int, v: int) -> int:
    """A bound on the micro-batch distance between two consecutive passes of one rank: how far back a pass
    looks.

    Both orders run whole groups (p micro-batches through each of the v chunks); a backward follows the
    forward ``warmup`` places ahead of it in that order, at most warmup / v + 2 groups later in micro-batches.
    """
    group = p if v > 1 else 1
    return -(-_warmup(p, v, 0, 10**9) // v) + 2 * group + 1


def _period(series: dict[tuple[int, str, int], list[float]], start: int, stop: int, window: int, group: int,
            longest: int, tolerance: float) -> tuple[int, int, float] | None:
    """The first (period, offset, shift) with every pass of micro-batches [a, a + window) repeating Δ later at
    +P.

    Offsets run from ``start``; the repeated window must end before ``stop``. Periods are whole groups, at
    most ``longest`` micro-batches (a critical cycle of the steady state spans at most the p micro-batches in
    flight).
    """
    rows = list(series.values())
    for period in range(group, min(longest, stop - start - window) + 1, group):
        for a in range(start, stop - window - period + 1):
            shift = rows[0][a + period] - rows[0][a]
            if all(abs(ends[i + period] - ends[i] - shift) <= tolerance
                   for ends in rows for i in range(a, a + window)):
                return period, a, shift
    return None


def _periodic(schedule: str, forward_s: list[list[float]], backward_s: list[list[float]], m: int,
              transfer_s: float, max_passes: int) -> Timeline:
    """Ends of a long 1F1B or interleaved step from a shorter one whose steady state is shown to repeat.

    Probes of growing length (each with the step's remainder of whole groups) are simulated until one
    shows a period; a probe never exceeds ``max_passes`` passes.
    """
    p, v = len(forward_s), len(forward_s[0])
    group = p if v > 1 else 1
    budget_m = max_passes // (2 * p * v)
    lag = _lag(p, v)
    warm = -(-(_warmup(p, v, 0, 10**9) + 1) // v) + group  # micro-batches before every rank is in steady
                                                           # state
    margin = warm + 2 * lag + group  # how far back from the end of a step the drain reaches
    longest = 2 * p * group
    scale = max(max(map(max, forward_s)), max(map(max, backward_s)), transfer_s)
    size = 2 * (warm + lag + margin) + 4 * group
    while True:
        probe = size - (size - m) % group
        if probe > budget_m:
            return _paced(schedule, forward_s, backward_s, m, transfer_s, max_passes)
        sample = event_simulation(schedule, forward_s, backward_s, probe, transfer_s)
        found = _period(_ends_by_pass(sample), warm, probe - margin, lag, group, longest,
                        1e-9 * scale * probe)
        if found is not None:
            period, a, shift = found
            short = probe - (probe - m) % period
            if short >= a + period + lag + margin:
                if short != probe:
                    sample = event_simulation(schedule, forward_s, backward_s, short, transfer_s)
                n = (m - short) // period
                ends = tuple(row[-1].end + n * shift for row in sample.stages)
                return Timeline(sample.stages, ends, _busy(forward_s, backward_s, m), short)
        size *= 2


def _paced(schedule: str, forward_s: list[list[float]], backward_s: list[list[float]], m: int,
           transfer_s: float, max_passes: int) -> Timeline:
    """An estimate for pipelines too deep to simulate to their steady state: the slowest rank sets the pace.

    Each further micro-batch costs the slowest rank's passes, or its share of the round trip through every
    chunk and link that the micro-batches in flight on rank 0 make (the longer). The fill and drain come
    from a simulated shorter step where one fits the budget; otherwise from the closed form for equal
    ranks (every rank's passes once, over v, plus the transfers both ways), rank s finishing its last
    backward s hops before rank 0.
    """
    p, v = len(forward_s), len(forward_s[0])
    per_rank = [sum(f) + sum(b) for f, b in zip(forward_s, backward_s)]
    in_flight = (_warmup(p, v, 0, 10**9) + 1) / v  # micro-batches rank 0 has in flight in steady state
    pace = max(max(per_rank), (sum(per_rank) + 2 * (p * v - 1) * transfer_s) / in_flight)
    busy = _busy(forward_s, backward_s, m)
    group = p if v > 1 else 1
    shown = max_passes // 4 // (2 * p * v)
    shown = max(shown - (shown - m) % group, (m - 1) % group + 1)  # the step's remainder of whole groups
    if 2 * p * v * shown > max_passes:  # not even one group of micro-batches fits: no passes to show
        # equal ranks of u seconds take m·u + (p-1)·u/v (Narayanan et al.); uneven ones fill with their sum
        total = (m - 1 + 1 - 1 / v) * pace + sum(per_rank) / v + 2 * (p - 1) * transfer_s
        ends = tuple(total - s * (backward_s[s][0] + transfer_s) for s in range(p))
        return Timeline([[] for _ in range(p)], ends, busy, 0, exact=False)
    sample = event_simulation(schedule, forward_s, backward_s, shown, transfer_s)
    # where the sample reaches beyond its warm-up and first round trip, rank 0's forwards show the pace of the
    # chunks themselves (measured over whole groups, since interleaving runs a group through each chunk in
    # turn)
    firsts = [slot.end for slot in sample.stages[0] if slot.kind == "F" and slot.chunk == 0]
    begin = -(-(-(-(_warmup(p, v, 0, 10**9) + 1) // v) + group) // group) * group
    end = (len(firsts) - 1) // group * group
    if end > begin:
        pace = max(pace, (firsts[end] - firsts[begin]) / (end - begin))
    ends = tuple(row[-1].end + (m - shown) * pace for row in sample.stages)
    return Timeline(sample.stages, ends, busy, shown, exact=False)
