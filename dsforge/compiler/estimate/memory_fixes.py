"""Ways to make a job use less memory, each priced by re-estimating the modified plan.

Candidates: a higher ZeRO stage, selective or full recomputation, sequence parallelism, a larger tp
or pp (dp shrinks to keep the world size), a smaller micro-batch (more accumulation steps, same
global batch) and ZeRO-Offload of the optimizer state. A candidate is kept only if it lowers the
peak and the change itself brings no new error in the other checks (the caller supplies them), so
the fixes never include what DeepSpeed would refuse, such as ZeRO-2 with pipeline parallelism, while
an error the job already had does not hide a fix that works.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from dsforge.compiler.estimate.memory import MemoryEstimate, estimate_memory
from dsforge.compiler.plan.plan import Plan, Priced, build_plan
from dsforge.compiler.spec.schema import JobSpec


@dataclass(frozen=True)
class MemoryFix:
    """One change to the job and what it does to the peak rank."""

    change: str  # e.g. "parallel.zero: 3"
    spec: JobSpec
    plan: Plan
    estimate: MemoryEstimate
    saving_bytes: float

    @property
    def fits(self) -> bool:
        """True when the modified job fits the accelerator."""
        return self.estimate.utilization <= 1.0


def _with(spec: JobSpec, section: str, **values: Any) -> JobSpec:
    """A copy of the spec with some keys of one section replaced."""
    changed: JobSpec = spec.model_copy(update={section: getattr(spec, section).model_copy(update=values)})
    return changed


def _relayout(spec: JobSpec, plan: Priced, **degrees: int) -> tuple[str, JobSpec] | None:
    """Change tp or pp, keeping the world size by recomputing dp; None when it does not divide."""
    d = plan.degrees
    tp, pp = degrees.get("tp", d.tp), degrees.get("pp", d.pp)
    if plan.world_size % (tp * pp * d.cp):
        return None
    dp = plan.world_size // (tp * pp * d.cp)
    dp_value: int | str = "auto" if spec.parallel.dp == "auto" else dp
    label = ", ".join(f"parallel.{k}: {v}" for k, v in degrees.items())
    return f"{label} (dp {d.dp} -> {dp})", _with(spec, "parallel", **degrees, dp=dp_value)


def candidates(spec: JobSpec, plan: Priced) -> Iterator[tuple[str, JobSpec]]:
    """Every single change that could lower the peak (`ranked_fixes` prices each and checks what it
    breaks)."""
    d, t, par = plan.degrees, spec.training, spec.parallel
    for stage in range(plan.zero + 1, 4):
        yield f"parallel.zero: {stage}", _with(spec, "parallel", zero=stage)
    for policy in ("selective", "full"):
        if ("none", "selective", "full").index(policy) > ("none", "selective", "full").index(t.recompute):
            yield f"training.recompute: {policy}", _with(spec, "training", recompute=policy)
    if d.tp > 1 and not par.sequence_parallel:
        yield "parallel.sequence_parallel: true", _with(spec, "parallel", sequence_parallel=True)
    for key, value in (("tp", d.tp * 2), ("pp", d.pp * 2)):
        changed = _relayout(spec, plan, **{key: value})
        if changed:
            yield changed
    if t.micro_batch > 1:
        yield f"training.micro_batch: {t.micro_batch // 2}", _with(spec, "training",
                                                                   micro_batch=t.micro_batch // 2)
    if plan.zero >= 1 and t.optimizer.offload == "none":
        opt = t.optimizer.model_copy(update={"offload": "cpu"})
        yield "training.optimizer.offload: cpu", _with(spec, "training", optimizer=opt)


#: One error of a job: its rule id and the key it points at. The same rule on the same key is the same
#: problem even when a change moves its numbers (a batch that does not split over dp=2 does not over dp=1).
ErrorKey = tuple[str, tuple[str | int, ...]]
#: The errors a job has in every check but the memory rules' (the caller runs its rules).
ErrorCheck = Callable[[JobSpec, Plan], frozenset[ErrorKey]]


@dataclass(frozen=True)
class FixSearch:
    """A job whose peak memory the fixes lower: its spec and plan, its estimate (computed once, by the
    caller) and the errors it already has, which no candidate is blamed for."""

    spec: JobSpec
    plan: Plan
    estimate: MemoryEstimate
    check: ErrorCheck
    present: frozenset[ErrorKey]

    @classmethod
    def of(cls, spec: JobSpec, plan: Plan, estimate: MemoryEstimate, check: ErrorCheck) -> FixSearch:
        """Start a search from a job as written: its errors are checked once, here."""
        return cls(spec, plan, estimate, check, check(spec, plan))

    def after(self, fix: MemoryFix) -> FixSearch:
        """The search from the job with ``fix`` applied; errors still count against the job as written."""
        return FixSearch(fix.spec, fix.plan, fix.estimate, self.check, self.present)


def _estimable(plan: Plan) -> bool:
    return plan.layout_ok and plan.placement is not None and bool(plan.stage_layers)


def ranked_fixes(search: FixSearch, limit: int = 5) -> list[MemoryFix]:
    """The single changes that lower the peak and bring no error the job did not already have, largest
    saving first (at most ``limit``).

    A candidate is judged on what it changes: errors the job had before (a batch that does not split,
    say) are their own diagnostics and disqualify no candidate, so the fixes are those of the job with
    those errors corrected. Memory is priced first because it is cheaper than running the rules.
    """
    before = search.estimate.peak.device_bytes
    fixes = []
    for change, new_spec in candidates(search.spec, search.plan.priced()):
        new_plan = build_plan(new_spec)
        if not _estimable(new_plan):
            continue
        est = estimate_memory(new_plan.priced())
        saving = before - est.peak.device_bytes
        if saving > 0 and search.check(new_spec, new_plan) <= search.present:
            fixes.append(MemoryFix(change, new_spec, new_plan, est, saving))
    fixes.sort(key=lambda f: -f.saving_bytes)
    return fixes[:limit]


def combined_fix(search: FixSearch, target: float = 0.9, max_changes: int = 5,
                 first: list[MemoryFix] | None = None) -> MemoryFix | None:
    """Greedily stack the best change until the peak is at most ``target`` of the memory (or, failing
    that, fits at all); None if no stack of changes fits. ``first`` is `ranked_fixes(search)` when the
    caller has it already (the first step is its best entry).

    Used when no single change is enough (e.g. a 70B model whose Adam state alone exceeds the
    node's total HBM needs ZeRO, offload and recomputation together).
    """
    before = search.estimate.peak.device_bytes
    changes: dict[str, str] = {}  # key -> "key: value"; a later change of the same key replaces it
    fitting: MemoryFix | None = None
    best = first[:1] if first is not None else ranked_fixes(search, limit=1)
    for _ in range(max_changes):
        if not best:
            break
        fix = best[0]
        key = fix.change.split(":")[0]
        changes.pop(key, None)
        changes[key] = fix.change
        search = search.after(fix)
        if fix.fits:
            fitting = MemoryFix(" + ".join(changes.values()), fix.spec, fix.plan, fix.estimate,
                                before - fix.estimate.peak.device_bytes)
            if fix.estimate.utilization <= target:
                break
        best = ranked_fixes(search, limit=1)
    return fitting
