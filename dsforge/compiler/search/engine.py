"""The layout search: every candidate of the space, filtered by validate's rules and the memory estimate,
ranked by the objective with the cost model; best-first over exact lower bounds, so that only the candidates
that could still rank are estimated (`exhaustive=True` estimates all of them;
tests/compiler/search/test_search_exact.py shows both agree).

Before any candidate is bounded, the checks that declare the layout fields their verdict reads (`Rule.reads`)
are asked once per degree combination or memory group (and kept per value of those fields): a refusal removes
the whole class. A candidate then moves through three levels, each behind a heap ordered by (bound of the
objective, tiebreak):
  0. legal by construction, bounded by its model states (memory), FLOPs at peak with the analytic bubble and,
     under ZeRO-2/3, its per-micro-batch data-parallel collectives;
  1. its memory estimate fits `search.memory_fraction`; bounded by the chain of its own pass durations,
     transfers and rank 0's step tail;
  2. the remaining checks find no error, and it is estimated: its value is exact.
A candidate that never reaches a level is counted as pruned, not under the rule or memory test it would have
met. The k-th candidate popped at level 2 is the k-th best, because every candidate still in the heap has a
bound (and so a value) at least as large.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, NamedTuple

from dsforge.compiler.estimate import flops
from dsforge.compiler.estimate.memory import MemoryEstimate, estimate_memory
from dsforge.compiler.estimate.steptime import StepTime, estimate_step
from dsforge.compiler.frontend.parse import LoadedJob
from dsforge.compiler.model.resolved import ResolvedModel, resolve_model
from dsforge.compiler.plan.plan import Plan, ResolvedPlan, UnresolvedPlan
from dsforge.compiler.rules.registry import Context, Rule, checks, run_rules
from dsforge.compiler.search.bounds import (
    chain_floor_s,
    compute_speed,
    edge_memory_bytes,
    micro_batch_dp_s,
    model_state_bytes,
    pass_floor_s,
)
from dsforge.compiler.search.objective import Objective, objective_of
from dsforge.compiler.search.space import (
    Layout,
    apply_layout,
    auto_keys,
    is_auto,
    layouts,
    options,
    skeleton_size,
    skeletons,
    space_size,
)
from dsforge.compiler.spec.schema import JobSpec
from dsforge.diagnostics import Diagnostic, Severity

#: The memory rule: the engine applies its test (peak over capacity) from the estimate it needs anyway, so
#: that the rule's fix search (it prices changes of a job that does not fit) is not run for every candidate.
MEMORY_RULE = "DSF301"
#: More candidates than this are refused (DSF132) rather than searched for minutes.
MAX_CANDIDATES = 500_000
#: Relative slack in the bound check (floating-point sums in a different order).
BOUND_SLACK = 1e-9

Errors = Callable[[JobSpec, Plan], list[Diagnostic]]
#: The fields of a degree combination (a skeleton) and of a memory group: a check that reads only these is
#: asked once per skeleton or per group, before any candidate of it is bounded or estimated.
SKELETON_FIELDS = frozenset({"tp", "pp", "dp", "cp", "ep", "zero", "nodes"})
GROUP_FIELDS = SKELETON_FIELDS | {"sequence_parallel", "cp_kind", "schedule", "virtual_stages",
                                  "global_batch"}


def _below(bound: float) -> float:
    """A bound lowered by the slack: the pass floor sums the estimate's own terms in another order, so where
    it is tight it can exceed the estimate by a rounding error, which would misorder near-ties."""
    return bound * (1 - BOUND_SLACK)


class SpaceTooLarge(ValueError):
    """The space holds more than MAX_CANDIDATES candidates."""


@dataclass
class Evaluated:
    """A candidate that fits: its job, plan, estimates and objective value."""

    layout: Layout
    spec: JobSpec
    plan: ResolvedPlan
    memory: MemoryEstimate
    step: StepTime
    value: float

    @property
    def key(self) -> tuple[Any, ...]:
        """Its place in the ranking: the objective, then the tiebreak (less model parallelism first)."""
        return (self.value, self.layout.tiebreak())


@dataclass(frozen=True)
class Miss:
    """A candidate that was ruled out, and why (for the closest misses when none fits)."""

    layout: Layout
    reason: str  # a rule id, "memory" or "deadline"
    detail: str
    utilization: float | None = None


@dataclass
class Funnel:
    """How many candidates each stage of the search considered and removed."""

    considered: int = 0
    removed: Counter[str] = field(default_factory=Counter)
    pruned: int = 0  # never estimated: their bound showed they could not rank
    estimated: int = 0
    fitting: int = 0  # estimated and kept
    bounded: int = 0  # memory lower bounds computed (not in as_dict: how much work the staircase saved)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON)."""
        return {"considered": self.considered, "removed": dict(sorted(self.removed.items())),
                "pruned": self.pruned, "estimated": self.estimated, "fitting": self.fitting}


@dataclass
class SearchResult:
    """What a search found: the ranked candidates, the funnel, the closest misses, the written layout's
    rank."""

    objective: Objective
    keys: list[tuple[str, ...]]
    ranked: list[Evaluated]
    funnel: Funnel
    misses: list[Miss]
    nodes: int | None
    nodes_tried: list[int]
    exhaustive: bool
    seconds: float = 0.0
    fitting: list[Evaluated] = field(default_factory=list)  # every fitting candidate (exhaustive only)
    written: Evaluated | None = None
    written_rank: int | None = None
    written_miss: Miss | None = None

    @property
    def winner(self) -> Evaluated | None:
        """The best candidate, or None when none fits."""
        return self.ranked[0] if self.ranked else None


def _gb(n: float) -> str:
    """Bytes as GB (1e9), or MB below 1 GB."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _model_seeded(spec: JobSpec, model: ResolvedModel, placements: dict[Any, Any] | None = None) -> Plan:
    plan = Plan(spec, shared_model=model)  # every candidate shares the model: resolved once
    if placements is not None:
        # the rank placement follows from the degrees, the node size and the order alone (Plan._placed): one
        # per degree combination, shared by its candidates with what it caches (groups, node crossings)
        d = plan.degrees
        if d is not None:
            key = (d.tp, d.pp, d.dp, d.cp, d.ep, plan.layout_ok, plan.gpus_per_node, spec.parallel.order)
            if key not in placements:
                placements[key] = plan._placed
            plan = Plan(spec, shared_model=model, shared_placement=placements[key])
    return plan


@dataclass(frozen=True)
class RuleFilter:
    """validate's checks as the search's error filter: the errors ``rules`` report for a candidate, after
    ``keep`` (validate's selection and inline suppressions, which judge each diagnostic on its own, so a
    subset of the rules reports exactly its share of the whole set's errors)."""

    job: LoadedJob
    rules: tuple[Rule, ...]
    keep: Callable[[list[Diagnostic]], list[Diagnostic]] | None = None

    def __call__(self, spec: JobSpec, plan: Plan) -> list[Diagnostic]:
        found = run_rules(Context(spec, plan, self.job.source, self.job.raw), list(self.rules))
        if self.keep is not None:
            found = self.keep(found)
        return [d for d in found if d.severity is Severity.ERROR]

    def subset(self, rules: list[Rule]) -> RuleFilter:
        """The same filter over some of its rules."""
        return RuleFilter(self.job, tuple(rules), self.keep)


def rule_errors(job: LoadedJob, rules: list[Rule] | None = None,
                keep: Callable[[list[Diagnostic]], list[Diagnostic]] | None = None) -> RuleFilter:
    """validate's checks (all but the memory rule, which the engine applies itself) as an error filter."""
    chosen = [r for r in (rules if rules is not None else checks("validate")) if r.id != MEMORY_RULE]
    return RuleFilter(job, tuple(chosen), keep)


def rule_tier(rule: Rule) -> str | None:
    """When the search can ask a check: "skeleton" (once per degree combination), "group" (once per memory
    group), or None (per candidate, after its estimate: a check that does not say what it reads, or reads the
    micro-batch or the recomputation)."""
    if rule.reads is None:
        return None
    reads = set(rule.reads)  # a name that is no search field (a plugin's typo) leaves the check per candidate
    return "skeleton" if reads <= SKELETON_FIELDS else "group" if reads <= GROUP_FIELDS else None


@dataclass(frozen=True)
class _Group:
    """Heap level -1: a memory group, under its best member's compute floor; ``floors``: each member's."""

    floors: dict[Layout, float]
    level: ClassVar[int] = -1


@dataclass(frozen=True)
class _Bounded:
    """Heap level 0: a candidate whose model states and compute floor passed (``memory_bounded``: its memory
    lower bound too, in the group's staircase, which may have built its ``plan``)."""

    layout: Layout
    plan: Plan | None
    floor: float
    memory_bounded: bool
    level: ClassVar[int] = 0


@dataclass(frozen=True)
class _Sized:
    """Heap level 1: a candidate whose memory bound fits, under its pass floor; ``plan``: what the rules read,
    ``resolved``: what the estimates price (its layout resolved in `_level1`); ``memory``: its full estimate
    once made (it then waits under the tighter floor)."""

    layout: Layout
    plan: Plan
    resolved: ResolvedPlan
    floor: float
    memory: MemoryEstimate | None
    level: ClassVar[int] = 1


@dataclass(frozen=True)
class _Ranked:
    """Heap level 2: a candidate estimated and fitting, under its objective value."""

    evaluated: Evaluated
    level: ClassVar[int] = 2


_Entry = _Group | _Bounded | _Sized | _Ranked


class _Item(NamedTuple):
    """One heap entry, ordered by (value, tiebreak, level, seq): seq is unique, so ``entry`` is never
    compared."""

    value: float
    tiebreak: tuple[Any, ...]
    level: int
    seq: int
    entry: _Entry


class _Search:
    """One node count's best-first search."""

    def __init__(self, job: LoadedJob, spec: JobSpec, nodes: int, errors: Errors, objective: Objective,
                 top: int, exhaustive: bool, funnel: Funnel, misses: list[Miss]) -> None:
        self.job, self.spec, self.nodes, self.errors = job, spec, nodes, errors
        self.objective, self.top, self.exhaustive = objective, top, exhaustive
        self.funnel, self.misses = funnel, misses
        self.model = resolve_model(spec.model)
        self.limit = options(spec).memory_fraction
        self.capacity = spec.hardware.accelerator.memory_gb * 1e9
        self.violated = False
        self._states_of: dict[tuple[int, ...], float] = {}
        self._flops: dict[tuple[Any, ...], float] = {}
        self._dp_floor: dict[tuple[Any, ...], float] = {}  # micro_batch_dp_s per degree combination and
                                                           # chunks
        self._speed: float | None = None
        self._placements: dict[Any, Any] = {}
        self._memo: dict[Any, Any] = {}  # the memory bound's shared inputs (bounds.edge_memory_bytes)
        self._count = 0
        self._seq = 0  # heap entries pushed (their order among equal keys)
        # the checks whose verdict a skeleton or a memory group decides are asked once for it, before any of
        # its candidates is bounded; the others once per candidate that fits (exhaustive: all per candidate,
        # the reference tests/compiler/search/test_search_exact.py compares with)
        self.early: dict[str, list[tuple[Rule, RuleFilter]]] = {"skeleton": [], "group": []}
        self.late: Errors = errors
        self._verdicts: dict[tuple[Any, ...], bool] = {}  # (rule id, the fields it reads) -> refused
        if isinstance(errors, RuleFilter) and not exhaustive:
            late = []
            for r in errors.rules:
                tier = rule_tier(r)
                if tier is None:
                    late.append(r)
                else:
                    self.early[tier].append((r, errors.subset([r])))
            self.late = errors.subset(late)

    def _groups(self) -> Iterator[list[Layout]]:
        """The candidates in memory groups: one degree combination with one SP, CP kind, schedule, chunk count
        and global batch, whose members differ only in micro-batch and recompute."""
        for skel in skeletons(self.spec, self.model, self.nodes):
            children = layouts(self.spec, self.model, skel, self.nodes)
            first = next(children, None)
            if first is None:
                continue
            # the checks a degree combination decides, then one memory bound for all of it: its model states,
            # averaged over the stages (both count its members without listing them)
            if self._class_refused(first, "skeleton", partial(skeleton_size, self.spec, self.model, skel)):
                continue
            states = model_state_bytes(_model_seeded(apply_layout(self.spec, first), self.model).priced(),
                                       average=True)
            if _below(states) > self.limit * self.capacity:  # the mean sums the stages in another order
                n = skeleton_size(self.spec, self.model, skel)
                self.funnel.considered += n
                self.funnel.removed["memory"] += n
                self._keep_miss(Miss(first, "memory", f"model states alone need {_gb(states)} of "
                                                      f"{_gb(self.capacity)}", states / self.capacity))
                continue
            groups: dict[tuple[Any, ...], list[Layout]] = defaultdict(list)
            for lay in (first, *children):
                groups[(lay.sequence_parallel, lay.cp_kind, lay.schedule, lay.virtual_stages,
                        lay.global_batch)].append(lay)
            for group in groups.values():
                if not self._class_refused(group[0], "group", group.__len__):
                    yield group

    def _class_refused(self, lay: Layout, tier: str, size: Callable[[], int]) -> bool:
        """True (and the class's ``size()`` members counted under the refusing id, ``lay`` kept as the miss)
        when a check of this tier finds an error for ``lay``, so for every member of its class (`rule_tier`).
        A check's verdict is kept per value of the fields it reads: asked again only for new values; a refused
        class gets its own diagnostic (the message may name values of fields the check does not decide on)."""
        plan: Plan | None = None
        for r, errors in self.early[tier]:
            key = (r.id, *(getattr(lay, f) for f in r.reads or ()))
            refused = self._verdicts.get(key)
            found: list[Diagnostic] = []
            if refused is None or refused:
                plan = plan if plan is not None else self._plan(lay)
                found = errors(plan.spec, plan)
                refused = self._verdicts[key] = bool(found)
            if refused:
                n = size()
                self.funnel.considered += n
                self.funnel.removed[r.id] += n  # once each: the funnel's counts add up to the candidates
                self._keep_miss(Miss(lay, r.id, found[0].message))
                return True
        return False

    def _plan(self, lay: Layout) -> Plan:
        return _model_seeded(apply_layout(self.spec, lay), self.model, self._placements)

    def _states(self, lay: Layout, plan: Plan | None = None) -> float:
        """The busiest stage's model states, the same for every member of a memory group."""
        key = (lay.tp, lay.pp, lay.dp, lay.cp, lay.ep, lay.zero, lay.virtual_stages)
        if key not in self._states_of:
            self._states_of[key] = model_state_bytes((plan if plan is not None else self._plan(lay)).priced())
        return self._states_of[key]

    def _staircase(self, group: list[Layout], plans: dict[Layout, Plan]) -> list[Layout]:
        """The members of one memory group whose memory lower bound (`edge_memory_bytes`) fits; the others are
        counted as memory misses, most without their bound being computed.

        Within a group the bound cannot fall when the micro-batch grows while two or more micro-batches
        accumulate (the model states stay the same and every activation term grows with the micro-batch, the
        micro-batches in flight times their size never shrink), nor when recomputation is lessened (full keeps
        each layer's input, selective all but the scores, none everything; the rematerialised working set of
        one layer never outweighs what the others keep). With one micro-batch per step DeepSpeed keeps no
        accumulation buffer, so those members form their own chain. So the members that fit are, for each
        recompute policy, the micro-batches below a threshold that only falls as recomputation lessens: found
        by bisection under the previous policy's threshold. The bounds computed are checked against this order
        (`self.violated` otherwise; tests/compiler/search/test_search_exact.py checks it over whole small
        spaces).
        """
        order = {"full": 0, "selective": 1, "none": 2}
        chains: dict[bool, dict[tuple[int, int], Layout]] = {True: {}, False: {}}
        for lay in group:
            chains[lay.global_batch // (lay.dp * lay.micro_batch) == 1][
                (lay.micro_batch, order[lay.recompute])
            ] = lay
        return [lay for grid in chains.values() if grid for lay in self._walk(grid, plans)]

    def _walk(self, grid: dict[tuple[int, int], Layout], plans: dict[Layout, Plan]) -> list[Layout]:
        """One chain of `_staircase`: ``grid`` maps (micro-batch, recompute order) to its member."""
        limit = self.limit * self.capacity
        mbs = sorted({k[0] for k in grid})
        seen: dict[tuple[int, int], float] = {}
        fits: list[Layout] = []
        if len(grid) != len(mbs) * len({k[1] for k in grid}):  # not a full grid: no order to walk, bound each
            for lay in grid.values():
                plans.setdefault(lay, self._plan(lay))
                got = edge_memory_bytes(plans[lay].priced(), limit, self._memo)
                self.funnel.bounded += 1
                if got <= limit:
                    fits.append(lay)
                    continue
                util = got / self.capacity
                self._miss(lay, MEMORY_RULE if util > 1.0 else "memory",
                           f"peak {_gb(got)} is {util:.0%} of {_gb(self.capacity)}", util)
            return fits

        def bound(i: int, r: int) -> float:
            lay = grid[(mbs[i], r)]
            if lay not in plans:
                plans[lay] = self._plan(lay)
            got = seen[(i, r)] = edge_memory_bytes(plans[lay].priced(), limit, self._memo)
            self.funnel.bounded += 1
            return got

        reach, reach_bytes = len(mbs), limit  # from `reach` on, a member under more recompute failed
        for r in sorted({k[1] for k in grid}):
            lo, hi = 0, reach  # [0, lo) fit, [hi, ...) fail
            if hi > 0 and bound(hi - 1, r) <= limit:
                lo = hi
            elif hi > 0:
                hi -= 1
            while lo < hi:
                mid = (lo + hi) // 2
                if bound(mid, r) <= limit:
                    lo = mid + 1
                else:
                    hi = mid
            fails = seen.get((hi, r), reach_bytes)  # the smallest failing member's bound
            for i in range(len(mbs)):
                lay = grid[(mbs[i], r)]
                if i < hi:
                    fits.append(lay)
                    continue
                got = seen.get((i, r), fails)
                util = got / self.capacity
                reason = MEMORY_RULE if util > 1.0 else "memory"
                if (i, r) in seen:
                    self._miss(lay, reason, f"peak {_gb(got)} is {util:.0%} of {_gb(self.capacity)}", util)
                else:
                    self.funnel.removed[reason] += 1
            reach, reach_bytes = hi, fails
        # the order the walk relies on, wherever it computed two bounds (one above the limit may be its first
        # stage's alone, a lower bound of the bound: only one within the limit is exact enough to compare
        # with)
        for (i1, r1), b1 in seen.items():
            for (i2, r2), b2 in seen.items():
                if i1 <= i2 and r1 <= r2 and b2 <= limit and b1 > b2 * (1 + BOUND_SLACK):
                    self.violated = True
        return fits

    def _floor(self, lay: Layout, plan: Plan | None = None) -> float:
        """`compute_floor_s` of a candidate from its layout alone (its plan is built only when first
        needed)."""
        key = (lay.tp, lay.recompute, lay.global_batch)
        if key not in self._flops or self._speed is None:
            plan = plan if plan is not None else self._plan(lay)
            if self._speed is None:
                self._speed = compute_speed(plan.priced())  # one rate for every candidate of this node count
            if key not in self._flops:
                self._flops[key] = flops.hardware_flops_per_step(plan.priced())
        world = lay.nodes * self.spec.hardware.gpus_per_node
        m = lay.global_batch // (lay.dp * lay.micro_batch)
        floor = chain_floor_s(self._flops[key] / (world * self._speed), lay.pp, m, lay.virtual_stages) \
            if self._speed > 0 else 0.0
        if lay.zero >= 2:  # collectives every micro-batch: ZeRO-3's gathers outweigh the compute of many
                           # layouts
            dkey = (lay.tp, lay.pp, lay.dp, lay.cp, lay.ep, lay.zero, lay.virtual_stages)
            if dkey not in self._dp_floor:
                self._dp_floor[dkey] = _below(
                    micro_batch_dp_s((plan if plan is not None else self._plan(lay)).priced())
                )
            floor = max(floor, m * self._dp_floor[dkey])
        return floor

    def _bound_value(self, step_floor: float, lay: Layout) -> float:
        return self.objective.value(step_floor, lay.global_batch * self.model.seq_len,
                                    lay.nodes * self.spec.hardware.gpus_per_node)

    def _miss(self, lay: Layout, reason: str, detail: str, utilization: float | None = None) -> None:
        self.funnel.removed[reason] += 1
        self._keep_miss(Miss(lay, reason, detail, utilization))

    def _keep_miss(self, miss: Miss) -> None:
        self.misses.append(miss)
        if len(self.misses) > 4096:  # keep the closest: memory misses by utilization, then the first of each
                                     # rule
            self.misses.sort(key=lambda m: (m.utilization is None, m.utilization or 0.0))
            del self.misses[2048:]

    def _level0(self, lay: Layout) -> tuple[float, Plan] | None:
        """One candidate's model states and compute floor (the written layout of `--compare`)."""
        plan = self._plan(lay)
        states = self._states(lay, plan)
        if states > self.limit * self.capacity:
            self._miss(lay, "memory", f"model states alone need {_gb(states)} of "
                                      f"{_gb(self.capacity)}", states / self.capacity)
            return None
        floor = 0.0 if self.exhaustive else self._floor(lay, plan)
        if floor > 0 and not self.objective.feasible(floor, lay.global_batch * self.model.seq_len):
            self._miss(lay, "deadline", "its FLOPs alone miss the deadline")
            return None
        return floor, plan

    def _level1(self, lay: Layout, plan: Plan,
                bounded: bool = False) -> tuple[float, ResolvedPlan, MemoryEstimate | None] | None:
        """The layout resolved, then memory: the estimate against search.memory_fraction (DSF301's test above
        100 %), then the pass floor (``bounded``: the memory lower bound already passed, in `_staircase`)."""
        try:
            resolved = plan.resolve()
        except UnresolvedPlan:
            found = self.errors(plan.spec, plan)  # the rules say why the layout does not resolve
            rid = found[0].rule if found else "DSF101"
            self._miss(lay, rid, found[0].message if found else "the layout does not resolve")
            return None
        if self.exhaustive:
            mem = self._memory(lay, resolved)
            return (0.0, resolved, mem) if mem is not None else None
        # two stages of the estimate: the full one waits until the bounds rank it
        edge = 0.0 if bounded else edge_memory_bytes(resolved, self.limit * self.capacity, self._memo)
        if edge > self.limit * self.capacity:
            util = edge / self.capacity
            self._miss(lay, MEMORY_RULE if util > 1.0 else "memory",
                       f"peak {_gb(edge)} is {util:.0%} of {_gb(self.capacity)}", util)
            return None
        return _below(pass_floor_s(resolved, "edges")), resolved, None

    def _memory(self, lay: Layout, plan: ResolvedPlan) -> MemoryEstimate | None:
        """The memory estimate, or None (and the miss counted) when it exceeds search.memory_fraction."""
        mem = estimate_memory(plan)
        if mem.utilization > self.limit:
            reason = MEMORY_RULE if mem.utilization > 1.0 else "memory"
            self._miss(lay, reason, f"peak {_gb(mem.peak.device_bytes)} is {mem.utilization:.0%} of "
                                    f"{_gb(mem.capacity_bytes)}", mem.utilization)
            return None
        return mem

    def _rules_pass(self, lay: Layout, plan: Plan, every: bool = False) -> bool:
        """validate's rules (those not asked of its class already, unless ``every``): False (and counted under
        the first id found, as its miss) when any reports an error."""
        found = (self.errors if every else self.late)(plan.spec, plan)
        if not found:
            return True
        self._miss(lay, found[0].rule, found[0].message)
        return False

    def run(self, until: tuple[Any, ...] | None = None) -> tuple[list[Evaluated], list[Evaluated]]:
        """The ranked top (and, exhaustive, every fitting candidate); with ``until``, also every candidate
        whose key is below it (to rank a written layout)."""
        size = space_size(self.spec, self.model, self.nodes)
        if size > MAX_CANDIDATES:
            raise SpaceTooLarge(f"{size:,} candidates on {self.nodes} node(s), more than {MAX_CANDIDATES:,}")
        heap: list[_Item] = []
        self._seed(heap)
        if self.violated:
            return [], []
        ranked: list[Evaluated] = []
        fitting: list[Evaluated] = []
        while heap:
            item = heapq.heappop(heap)
            if (
                not self.exhaustive
                and len(ranked) >= self.top
                and (until is None or (item.value, item.tiebreak) >= until)
            ):
                heapq.heappush(heap, item._replace(seq=0))
                break
            entry = item.entry
            if isinstance(entry, _Ranked):
                ranked.append(entry.evaluated)
                if self.exhaustive:
                    fitting.append(entry.evaluated)
            elif isinstance(entry, _Group):
                self._open_group(heap, entry)
            elif isinstance(entry, _Bounded):
                self._size_up(heap, item.tiebreak, entry)
            else:
                self._estimate(heap, item.tiebreak, entry)
            if self.violated:
                return [], []
        self.funnel.pruned += sum(len(i.entry.floors) if isinstance(i.entry, _Group) else 1 for i in heap
                                  if i.level < 2)
        return ranked, fitting

    def _push(self, heap: list[_Item], value: float, tiebreak: tuple[Any, ...], entry: _Entry) -> None:
        """Into the heap under (``value``, ``tiebreak``, the entry's level, the order of pushing)."""
        self._seq += 1
        heapq.heappush(heap, _Item(value, tiebreak, entry.level, self._seq, entry))

    def _seed(self, heap: list[_Item]) -> None:
        """Every memory group into the heap, under its best member's compute floor (exhaustive: every member
        at level 0); a group whose model states do not fit is a miss whole."""
        for group in self._groups():
            self.funnel.considered += len(group)
            states = self._states(group[0])
            if states > self.limit * self.capacity:  # the same for every member
                self._miss(group[0], "memory", f"model states alone need {_gb(states)} of "
                                               f"{_gb(self.capacity)}", states / self.capacity)
                self.funnel.removed["memory"] += len(group) - 1
                continue
            if self.exhaustive:
                for lay in group:
                    self._push(heap, 0.0, lay.tiebreak(), _Bounded(lay, None, 0.0, False))
                continue
            # the group waits in the heap under its best member's compute floor: its memory bounds are
            # computed only if that floor can still rank (a group never popped is pruned whole)
            floors = {lay: self._floor(lay) for lay in group}
            best = min((self._bound_value(f, lay), lay.tiebreak()) for lay, f in floors.items())
            self._push(heap, best[0], best[1], _Group(floors))

    def _open_group(self, heap: list[_Item], group: _Group) -> None:
        """A memory group popped: the members whose memory bound fits, each at level 0 under its own floor."""
        plans: dict[Layout, Plan] = {}
        for member in self._staircase(list(group.floors), plans):
            floor = group.floors[member]
            if floor > 0 and not self.objective.feasible(floor, member.global_batch * self.model.seq_len):
                self._miss(member, "deadline", "its FLOPs alone miss the deadline")
                continue
            self._push(heap, self._bound_value(floor, member), member.tiebreak(),
                       _Bounded(member, plans.get(member), floor, True))

    def _size_up(self, heap: list[_Item], tiebreak: tuple[Any, ...], entry: _Bounded) -> None:
        """Level 0 popped: its memory (`_level1`) and pass floor; it goes on to level 1 under the tighter
        bound."""
        lay = entry.layout
        plan = entry.plan if entry.plan is not None else self._plan(lay)
        got1 = self._level1(lay, plan, entry.memory_bounded)
        if got1 is None:
            return
        floor1, resolved, mem = got1
        floor = max(entry.floor, floor1)
        if floor > 0 and not self.objective.feasible(floor, lay.global_batch * self.model.seq_len):
            self._miss(lay, "deadline", "its passes alone miss the deadline")
            return
        self._push(heap, self._bound_value(floor, lay), tiebreak, _Sized(lay, plan, resolved, floor, mem))

    def _estimate(self, heap: list[_Item], tiebreak: tuple[Any, ...], entry: _Sized) -> None:
        """Level 1 popped: the full memory estimate, the rules and the step, which run only for candidates
        whose bounds could still rank (each costs as much as the bounds of many candidates); a fit goes to
        level 2."""
        lay, plan, resolved, floor, mem = entry.layout, entry.plan, entry.resolved, entry.floor, entry.memory
        if mem is None:
            mem = self._memory(lay, resolved)
            if mem is None:
                return
            if not self.exhaustive:
                floor1 = _below(pass_floor_s(resolved))
                if floor1 > floor:  # the whole chain: back into the heap under its tighter bound
                    self._push(heap, self._bound_value(floor1, lay), tiebreak,
                               _Sized(lay, plan, resolved, floor1, mem))
                    return
        if not self._rules_pass(lay, plan):
            return
        step = estimate_step(resolved)
        self.funnel.estimated += 1
        if step.step_s < floor * (1 - BOUND_SLACK):
            self.violated = True  # a bound above the estimate: the caller repeats without pruning
            return
        tokens = lay.global_batch * self.model.seq_len
        if not self.objective.feasible(step.step_s, tokens):
            train_h = self.objective.tokens * step.step_s / tokens / 3600
            self._miss(lay, "deadline", f"trains in {train_h:,.1f} h")
            return
        self.funnel.fitting += 1
        # every rule passed: the candidate as what compile would emit
        ev = Evaluated(lay, resolved.spec, resolved, mem, step,
                       self.objective.value(step.step_s, tokens, resolved.world_size))
        self._push(heap, ev.value, tiebreak, _Ranked(ev))

    def evaluate(self, lay: Layout) -> Evaluated | Miss:
        """One layout through every level (the written layout of `--compare`)."""
        funnel, misses = self.funnel, self.misses
        self.funnel, self.misses = Funnel(), []
        try:
            got = self._level0(lay)
            got1 = self._level1(lay, got[1]) if got is not None else None
            mem = self._memory(lay, got1[1]) if got is not None and got1 is not None else None
            if got is None or got1 is None or mem is None or not self._rules_pass(lay, got[1], every=True):
                return self.misses[-1]
            resolved = got1[1]
            step = estimate_step(resolved)
            tokens = lay.global_batch * self.model.seq_len
            return Evaluated(lay, resolved.spec, resolved, mem, step,
                             self.objective.value(step.step_s, tokens, resolved.world_size))
        finally:
            self.funnel, self.misses = funnel, misses


def _node_counts(spec: JobSpec) -> list[int]:
    if not is_auto(spec, ("hardware", "nodes")):
        return [spec.hardware.nodes]
    return list(range(1, options(spec).max_nodes + 1))


def search(job: LoadedJob, errors: Errors | None = None, top: int | None = None, exhaustive: bool = False,
           compare: Layout | None = None, spec: JobSpec | None = None) -> SearchResult:
    """Rank the candidates of a job's `auto` fields (``spec`` overrides the job's spec, for `--compare`).

    ``errors``: the rule filter (default: validate's checks); ``compare``: a layout to rank among them.
    Raises SpaceTooLarge above MAX_CANDIDATES candidates.
    """
    start = time.perf_counter()
    spec = spec if spec is not None else job.spec
    errors = errors if errors is not None else rule_errors(job)
    objective = objective_of(spec)
    top = top if top is not None else options(spec).top
    result = _search(job, spec, errors, objective, top, exhaustive, compare)
    if result is None:  # a bound exceeded an estimate: the cost model changed under the bounds; search them
                        # all
        result = _search(job, spec, errors, objective, top, True, compare)
        # proved by the search, not the types: an exhaustive search bounds nothing (floors of 0, no
        # staircase), so it never finds a bound above an estimate and never returns None
        assert result is not None
    result.seconds = time.perf_counter() - start
    return result


def _search(job: LoadedJob, spec: JobSpec, errors: Errors, objective: Objective, top: int, exhaustive: bool,
            compare: Layout | None) -> SearchResult | None:
    funnel, misses = Funnel(), list[Miss]()
    tried: list[int] = []
    ranked: list[Evaluated] = []
    fitting: list[Evaluated] = []
    written: Evaluated | None = None
    written_miss: Miss | None = None
    for nodes in _node_counts(spec):
        tried.append(nodes)
        s = _Search(job, spec, nodes, errors, objective, top, exhaustive, funnel, misses)
        until = None
        if compare is not None and compare.nodes == nodes:
            got = s.evaluate(compare)
            if isinstance(got, Evaluated):
                written, until = got, got.key
            else:
                written_miss = got
        ranked, fitting = s.run(until)
        if s.violated:
            return None
        if ranked:
            break
    # every candidate ranked better than the written layout was popped before it (run's ``until``)
    rank = None if written is None else 1 + sum(1 for e in ranked if e.key < written.key)
    ranked = ranked[:top]
    chosen = ranked[0].layout.nodes if ranked else None
    misses.sort(key=lambda m: (m.utilization is None, m.utilization or 0.0))
    return SearchResult(objective, auto_keys(spec), ranked, funnel, misses[:64], chosen, tried, exhaustive,
                        fitting=fitting, written=written, written_rank=rank, written_miss=written_miss)
