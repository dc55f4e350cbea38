"""`dsforge explain --rewrite`: the rewrite plan as a table, in JSON and HTML, its exact parameter counts in
place of the formula's (both shown where they differ), and clear exits for unplaceable models or no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from dsforge.cli import cli
from dsforge.compiler.emit.rewrite_doc import with_exact_params
from dsforge.compiler.estimate.summary import summarize
from dsforge.explain.text import headline, summary_section
from tests.commands.test_compile_rewrite import TOY_JOB, write_job
from tests.conftest import ROOT
from tests.test_compile_support import example_path, example_plan

MIXTRAL = example_path("mixtral-8x7b-ep")


@pytest.fixture(scope="module")
def runtime() -> None:
    """--rewrite builds the model on the meta device: torch and transformers."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")


@pytest.fixture
def mixtral_tp2(tmp_path: Path) -> Path:
    """The Mixtral example at tp 2 x ep 4 with SP: the runtime keeps experts whole on each TP rank."""
    job = yaml.safe_load(MIXTRAL.read_text(encoding="utf-8"))
    job["parallel"].update(tp=2, ep=4, sequence_parallel=True)
    path = tmp_path / "mixtral-tp2.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return path


def test_text_shows_the_rewrite_plan_and_exact_counts(runtime: None, mixtral_tp2: Path) -> None:
    result = CliRunner().invoke(cli, ["explain", str(mixtral_tp2), "--rewrite"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Rewrite plan (mixtral, tp=2, ep=4, sequence-parallel)" in out
    assert "expert     model.layers.{0..31}.mlp.experts" in out and "8x28672x4096 -> 2x28672x4096" in out
    assert "parameters: 46,702,792,704 exact; per rank by pipeline stage: 12,077,764,608" in out
    # The formula keeps experts whole on every TP rank, as the runtime does, so the two agree.
    assert "parameters per GPU by stage (exact)  12.08B" in out and "(formula" not in out
    plain = CliRunner().invoke(cli, ["explain", str(mixtral_tp2)])
    assert "Rewrite plan" not in plain.output and ("parameters per GPU by stage (formula)  "
                                                   "12.08B") in plain.output


def test_exact_counts_are_shown_beside_a_formula_that_differs() -> None:
    plan = example_plan("tiny-3d")
    summary = summarize(plan)
    per_stage = [row["dense"] + row["expert"] + 1000 for row in summary["params"]["per_gpu_by_stage"]]
    desc = {"ok": True,
            "params": {"total": summary["params"]["total"] + 2000, "per_rank_by_stage": per_stage}}
    merged = with_exact_params(summary, desc)
    rows = summary_section(merged).rows
    row = next(r for r in rows if r[0].startswith("parameters per GPU by stage"))
    assert row[0].endswith("(exact)") and "(formula" in row[1]
    assert merged["params"]["formula_total"] == summary["params"]["total"]


def test_json_carries_the_rewrite_plan_and_the_exact_counts(runtime: None, mixtral_tp2: Path) -> None:
    result = CliRunner().invoke(cli, ["explain", str(mixtral_tp2), "--rewrite", "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    rewrite, params = doc.pop("rewrite"), doc.pop("params")
    assert rewrite["ok"] and rewrite["params"]["per_rank_by_stage"] == [12_077_764_608]
    assert params["total"] == rewrite["params"]["total"] == params["formula_total"]
    assert (
        params["per_gpu_by_stage"][0]["exact"] == 12_077_764_608
        and params["source"] == "rewrite plan (exact)"
    )
    row = params["per_gpu_by_stage"][0]
    assert row["dense"] + row["expert"] == row["exact"]  # formula and module tree agree for MoE under TP
    plain = json.loads(CliRunner().invoke(cli, ["explain", str(mixtral_tp2), "--format", "json"]).stdout)
    assert doc == {k: v for k, v in plain.items() if k != "params"}  # nothing else changes


def test_html_report_has_the_rewrite_section(tmp_path: Path, runtime: None) -> None:
    pytest.importorskip("matplotlib")
    html = tmp_path / "report.html"
    result = CliRunner().invoke(cli,
                                ["explain", str(example_path("tiny-3d")), "--rewrite", "--html", str(html)])
    assert result.exit_code == 0, result.output
    page = html.read_text(encoding="utf-8")
    assert "<h2>Rewrite plan (llama, tp=2, ep=1)</h2>" in page and "model.layers.{0..3}.mlp.down_proj" in page


def test_a_model_the_policies_cannot_place_exits_1_naming_the_modules(tmp_path: Path, runtime: None) -> None:
    result = CliRunner().invoke(cli, ["explain", str(write_job(tmp_path, TOY_JOB)), "--rewrite"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "Rewrite plan (custom): cannot place the model" in result.output
    assert "blocks.{0..1}.norm, blocks.{0..1}.fc2, final, head" in result.output
    assert "6 modules with parameters left over" in result.output and "Summary" in result.output


def test_without_torch_rewrite_is_a_clear_error(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['torch'] = None; from dsforge.cli import main; "
            f"sys.argv = ['dsforge', 'explain', {str(example_path('tiny-3d'))!r}, '--rewrite']; main()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--rewrite cannot compute the rewrite plan: torch is not installed here" in proc.stderr


def _summary(total: int, stages: list[tuple[int, int]], active: int | None = None) -> dict[str, Any]:
    return {"params": {"total": total, "active_per_token": total if active is None else active,
                       "per_layer": 1, "per_gpu_by_stage": [{"stage": i, "dense": d, "expert": e} for i,
                                            (d, e) in enumerate(stages)]}}


def test_exact_counts_replace_the_formula_only_where_the_plan_is_ok() -> None:
    desc = {"ok": True, "params": {"total": 1_000_500, "per_rank_by_stage": [300, 700]}}
    s = with_exact_params(_summary(1_000_000, [(300, 0), (600, 50)]), desc)
    p = s["params"]
    assert (p["total"], p["formula_total"], p["active_per_token"]) == (1_000_500, 1_000_000, 1_000_500)
    assert [st["exact"] for st in p["per_gpu_by_stage"]] == [300, 700]
    assert summary_section_row(s) == ["parameters per GPU by stage (exact)", "300, 700 (formula 650)"]
    moe = with_exact_params(_summary(1_000_000, [(300, 0)], active=400_000), desc)["params"]
    assert moe["active_per_token"] == 400_000  # a MoE model's active count is not the total
    failed = _summary(1_000_000, [(300, 0)])
    assert with_exact_params(failed, {"ok": False, "errors": ["x"], "leftover": []}) is failed


def summary_section_row(s: dict[str, Any]) -> list[str]:
    """The parameters row of the Summary table for a summary that has only ``params``."""
    plan_summary = json.loads(json.dumps(summarize(example_plan("tiny-3d"))))
    section = summary_section({**plan_summary, "params": s["params"]})
    assert "(exact; formula 1.00M)" in headline({**plan_summary, "params": s["params"]})
    return section.rows[-1]
