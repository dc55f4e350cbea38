"""The four renderings of one diagnostics list: text, JSON, GitHub workflow commands, SARIF 2.1.0."""

from __future__ import annotations

import json

import pytest

from dsforge.diagnostics import Diagnostic, Location, Severity
from dsforge.formatters import NAMES, get

DIAGS = [
    Diagnostic("DSF104", Severity.ERROR, "tp=8 does not divide kv_heads=4", Location("jobs/a.yaml", 14, 7),
               "use tp in {1, 2, 4}", ("parallel", "tp")),
    Diagnostic("DSF204", Severity.WARNING, "bubble 33%, 50% idle: a,b", Location("jobs/a.yaml", 9, 3),
               "raise global_batch", ("parallel", "pp"), {"bubble": 0.33}),
    Diagnostic("DSF107", Severity.INFO, "vocab=250\nis odd", Location("/abs/b.yaml", 2, 1), "",
               ("model", "vocab")),
    Diagnostic("DSF001", Severity.ERROR, "file x.yaml does not exist", Location("x.yaml"), "check the path"),
]


def test_every_name_has_a_formatter_that_handles_an_empty_list() -> None:
    for name in NAMES:
        assert isinstance(get(name)([]), str)
    with pytest.raises(KeyError):
        get("xml")


def test_text_is_compiler_style_with_fix_and_counts() -> None:
    lines = get("text")(DIAGS).splitlines()
    assert lines[0] == "jobs/a.yaml:14:7: error[DSF104] tp=8 does not divide kv_heads=4"
    assert lines[1] == "  fix: use tp in {1, 2, 4}"
    # continuation indented
    assert "/abs/b.yaml:2:1: info[DSF107] vocab=250" in lines and "    is odd" in lines
    # a file-level finding has no line:column
    assert "x.yaml: error[DSF001] file x.yaml does not exist" in lines
    assert lines[-1] == "2 error(s), 1 warning(s), 1 note(s)"


def test_json_round_trips_every_field() -> None:
    doc = json.loads(get("json")(DIAGS))
    assert doc["version"] == 1 and len(doc["diagnostics"]) == 4
    first = doc["diagnostics"][0]
    assert first == {"rule": "DSF104", "severity": "error", "message": "tp=8 does not divide kv_heads=4",
                     "file": "jobs/a.yaml", "line": 14, "column": 7, "path": "parallel.tp",
                     "fix": "use tp in {1, 2, 4}"}
    assert doc["diagnostics"][1]["details"] == {"bubble": 0.33}


def test_github_commands_escape_data_and_properties() -> None:
    lines = get("github")(DIAGS).splitlines()
    assert lines[0] == ("::error file=jobs/a.yaml,line=14,col=7,title=DSF104::tp=8 does not divide "
                        "kv_heads=4 (fix: use tp in {1, 2, 4})")
    # % escaped in data, , and : kept
    assert lines[1].startswith("::warning ") and "50%25 idle: a,b" in lines[1]
    assert lines[2].startswith("::notice file=/abs/b.yaml,") and "vocab=250%0Ais odd" in lines[2]
    assert lines[3] == "::error file=x.yaml,title=DSF001::file x.yaml does not exist (fix: check the path)"


def test_github_properties_escape_commas_and_colons() -> None:
    d = Diagnostic("DSF020", Severity.ERROR, "m", Location("C:/a,b.yaml", 1, 1))
    assert get("github")([d]).startswith("::error file=C%3A/a%2Cb.yaml,line=1,col=1,")


def test_sarif_is_a_valid_2_1_0_log() -> None:
    log = json.loads(get("sarif")(DIAGS))
    assert log["version"] == "2.1.0" and log["$schema"].endswith("sarif-2.1.0.json")
    (run,) = log["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "dsforge" and driver["version"]
    rule_ids = [r["id"] for r in driver["rules"]]
    assert rule_ids == sorted({d.rule for d in DIAGS})
    described = {r["id"]: r for r in driver["rules"]}
    assert described["DSF104"]["shortDescription"]["text"] and described["DSF104"]["helpUri"].endswith(
        "#dsf104"
    )
    levels = [r["level"] for r in run["results"]]
    assert levels == ["error", "warning", "note", "error"]
    first = run["results"][0]
    assert first["ruleId"] == "DSF104" and "fix: use tp" in first["message"]["text"]
    loc = first["locations"][0]["physicalLocation"]
    assert loc == {"artifactLocation": {"uri": "jobs/a.yaml"}, "region": {"startLine": 14, "startColumn": 7}}
    assert run["results"][2]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "file:///abs/b.yaml"
    assert "region" not in run["results"][3]["locations"][0]["physicalLocation"]  # whole-file finding
