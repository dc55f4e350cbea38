"""Fuzzing in the suite: mutated examples and fixtures through validate, explain and compile.

The mutations and the oracle are benchmarks/fuzz.py's (its long campaign runs 10,000+ cases); here
hypothesis draws them, a bounded number per run (900 cases, ~20 s), and shrinks any failure to a small case.
Each case must keep every promise of issue 13: no exception escapes the CLI, no command takes more
than its CPU budget, every JSON output parses strictly, a validate-clean job explains and compiles,
and a refused compile leaves no directory behind.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ROOT, load_script

FUZZ = load_script(ROOT / "benchmarks" / "fuzz.py", "dsforge_fuzz")
SEEDS = FUZZ.seed_cases()
USABLE = [c for c in SEEDS if not c.name.startswith("bad/")]
#: CPU seconds one command may take on any input (wall time varies with the machine's load; CPU less).
BUDGET = 2.0
OPS = st.tuples(st.sampled_from(FUZZ.KINDS), st.integers(0, 10**6), st.integers(0, 10**6))
#: Mutations that tend to keep a job usable, so that explain and compile see many huge-but-valid jobs.
PLAUSIBLE = st.tuples(st.sampled_from(("scale", "degree", "number", "section_key", "extends_split")),
                      st.integers(0, 10**6), st.integers(0, 10**6))
SETTINGS = settings(deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _check(case, ops, workdir: Path) -> None:
    outcome = FUZZ.check_files(FUZZ.mutate(case, ops), case.entry, workdir, budget=BUDGET)
    assert outcome.kind not in FUZZ.FAILURES, f"{outcome.kind}: {outcome.detail} ({case.name} {ops})"


@pytest.mark.slow  # over ~3 s: the fast tier stays near a minute
@settings(SETTINGS, max_examples=600)
@given(case=st.sampled_from(SEEDS), ops=st.lists(OPS, min_size=1, max_size=4))
def test_any_mutation_of_any_seed_keeps_the_promises(case, ops, tmp_path_factory) -> None:
    _check(case, ops, tmp_path_factory.mktemp("fuzz"))


@pytest.mark.slow  # over ~3 s: the fast tier stays near a minute
@settings(SETTINGS, max_examples=300)
@given(case=st.sampled_from(USABLE), ops=st.lists(PLAUSIBLE, min_size=1, max_size=3))
def test_plausible_mutations_of_usable_jobs_explain_and_compile(case, ops, tmp_path_factory) -> None:
    _check(case, ops, tmp_path_factory.mktemp("fuzz"))


def test_the_seeds_cover_examples_fixtures_and_extends_chains() -> None:
    names = {c.name for c in SEEDS}
    assert {"examples/llama3-70b-multinode.yaml", "good/chain-of-three.yaml",
            "bad/dsf010-extends-cycle-a.yaml"} <= names
    chain = next(c for c in SEEDS if c.name == "good/chain-of-three.yaml")
    assert len(chain.files) == 3  # the entry and the two bases it extends


def test_mutations_are_deterministic_and_reach_every_kind() -> None:
    case = next(c for c in SEEDS if c.name == "examples/tiny-3d.yaml")
    for kind in FUZZ.KINDS:
        ops = [(kind, 12345, 678)]
        assert FUZZ.mutate(case, ops) == FUZZ.mutate(case, ops)
    assert FUZZ.mutate(case, [("extends_split", 1, 1)]).keys() > {case.entry}


# --- the oracle can fail: each failure class is detected ------------------------------------------------


def _clean(tmp_path: Path) -> tuple[dict[str, bytes], str]:
    case = next(c for c in SEEDS if c.name == "examples/tiny-tp2-dp2.yaml")
    return dict(case.files), case.entry


def test_a_clean_example_is_ok(tmp_path: Path) -> None:
    files, entry = _clean(tmp_path)
    outcome = FUZZ.check_files(files, entry, tmp_path, budget=BUDGET)
    assert outcome.kind == FUZZ.OK and set(outcome.seconds) == {"validate", "explain", "compile"}


def test_a_crashing_rule_counts_as_an_internal_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dsforge.compiler.rules import registry

    def boom(ctx):
        raise RuntimeError("boom")

    rule = registry.get_rule("DSF101")
    assert rule is not None
    monkeypatch.setitem(registry._RULES, "DSF101", dataclasses.replace(rule, check=boom))
    files, entry = _clean(tmp_path)
    outcome = FUZZ.check_files(files, entry, tmp_path, budget=BUDGET)
    assert outcome.kind == FUZZ.INTERNAL and "DSF900" in outcome.detail


def test_a_non_finite_estimate_counts_as_a_later_failure(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from dsforge.explain import report

    real = report.explain_plan

    def nan_summary(*args, **kwargs):
        ex = real(*args, **kwargs)
        ex.summary["time"]["step_s"] = math.nan
        return ex

    monkeypatch.setattr(report, "explain_plan", nan_summary)
    files, entry = _clean(tmp_path)
    outcome = FUZZ.check_files(files, entry, tmp_path, budget=BUDGET)
    assert outcome.kind == FUZZ.LATER and "non-finite" not in outcome.detail and "nan" in outcome.detail


def test_strict_json_refuses_nan_and_infinity() -> None:
    for text in ('{"a": NaN}', '[Infinity]', '{"b": -Infinity}'):
        with pytest.raises(ValueError):
            FUZZ.strict_json(text)
    assert FUZZ.strict_json('{"a": 1e308}') == {"a": 1e308}
