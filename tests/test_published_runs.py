"""The published-run set (benchmarks/published/, issue 24): every run validates without an error, and every
job file says its source, its stack and what was filled in."""

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


def test_the_set_is_large_and_every_file_is_indexed() -> None:
    files = {p.name for p in (ROOT / "benchmarks" / "published").glob("*.yaml")} - {"index.yaml"}
    assert files == {e["file"] for e in ENTRIES}
    assert len(files) >= 60


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["file"] for e in ENTRIES])
def test_a_published_run_is_not_refused(entry: dict[str, object]) -> None:
    text = (ROOT / "benchmarks" / "published" / str(entry["file"])).read_text(encoding="utf-8")
    assert "# source: " in text and "# stack: " in text and "# not published, filled in:" in text
    result = published_runs.evaluate(entry)
    assert result.accepted, result.errors
    if entry.get("tflops_per_gpu"):
        assert result.predicted is not None and result.predicted > 0
