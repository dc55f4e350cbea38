"""Helpers for the rewrite tests: parsed job specs and plans from a few keys."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.plan.plan import Plan, build_plan
from dsforge.compiler.spec.schema import JobSpec


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


def _parts_worker(rank: int, world: int, parts: list[tuple[str, Callable[..., None], tuple[Any, ...]]],
                  out: str) -> None:
    """Run each part in turn on this rank; a failing part leaves its traceback in ``out`` and stops the world
    (the other ranks may wait in one of its collectives, so nothing after it can run)."""
    import traceback

    for name, fn, args in parts:
        try:
            fn(rank, world, *args)
        except BaseException:
            (Path(out) / f"{name}.rank{rank}.txt").write_text(traceback.format_exc(), encoding="utf-8")
            raise
        (Path(out) / f"{name}.rank{rank}.ok").write_text("", encoding="utf-8")


@pytest.fixture(scope="session")
def two_rank_rewrites(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], None]:
    """One 2-rank launch for the rewrite tests' parts (test_apply_tp's and test_family_parity's): starting two
    processes that import torch, transformers and DeepSpeed costs more than every part's work. Returns a
    check that fails a test whose part failed (with its traceback) or did not run (an earlier part failed)."""
    from tests.runtime.launcher import run
    from tests.runtime_rewrite import test_apply_tp, test_family_parity, test_zoo_sample

    tmp = tmp_path_factory.mktemp("rewrite-parts")
    out = tmp_path_factory.mktemp("rewrite-parts-out")
    parts = [("apply_tp", test_apply_tp._worker, test_apply_tp.worker_args(tmp)),
             ("family_parity", test_family_parity._worker, test_family_parity.worker_args(tmp)),
             ("zoo_sample", test_zoo_sample._worker, test_zoo_sample.worker_args(tmp)),
             ("zoo_ep_sample", test_zoo_sample.ep_worker, test_zoo_sample.ep_worker_args(tmp))]
    failure = ""
    try:
        run(_parts_worker, 2, parts, str(out))
    except Exception as exc:  # noqa: BLE001 - reported by the test whose part it is
        failure = f"{type(exc).__name__}: {exc}"

    def check(name: str) -> None:
        traces = sorted(out.glob(f"{name}.rank*.txt"))
        if traces:
            raise AssertionError(
                f"{name} failed on {len(traces)} rank(s):\n" + traces[0].read_text(encoding="utf-8")
            )
        if len(list(out.glob(f"{name}.rank*.ok"))) != 2:
            raise AssertionError(f"{name} did not run on both ranks (the launch stopped first: "
                                 f"{failure or 'no error'})")

    return check
