"""compile's meta build against the estimates' parameter count for a `model.pretrained` family the model keys
cannot state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsforge.commands.compile import compile_file
from dsforge.compiler.model.hf_params import hf_param_count
from tests.compiler.model.test_hf_params import stored_params
from tests.conftest import ROOT

FIXTURE = ROOT / "tests" / "fixtures" / "bad" / "dsf180-pretrained-param-count.yaml"
OLMO2 = ROOT / "tests" / "fixtures" / "pretrained" / "tiny-olmo2"


def test_meta_build_counts_the_checkpoint_and_says_the_estimates_differ(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    result = compile_file(FIXTURE, tmp_path / "out")
    assert result.written is not None
    params = json.loads((tmp_path / "out" / "plan.json").read_text())["summary"]["params"]
    stored = stored_params(OLMO2 / "model.safetensors")
    assert params["total"] == stored == hf_param_count(json.loads((OLMO2 / "config.json").read_text())).total
    assert params["formula_total"] != stored
    (note,) = [n for n in result.notes if "meta build counts" in n]
    assert f"{stored:,}" in note and f"{params['formula_total'] - stored:+,}" in note


def test_explain_says_its_count_is_approximate_and_by_how_much() -> None:
    from click.testing import CliRunner

    from dsforge.cli import cli

    out = CliRunner().invoke(cli, ["explain", str(FIXTURE), "--format", "json"])
    assert out.exit_code == 0, out.output
    summary = json.loads(out.output)
    params = summary["params"]
    stored = stored_params(OLMO2 / "model.safetensors")
    assert f"has {stored:,}" in params["approximate"]
    assert f"off by {params['total'] - stored:+,}" in params["approximate"]
    flops = 6.0 * (params["total"] - stored) * summary["time"]["tokens_per_step"]
    assert f"model FLOPs/step off by about {flops:+.3e}" in params["approximate"]
