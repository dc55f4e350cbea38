"""`validate` accepts exactly what DeepSpeed 0.19.8 accepts: generated `deepspeed:` overrides, both sides.

The changes and the classification are benchmarks/ds_differential.py's (its long campaign runs thousands of
cases); here hypothesis draws them for a bounded number of cases, each through `validate` and through
`DeepSpeedConfig` on the ds_config compile would write (an mpu with the plan's dp), in one DeepSpeed worker
process shared by the module. A small fixed sample of the one-rank job also runs `deepspeed.initialize` and
one training step. A case where validate is clean and DeepSpeed refuses, a false alarm of a rule that claims
DeepSpeed's parse refuses, or a config DeepSpeed runs differently from the job fails the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ROOT, load_script

pytest.importorskip("deepspeed")


DIFF = load_script(ROOT / "benchmarks" / "ds_differential.py", "dsforge_ds_differential")
SEEDS = DIFF.seed_jobs()
OPS = st.lists(st.tuples(st.sampled_from(DIFF.KINDS), st.integers(0, 10**6), st.integers(0, 10**6)),
               min_size=1, max_size=3)
COMPARED: dict[str, int] = {}


@pytest.fixture(scope="module")
def oracle() -> Iterator[Any]:
    worker = DIFF.Oracle()
    yield worker
    worker.close()


def _check(oracle: Any, case: Any, folder: Path, init: bool = False) -> str:
    cls, judged, verdict = DIFF.run_case(case, oracle, folder, init)
    COMPARED[cls] = COMPARED.get(cls, 0) + 1
    assert cls not in DIFF.FAILURES, (
        f"{cls}: {case.seed} {case.changes}\n validate errors {judged.errors}\n deepspeed {verdict}"
    )
    return str(cls)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.sampled_from(sorted(SEEDS)), ops=OPS)
def test_validate_accepts_exactly_what_deepspeed_config_accepts(oracle: Any, tmp_path: Path, seed: str,
                                                               ops: list[tuple[str, int, int]]) -> None:
    _check(oracle, DIFF.make_case(SEEDS, seed, ops), tmp_path)


#: One-rank jobs that also initialize and train a step (no offload, Lion or Lamb: their CPU ops are
#: JIT-compiled, minutes on two cores; the campaign runs them).
INIT_CASES = [
    [("job", 0, 0)],  # parallel.zero 0 ... (the (a, b) integers pick the change, see apply_change)
    [("job", 0, 2)], [("job", 0, 3)], [("job", 4, 1)],  # ZeRO-2, ZeRO-3, bf16
    [("zero_int", 0, 12)], [("zero_int", 2, 1)], [("zero_bool", 4, 1)], [("zero_bool", 0, 4)],
    [("bf16", 1, 0), ("job", 4, 1)], [("fp16", 1, 0)], [("top", 5, 0)], [("sched", 0, 2)],
    [("opt_type", 0, 1)], [("opt_params", 0, 1)], [("job", 5, 0)], [("zero_bool", 4, 3), ("job", 0, 1)],
    *DIFF.one_per_section().values(),  # every section, initialized and stepped
]


@pytest.mark.slow
def test_a_sample_initializes_and_trains_as_validate_says(oracle: Any, tmp_path: Path) -> None:
    seen = [_check(oracle, DIFF.make_case(SEEDS, "one-rank", ops), tmp_path, init=True) for ops in INIT_CASES]
    assert DIFF.AGREE_OK in seen and (DIFF.AGREE_NO in seen or DIFF.BY_DESIGN in seen), seen


def test_the_campaign_draws_every_section() -> None:
    """Every section of DeepSpeed's config (ds_sections.SECTION_NAMES: modelled or refused) is drawn by a
    kind."""
    from dsforge.compiler.deepspeed.ds_sections import SECTION_NAMES

    assert set(DIFF.one_per_section()) == set(SECTION_NAMES)
    for name, ops in DIFF.one_per_section().items():
        case = DIFF.make_case(SEEDS, "one-rank", ops)
        node = case.job["deepspeed"]
        for part in name.split("."):
            assert isinstance(node, dict) and part in node, (name, case.changes)
            node = node[part]


@pytest.mark.slow
@pytest.mark.parametrize("section", sorted(DIFF.one_per_section()))
def test_the_ci_sample_has_one_case_of_each_section(oracle: Any, tmp_path: Path, section: str) -> None:
    """One case per section on a multi-rank example and on the one-rank job, both sides agreeing."""
    ops = DIFF.one_per_section()[section]
    for seed in ("one-rank", min(set(SEEDS) - {"one-rank"})):
        _check(oracle, DIFF.make_case(SEEDS, seed, ops), tmp_path)


def test_the_classification_counts_each_failure() -> None:
    """The oracle's classes are computable: a clean job DeepSpeed refuses is MISSED, and so on."""
    judged = DIFF.Judged([], {"x": 1}, 2, {"stage": 1})
    assert DIFF.classify(judged, {"ok": False}) == DIFF.MISSED
    assert DIFF.classify(judged, {"ok": True, "summary": {"stage": 0}}) == DIFF.ELSE
    assert DIFF.classify(judged, {"ok": True, "summary": {"stage": 1}, "dropped": ["prefetch_bucket_size"]}) \
        == DIFF.ELSE
    assert DIFF.classify(judged, {"ok": True, "summary": {"stage": 1}}) == DIFF.AGREE_OK
    assert DIFF.classify(DIFF.Judged(["DSF517"], {"x": 1}, 2), {"ok": True}) == DIFF.FALSE_ALARM
    assert DIFF.classify(DIFF.Judged(["DSF520"], {"x": 1}, 2), {"ok": True}) == DIFF.BY_DESIGN
    assert DIFF.classify(DIFF.Judged(["DSF517"], {"x": 1}, 2), {"ok": False}) == DIFF.AGREE_NO
    # DeepSpeed runs another lr or schedule than the job's: the override won
    stated = DIFF.Judged([], {"x": 1}, 2, {"opt_params": {"lr": 1e-3}, "scheduler": ["WarmupLR", {"a": 1}]})
    ran = {"opt_params": {"lr": 1e-3, "torch_adam": True}, "scheduler": ["WarmupLR", {"a": 1}]}
    assert DIFF.classify(stated, {"ok": True, "summary": ran}) == DIFF.AGREE_OK
    for other in ({**ran, "opt_params": {"lr": 2e-3}}, {**ran, "scheduler": ["WarmupLR", {"a": 2}]},
                  {**ran, "opt_params": {}}):
        assert DIFF.classify(stated, {"ok": True, "summary": other}) == DIFF.ELSE
