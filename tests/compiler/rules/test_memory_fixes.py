"""DSF301's fix search: each change judged on memory and on what the change itself breaks, the base
estimate computed once, divisors in O(sqrt n)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsforge.compiler.estimate import memory_fixes
from dsforge.compiler.estimate.memory import MemoryEstimate, estimate_memory
from dsforge.compiler.plan.plan import Plan, PricedPlan
from dsforge.compiler.rules import memory as memory_rule
from dsforge.compiler.rules.registry import Context
from dsforge.compiler.rules.util import divisors
from dsforge.compiler.spec.schema import JobSpec
from dsforge.compiler.validate import validate_file
from dsforge.diagnostics import Diagnostic

WriteJob = Callable[..., Path]

#: 70B with ZeRO off on one DGX: dp 8, so global_batch 63 does not split (DSF201) and 64 does.
ONE_NODE = """\
version: 1
model: {{preset: llama3-70b}}
hardware: {{preset: dgx-h100, nodes: 1}}
parallel: {{dp: auto, zero: 0}}
training: {{global_batch: {batch}, micro_batch: 1, precision: bf16, recompute: selective}}
"""
#: examples/llama3-70b-multinode.yaml's layout on 24 GB accelerators: dp 2, so 129 does not split.
MULTINODE_24GB = """\
version: 1
model: {{preset: llama3-70b}}
hardware: {{preset: dgx-h100, nodes: 8, accelerator: {{name: H100-24GB, memory_gb: 24, bf16_tflops: 989,
           hbm_gbs: 3350}}}}
parallel: {{tp: 8, pp: 4, dp: auto, zero: 1, sequence_parallel: true}}
training: {{global_batch: {batch}, micro_batch: 1, recompute: selective}}
"""
#: tp 4 x pp 2 on two nodes (dp 2): DeepSpeed's pipeline engine refuses ZeRO-2/3 (DSF501).
PIPELINE = """\
version: 1
model: {{preset: llama3-70b}}
hardware: {{preset: dgx-h100, nodes: 2}}
parallel: {{tp: 4, pp: 2, dp: auto, zero: 1}}
training: {{global_batch: {batch}, micro_batch: 1, precision: bf16, recompute: none}}
"""


def diagnostics(write_job: WriteJob, body: str, batch: int) -> dict[str, Diagnostic]:
    return {d.rule: d for d in validate_file(write_job(body.format(batch=batch))).diagnostics}


@pytest.mark.parametrize(("body", "broken", "fixed"), [(ONE_NODE, 63, 64), (MULTINODE_24GB, 129, 128)],
                         ids=["one-node", "multinode-24gb"])
def test_an_unrelated_error_does_not_change_the_memory_fixes(write_job: WriteJob, body: str, broken: int,
                                                            fixed: int) -> None:
    with_error, without = diagnostics(write_job, body, broken), diagnostics(write_job, body, fixed)
    assert "DSF201" in with_error and "DSF201" not in without  # the batch error is its own diagnostic
    memory, clean = with_error["DSF301"], without["DSF301"]
    assert memory.message == clean.message and memory.fix == clean.fix
    assert memory.details["fixes"] == clean.details["fixes"]
    assert "no legal combination" not in memory.fix and memory.details["fixes"][-1]["fits"]


def test_a_change_that_brings_its_own_error_stays_out_beside_an_unrelated_error(write_job: WriteJob) -> None:
    diags = diagnostics(write_job, PIPELINE, 63)
    assert "DSF201" in diags
    changes = [f["change"] for f in diags["DSF301"].details["fixes"]]
    assert changes and not any("zero: 2" in c or "zero: 3" in c for c in changes)
    assert changes == [f["change"] for f in diagnostics(write_job, PIPELINE, 64)["DSF301"].details["fixes"]]


def test_every_plan_is_estimated_once(write_job: WriteJob, monkeypatch: pytest.MonkeyPatch) -> None:
    # the combined search runs here (no single change fits), the path that used to re-estimate the job
    estimated: list[PricedPlan] = []

    def counting(plan: PricedPlan) -> MemoryEstimate:
        estimated.append(plan)
        return estimate_memory(plan)

    monkeypatch.setattr(memory_rule, "estimate_memory", counting)
    monkeypatch.setattr(memory_fixes, "estimate_memory", counting)
    path = write_job(MULTINODE_24GB.format(batch=128))
    result = validate_file(path)
    assert "together" in next(d.fix for d in result.diagnostics if d.rule == "DSF301")
    # what the rule prices
    assert result.plan is not None and sum(p is result.plan.priced() for p in estimated) == 1
    assert len({id(p) for p in estimated}) == len(estimated), "a plan was estimated twice"


def test_errors_are_checked_once_for_the_job_as_written(write_job: WriteJob,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Plan] = []
    make = memory_rule._error_check

    def counting_check(ctx: Context) -> memory_fixes.ErrorCheck:
        inner = make(ctx)

        def check(spec: JobSpec, plan: Plan) -> frozenset[memory_fixes.ErrorKey]:
            seen.append(plan)
            return inner(spec, plan)

        return check

    monkeypatch.setattr(memory_rule, "_error_check", counting_check)
    result = validate_file(write_job(ONE_NODE.format(batch=63)))
    assert result.plan is not None and sum(p is result.plan for p in seen) == 1


@given(n=st.integers(-3, 10**7), limit=st.none() | st.integers(0, 10**4))
def test_divisors_match_trial_division(n: int, limit: int | None) -> None:
    # trial division over a bounded range: every divisor up to 10^4, then the cofactors of the small ones
    small = [d for d in range(1, min(n, 10**4) + 1) if n % d == 0]
    expected = sorted({*small, *(n // d for d in small)}) if n > 0 else []
    assert divisors(n, limit) == [d for d in expected if limit is None or d <= limit]


def test_divisors_of_a_square_and_a_prime() -> None:
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert divisors(1) == [1] and divisors(0) == []
    assert divisors(2**31 - 1) == [1, 2**31 - 1]  # a Mersenne prime: sqrt(n) steps, not n
