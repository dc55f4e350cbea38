"""The published-run set (benchmarks/published/, issue 24): every run validates without an error, and every job
file says its source, its stack and what was filled in."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("published_runs", ROOT / "benchmarks" / "published_runs.py")
assert _spec is not None and _spec.loader is not None
published_runs = importlib.util.module_from_spec(_spec)
sys.modules["published_runs"] = published_runs  # dataclasses look their module up there
_spec.loader.exec_module(published_runs)

ENTRIES = published_runs.index()
#: Runs that trained but that dsforge still refuses, each with the rule that refuses it; the test checks that the
#: refusal is still this one, so the day one is accepted it fails until the run leaves the list.
KNOWN_REFUSED = {
    # DSF301: 87 GB of activations on stage 1 with selective recompute and 4 virtual stages; the paper does
    # not give its recomputation, and Meta's own schedule changes (sec. 3.3.2) are not modelled
    "llama3-405b-8k-8192gpu.yaml": "DSF301", "llama3-405b-8k-16384gpu.yaml": "DSF301",
    "llama3-405b-128k-16384gpu.yaml": "DSF301",
    # DSF301: TE's FP8 weight cache (2 bytes a parameter) next to bf16 weights; the performance recipes keep
    # FP8 primary weights (--fp8-param-gather), which no job key states yet
    "nemo-llama3-8b-fp8.yaml": "DSF301",
    # DSF301 at 81.3 of 80 GB: the layout is recalled, not checked against the table
    "nemo-llama2-7b-seq16k.yaml": "DSF301",
}


def test_the_set_is_large_and_every_file_is_indexed() -> None:
    files = {p.name for p in (ROOT / "benchmarks" / "published").glob("*.yaml")} - {"index.yaml"}
    assert files == {e["file"] for e in ENTRIES}
    assert len(files) >= 40


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["file"] for e in ENTRIES])
def test_a_published_run_is_not_refused(entry: dict[str, object]) -> None:
    text = (ROOT / "benchmarks" / "published" / str(entry["file"])).read_text(encoding="utf-8")
    assert "# source: " in text and "# stack: " in text and "# not published, filled in:" in text
    result = published_runs.evaluate(entry)
    if entry["file"] in KNOWN_REFUSED:
        assert result.errors == [KNOWN_REFUSED[str(entry["file"])]], "accepted now? take it off KNOWN_REFUSED"
        return
    assert result.accepted, result.errors
    if entry.get("tflops_per_gpu"):
        assert result.predicted is not None and result.predicted > 0
