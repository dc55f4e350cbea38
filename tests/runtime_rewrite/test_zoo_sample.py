"""The CI sample of the HF zoo (benchmarks/hf_zoo.py): a few exact types that together use every HF style the
zoo's exact types use, dense and MoE, run under tp=2 in the rewrite tests' shared 2-rank world (conftest.py)
against plain HF on one process: the loss of every step and every gradient (test_family_parity's check)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dsforge.compiler.model.hf_plans import plans_for_type

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "hf_zoo.json"


def _styles(model_type: str) -> set[str]:
    plans = plans_for_type(model_type)
    assert plans is not None, model_type
    return set(plans.tp.values()) | set(plans.ep.values()) | set(plans.head_tp.values())


def sample_types() -> list[str]:
    """Greedy cover of the exact types' styles, quickest first on ties; one dense and one MoE type at
    least."""
    rows = json.loads(RESULTS.read_text(encoding="utf-8"))["rows"]
    exact = sorted((r for r in rows if r["result"] == "exact"),
                   key=lambda r: (r.get("seconds", 0), r["type"]))
    styles = {r["type"]: _styles(r["type"]) for r in exact}
    wanted = set().union(*styles.values())
    chosen: list[str] = []
    while wanted:
        best = max(styles, key=lambda t: len(styles[t] & wanted))  # max keeps the first (quickest) of equals
        chosen.append(best)
        wanted -= styles[best]
    if not any(plans_for_type(t).ep for t in chosen):  # type: ignore[union-attr]
        chosen.append(next(t for t in styles if plans_for_type(t).ep))  # type: ignore[union-attr]
    if all(plans_for_type(t).ep for t in chosen):  # type: ignore[union-attr]
        chosen.append(next(t for t in styles if not plans_for_type(t).ep))  # type: ignore[union-attr]
    return chosen


def _worker(rank: int, world: int, specs: list[Any]) -> None:
    import contextlib

    from benchmarks.float64_everywhere import float64_everywhere
    from tests.runtime_rewrite.test_family_parity import tp_parity

    for model_type, spec in specs:
        # a float64 type as the zoo ran it: its own float32 casts promoted too
        with float64_everywhere() if model_type.endswith("float64") else contextlib.nullcontext():
            tp_parity(rank, spec, tag=f"zoo sample {model_type}")


def _dtypes() -> dict[str, str]:
    """Each exact type's dtype as the zoo found it exact (float64 where float32's rounding differed)."""
    rows = json.loads(RESULTS.read_text(encoding="utf-8"))["rows"]
    return {r["type"]: r.get("dtype", "float32") for r in rows if r["result"] == "exact"}


def worker_args(tmp: Path) -> tuple[Any, ...]:
    """The sample's tp=2 jobs, made here so both ranks read the same files; each type in the dtype the zoo
    found it exact in."""
    import benchmarks.hf_zoo as zoo
    from tests.runtime_rewrite.conftest import make_job

    specs = []
    dtypes = _dtypes()
    for t in sample_types():
        model = zoo._factory(t, dtypes[t])()
        specs.append((f"{t} {dtypes[t]}", make_job(tmp, zoo._job_keys(model, t, dtypes[t]), {"tp": 2})))
    return (specs,)


def test_the_sample_uses_every_style_of_the_exact_types_dense_and_moe():
    rows = json.loads(RESULTS.read_text(encoding="utf-8"))["rows"]
    chosen = sample_types()
    assert set().union(*(_styles(t) for t in chosen)) == set().union(*(_styles(r["type"]) for r in rows
                                                                        if r["result"] == "exact"))
    assert any(plans_for_type(t).ep for t in chosen) and not all(plans_for_type(t).ep for t in chosen)  # type: ignore[union-attr]


@pytest.mark.slow
def test_the_zoo_sample_is_exact_under_tp2(two_rank_rewrites):
    two_rank_rewrites("zoo_sample")


#: The ep=2 sample (benchmarks/hf_zoo.py --mode ep): OLMoE's router is a copy of Qwen3-MoE's (accepted by its
#: forward's text), Qwen3-Next adds a gated shared expert.
EP_SAMPLE = ("olmoe", "qwen3_next")


def ep_worker(rank: int, world: int, specs: list[Any]) -> None:
    """Each ep sample type at ep=2 x dp=2 against one process (test_family_parity's ep_parity)."""
    from tests.runtime_rewrite.test_family_parity import ep_parity

    for spec in specs:
        ep_parity(rank, spec, formula=False)  # the zoo's keys do not describe the experts


def ep_worker_args(tmp: Path) -> tuple[Any, ...]:
    """The ep sample's jobs, made here so both ranks read the same files."""
    import benchmarks.hf_zoo as zoo
    from tests.runtime_rewrite.conftest import make_job

    return ([make_job(tmp, zoo._job_keys(zoo._factory(t)(), t), {"dp": 2, "ep": 2}) for t in EP_SAMPLE],)


@pytest.mark.slow
def test_the_zoo_ep_sample_is_exact_under_ep2(two_rank_rewrites):
    two_rank_rewrites("zoo_ep_sample")
