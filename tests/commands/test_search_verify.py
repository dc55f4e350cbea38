"""`dsforge search --verify`: the top candidates and the last-ranked one of a tiny job run with `dsforge run`
on this machine's CPU processes, predicted beside measured, with the rank correlation."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dsforge.cli import cli
from dsforge.commands.search_verify import spearman

#: One rank per run (half the processes of two, and `dsforge run` is mostly start-up on this machine), three
#: steps (the report times the one after the warm-up and the probed steps); the layouts differ in ZeRO stage,
#: micro-batch and recompute. What two ranks add (tp, pp, dp) the test of `chosen` covers without runs.
JOB = """version: 1
name: verify-tiny
model: {preset: tiny-llama}
hardware: {preset: cpu-local, gpus_per_node: 1}
parallel: {zero: auto}
training: {global_batch: 4, micro_batch: auto, recompute: auto, precision: fp32, steps: 3,
           optimizer: {name: adamw, lr: 1.0e-3}}
"""
TWO_RANKS = """version: 1
name: verify-tiny
model: {preset: tiny-llama}
hardware: {preset: cpu-local, gpus_per_node: 2}
parallel: {tp: auto, pp: auto, zero: auto}
training: {global_batch: 4, micro_batch: auto, precision: fp32, steps: 4, optimizer: {name: adamw, lr: 1.0e-3}}
"""  # noqa: E501


def test_spearman_is_one_for_the_same_order_and_minus_one_for_the_reverse() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [5, 5, 9]) == pytest.approx(1.0) and spearman([1], [2]) == 0.0


@pytest.mark.slow
def test_verify_runs_six_layouts_and_sets_measured_beside_predicted(write_job, monkeypatch) -> None:
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    path = write_job(JOB)
    result = CliRunner().invoke(cli, ["search", str(path), "--verify", "5", "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["verify"]
    assert len(rows) == 6 and [r["rank"] for r in rows][:5] == [1, 2, 3, 4, 5] and rows[-1]["rank"] > 5
    assert all(
        r["error"] is None and r["measured_step_s"] > 0 and r["measured_peak_bytes"] > 0 for r in rows
    ), rows
    assert len({json.dumps(r["layout"], sort_keys=True) for r in rows}) == 6
    assert not list(path.parent.glob(".*.verify-*.yaml"))  # the candidates' job files are cleaned up


def test_verify_picks_the_top_and_the_last_of_every_fitting_candidate(write_job) -> None:
    from dsforge.commands.search_verify import chosen
    from dsforge.compiler.frontend.parse import load_job
    from dsforge.compiler.search.engine import search

    job, _ = load_job(write_job(TWO_RANKS))
    assert job is not None
    r = search(job, exhaustive=True)
    picks = chosen(r, 5)
    assert [rank for rank, _ in picks] == [1, 2, 3, 4, 5, len(r.fitting)] and len(r.fitting) > 5
    assert picks[-1][1] is r.fitting[-1] and [c for _, c in picks[:5]] == r.fitting[:5]
