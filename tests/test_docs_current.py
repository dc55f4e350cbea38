"""docs/rules.md and docs/job-file.md are generated (`python -m dsforge.docs_gen`) and must be current.

Rules registered by any built-in rule module show up in the generated reference automatically; when
this test fails after adding or changing a rule or a schema field, run the generator and commit.
"""

from __future__ import annotations

import json
from typing import Any

from dsforge import docs_gen
from dsforge.compiler.rules.registry import all_rules
from dsforge.compiler.spec.schema import JobSpec
from dsforge.compiler.spec.spec_types import ListOf, Section
from tests.conftest import ROOT

FIX = "run `python -m dsforge.docs_gen` and commit docs/"


def test_generated_docs_are_current() -> None:
    for path, text in docs_gen.outputs().items():
        assert path.exists(), f"{path.name} is missing: {FIX}"
        assert path.read_text(encoding="utf-8") == text, f"{path.name} is out of date: {FIX}"


def test_check_mode_reports_stale_files(tmp_path, monkeypatch, capsys) -> None:
    assert docs_gen.main(["--check"]) == 0
    stale = tmp_path / "rules.md"
    stale.write_text("old\n", encoding="utf-8")
    monkeypatch.setattr(docs_gen, "RULES_MD", stale)
    monkeypatch.setattr(docs_gen, "ROOT", tmp_path)
    assert docs_gen.main(["--check"]) == 1 and "rules.md is out of date" in capsys.readouterr().out


def test_rules_doc_has_every_id_with_its_rationale() -> None:
    text = docs_gen.render_rules()
    for r in (r for r in all_rules() if r.origin == "dsforge"):
        assert f'<a id="{r.id.lower()}"></a>' in text and f"### {r.id}: {r.summary}" in text
        assert " ".join(r.rationale.split())[:60] in text and r.source in text
    corpus = json.loads((ROOT / "tests" / "fixtures" / "bad" / "expected.json").read_text(encoding="utf-8"))
    reported = {entry[0] for diags in corpus["files"].values() for entry in diags}
    assert all(f"### {rule_id}:" in text for rule_id in reported)  # every id a user can see is documented


def _keys(model: type[Section], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for field in model.model_fields.values():
        key = f"{prefix}{field.key}"
        nested = list(field.kind.sections())
        if nested:
            suffix = "[]" if isinstance(field.kind, ListOf) else ""
            out += _keys(nested[0], f"{key}{suffix}.")
        else:
            out.append((key, field))
    return out


def test_job_file_doc_has_every_key_with_its_description() -> None:
    text = docs_gen.render_job_file()
    keys = _keys(JobSpec)
    assert len(keys) > 60
    for key, field in keys:
        row = next((line for line in text.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, f"{key} is not documented"
        assert field.description and field.description.replace("|", "\\|") in row, key
    assert "`model.preset`:" in text and "- `llama3-8b`:" in text and "- `dgx-h100`:" in text
