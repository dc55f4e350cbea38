"""One registry for every stage: every id the code can report is registered, documented and in its stage's
range."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from dsforge.compiler.rules import registry
from dsforge.compiler.rules.registry import STAGES, Rule, all_rules, checks, get_rule, report_id, stage_of
from dsforge.diagnostics import Diagnostic, Location, Severity
from dsforge.docs_gen import render_rules
from dsforge.formatters import get
from tests.conftest import ROOT

ID = re.compile(r"\bDSF\d{3}\b")
RANGE = re.compile(r"\bDSF\d{3}\s*-\s*DSF\d{3}\b")  # "DSF510-DSF519" names a range, not an id


def _ids(text: str) -> set[str]:
    return set(ID.findall(RANGE.sub("", text)))


def _ids_in_code() -> dict[str, list[str]]:
    """Every DSFnnn literal in dsforge's own source (rules, loader, emitter, runtime), with the files."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "dsforge").rglob("*.py")):
        for rule_id in _ids(path.read_text(encoding="utf-8")):
            found.setdefault(rule_id, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_id_the_code_can_report_is_registered_and_documented() -> None:
    registered = {r.id for r in all_rules()}
    unknown = {rid: files for rid, files in _ids_in_code().items() if rid not in registered}
    assert not unknown, f"ids written in the code but not registered (rules/registry.py report_id): {unknown}"
    doc = render_rules()
    for r in all_rules():
        if r.origin == "dsforge":
            assert f"### {r.id}: {r.summary}" in doc and r.rationale, r.id


def test_ids_in_the_docs_are_registered() -> None:
    text = (ROOT / "docs" / "rules.md").read_text(encoding="utf-8") + (ROOT / "README.md").read_text(
        encoding="utf-8"
    )
    registered = {r.id for r in all_rules()}
    assert _ids(text) <= registered


def test_every_id_lies_in_exactly_one_stage_range() -> None:
    spans = sorted((s.first, s.last) for s in STAGES)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(spans)), "stage ranges overlap"
    for r in all_rules():
        holders = [s.name for s in STAGES if s.holds(r.id)]
        assert len(holders) == 1, (r.id, holders)
        assert r.stage is not None and r.stage.name == holders[0]
    assert stage_of("DSF301").name == "memory" and stage_of("DSF609").name == "emit"
    assert stage_of("DSF800") is None and stage_of("FIX001") is None


def test_phases_split_the_checks() -> None:
    validate_ids = {r.id for r in checks("validate")}
    compile_ids = {r.id for r in checks("compile")}
    assert {"DSF601", "DSF602", "DSF603", "DSF604", "DSF605", "DSF606", "DSF608", "DSF609"} <= validate_ids
    assert compile_ids == {"DSF144", "DSF600", "DSF607"}  # DSF144 reads the meta-built model's attention
    reported = {r.id for r in all_rules() if r.check is None}
    assert {"DSF001", "DSF020", "DSF026", "DSF027", "DSF690", "DSF691", "DSF699", "DSF900"} <= reported
    assert all(r.phase == "reported" for r in all_rules() if r.check is None)
    assert get_rule("DSF001").exit_code == 2 and get_rule("DSF020").exit_code == 1
    assert get_rule("DSF999") is None


def test_a_registered_id_cannot_be_taken_again_or_malformed() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        report_id("DSF001", "again", "why", "test")
    with pytest.raises(ValueError, match="three digits"):
        registry.register(Rule("dsf12", Severity.ERROR, "bad", "test"))
    with pytest.raises(ValueError, match="phase"):
        registry.register(Rule("ZZZ001", Severity.ERROR, "bad", "test", phase="later"))
    assert get_rule("ZZZ001") is None


def test_plugin_rule_loader_rolls_back_what_a_failing_import_registered() -> None:
    before = registry.snapshot()

    def half_registers() -> None:
        registry.rule("ZZZ002", "half", source="test")(lambda ctx: ())
        raise RuntimeError("boom")

    entry = registry.extensions.PluginEntry("rules", "x", "x:y", "dist", "1.0", "/nowhere")
    with pytest.raises(RuntimeError, match="boom"):
        registry._load_plugin_rules(entry, lambda: half_registers)
    assert registry.snapshot() == before


@pytest.mark.parametrize("rule_id", ["DSF605", "DSF027", "DSF609", "DSF001", "DSF699"])
def test_sarif_describes_every_rule_it_reports(rule_id: str) -> None:
    diag = Diagnostic(rule_id, Severity.ERROR, "m", Location("job.yaml", 3, 1), "f")
    (descriptor,) = json.loads(get("sarif")([diag]))["runs"][0]["tool"]["driver"]["rules"]
    rule = get_rule(rule_id)
    assert descriptor["shortDescription"]["text"] == rule.summary
    assert descriptor["fullDescription"]["text"] == " ".join(rule.rationale.split())
    assert descriptor["helpUri"].endswith(f"#{rule_id.lower()}")


def test_rules_doc_sections_follow_the_stage_ranges() -> None:
    doc = (ROOT / "docs" / "rules.md").read_text(encoding="utf-8")
    for stage in STAGES:
        if any(stage.holds(r.id) for r in all_rules() if r.origin == "dsforge"):
            assert f"(DSF{stage.first:03d}-DSF{stage.last:03d})" in doc, stage.name
    assert Path(ROOT / "dsforge" / "compiler" / "input_rules.py").exists() is False
