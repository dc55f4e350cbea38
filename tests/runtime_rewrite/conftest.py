"""Helpers for the rewrite tests: parsed job specs and plans from a few keys."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsforge.compiler.parse import load_job
from dsforge.compiler.plan import Plan, build_plan
from dsforge.compiler.schema import JobSpec


def make_job(tmp: Path, model: dict[str, Any], parallel: dict[str, Any] | None = None,
             rewrite: list[dict[str, Any]] | None = None) -> JobSpec:
    """A parsed job on cpu-local hardware with exactly the ranks the degrees fill (dp 1)."""
    par = {"tp": 1, "pp": 1, "dp": 1, **(parallel or {})}
    ranks = par["tp"] * par["pp"] * par["dp"] * par.get("cp", 1)
    doc: dict[str, Any] = {"version": 1, "model": model, "parallel": par,
                           "hardware": {"preset": "cpu-local", "gpus_per_node": ranks}}
    if rewrite:
        doc["rewrite"] = rewrite
    path = tmp / f"job{len(list(tmp.glob('job*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    job, diags = load_job(path)
    if job is None:
        raise AssertionError(f"test job does not parse: {[d.message for d in diags]}")
    return job.spec


@pytest.fixture
def job(tmp_path: Path) -> Callable[..., tuple[JobSpec, Plan]]:
    """Build (spec, plan) from model keys, parallel keys and rewrite rules."""

    def build(model: dict[str, Any], parallel: dict[str, Any] | None = None,
              rewrite: list[dict[str, Any]] | None = None) -> tuple[JobSpec, Plan]:
        spec = make_job(tmp_path, model, parallel, rewrite)
        return spec, build_plan(spec)

    return build
