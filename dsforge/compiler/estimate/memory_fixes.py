"""Ways to make a job use less memory, each priced by re-estimating the modified plan.

Candidates: a higher ZeRO stage, selective or full recomputation, sequence parallelism, a larger tp
or pp (dp shrinks to keep the world size), a smaller micro-batch (more accumulation steps, same
global batch) and ZeRO-Offload of the optimizer state. A candidate is kept only if the modified
job passes every other check without an error (the caller supplies that check), so the fixes never
include what DeepSpeed would refuse, such as ZeRO-2 with pipeline parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from dsforge.compiler.estimate.memory import MemoryEstimate, estimate_memory
from dsforge.compiler.plan import Plan, build_plan
from dsforge.compiler.schema import JobSpec


@dataclass(frozen=True)
class MemoryFix:
    """One change to the job and what it does to the peak rank."""

    change: str  # e.g. "parallel.zero: 3"
    spec: JobSpec
    estimate: MemoryEstimate
    saving_bytes: float

    @property
    def fits(self) -> bool:
        """True when the modified job fits the accelerator."""
        return self.estimate.utilization <= 1.0


def _with(spec: JobSpec, section: str, **values: Any) -> JobSpec:
    """A copy of the spec with some keys of one section replaced."""
    return spec.model_copy(update={section: getattr(spec, section).model_copy(update=values)})


def _relayout(spec: JobSpec, plan: Plan, **degrees: int) -> tuple[str, JobSpec] | None:
    """Change tp or pp, keeping the world size by recomputing dp; None when it does not divide."""
    d = plan.degrees
    assert d is not None
    tp, pp = degrees.get("tp", d.tp), degrees.get("pp", d.pp)
    if plan.world_size % (tp * pp * d.cp):
        return None
    dp = plan.world_size // (tp * pp * d.cp)
    dp_value: int | str = "auto" if spec.parallel.dp == "auto" else dp
    label = ", ".join(f"parallel.{k}: {v}" for k, v in degrees.items())
    return f"{label} (dp {d.dp} -> {dp})", _with(spec, "parallel", **degrees, dp=dp_value)


def candidates(spec: JobSpec, plan: Plan) -> Iterator[tuple[str, JobSpec]]:
    """Every single change that could lower the peak (legality is checked by the caller)."""
    d, t, par = plan.degrees, spec.training, spec.parallel
    assert d is not None
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
        yield f"training.micro_batch: {t.micro_batch // 2}", _with(spec, "training", micro_batch=t.micro_batch // 2)
    if plan.zero >= 1 and t.optimizer.offload == "none":
        opt = t.optimizer.model_copy(update={"offload": "cpu"})
        yield "training.optimizer.offload: cpu", _with(spec, "training", optimizer=opt)


Legal = Callable[[JobSpec, Plan], bool]


def ranked_fixes(spec: JobSpec, plan: Plan, legal: Legal, limit: int = 5) -> list[MemoryFix]:
    """The legal single changes that lower the peak, largest saving first (at most ``limit``)."""
    before = estimate_memory(plan).peak.device_bytes
    fixes = []
    for change, new_spec in candidates(spec, plan):
        new_plan = build_plan(new_spec)
        if not new_plan.layout_ok or not new_plan.stage_layers or not legal(new_spec, new_plan):
            continue
        est = estimate_memory(new_plan)
        saving = before - est.peak.device_bytes
        if saving > 0:
            fixes.append(MemoryFix(change, new_spec, est, saving))
    fixes.sort(key=lambda f: -f.saving_bytes)
    return fixes[:limit]


def combined_fix(spec: JobSpec, plan: Plan, legal: Legal, target: float = 0.9,
                 max_changes: int = 5) -> MemoryFix | None:
    """Greedily stack the best legal change until the peak is at most ``target`` of the memory (or,
    failing that, fits at all); None if no stack of changes fits.

    Used when no single change is enough (e.g. a 70B model whose Adam state alone exceeds the
    node's total HBM needs ZeRO, offload and recomputation together).
    """
    before = estimate_memory(plan).peak.device_bytes
    changes: dict[str, str] = {}  # key -> "key: value"; a later change of the same key replaces it
    fitting: MemoryFix | None = None
    for _ in range(max_changes):
        best = ranked_fixes(spec, plan, legal, limit=1)
        if not best:
            break
        fix = best[0]
        key = fix.change.split(":")[0]
        changes.pop(key, None)
        changes[key] = fix.change
        spec, plan = fix.spec, build_plan(fix.spec)
        if fix.fits:
            fitting = MemoryFix(" + ".join(changes.values()), spec, fix.estimate,
                                before - fix.estimate.peak.device_bytes)
            if fix.estimate.utilization <= target:
                break
    return fitting
