"""`dsforge explain`: every example explains; JSON is the summary; bad jobs exit like validate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsforge.cli import cli
from dsforge.compiler.estimate.summary import summarize
from dsforge.compiler.validate import validate_file
from tests.conftest import EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_explains(path: Path) -> None:
    result = CliRunner().invoke(cli, ["explain", str(path)])
    assert result.exit_code == 0, result.output
    for title in ("Summary", "Memory per pipeline stage", "Communication per group", "Timing"):
        assert title in result.output
    assert "MFU" in result.output and "Traceback" not in result.output


def test_json_is_the_summary_compile_embeds() -> None:
    path = next(p for p in EXAMPLES if p.name == "llama3-70b-multinode.yaml")
    result = CliRunner().invoke(cli, ["explain", str(path), "--format", "json"])
    assert result.exit_code == 0
    doc = json.loads(result.output)
    assert doc == json.loads(json.dumps(summarize(validate_file(path).plan)))
    assert set(doc) >= {"params", "flops", "memory", "communication", "pipeline", "time"}
    assert doc["memory"]["peak_rank"] == doc["memory"]["stages"][doc["memory"]["peak_stage"]]["rank"]
    assert {r["group"] for r in doc["communication"]["collectives"]} >= {"tp", "pp", "dp-cp"}
    assert 0 < doc["time"]["mfu"] < 1 and doc["pipeline"]["stages"] == 4


def test_tokens_sets_the_training_horizon() -> None:
    path = next(p for p in EXAMPLES if p.name == "tiny-3d.yaml")
    result = CliRunner().invoke(cli, ["explain", str(path), "--format", "json", "--tokens", "1e6"])
    t = json.loads(result.output)["time"]
    assert t["train_tokens"] == 1e6 and t["train_time_s"] == pytest.approx(1e6 / t["tokens_per_s"])


def test_invalid_job_prints_diagnostics_and_exits_1(write_job) -> None:  # type: ignore[no-untyped-def]
    path = write_job("version: 1\nmodel: {preset: llama3-8b}\nhardware: {preset: dgx-h100}\n"
                     "parallel: {tp: 3, dp: auto}\n")
    result = CliRunner().invoke(cli, ["explain", str(path)])
    assert result.exit_code == 1
    assert "error[DSF" in result.output and "Traceback" not in result.output


def test_unusable_file_exits_2(write_job) -> None:  # type: ignore[no-untyped-def]
    path = write_job("version: 1\nmodel: [unclosed\n")
    result = CliRunner().invoke(cli, ["explain", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    missing = CliRunner().invoke(cli, ["explain", str(path) + ".absent"])
    assert missing.exit_code == 2
