"""README's zoo block and docs/families.md are what scripts/families_table.py makes of the committed result
file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("families_table", ROOT / "scripts" / "families_table.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_committed_tables_match_the_committed_result_file():
    ft = _script()
    data = ft.load()
    assert (ROOT / "docs" / "families.md").read_text(encoding="utf-8") == ft.document(data)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert ft.readme_with(readme, ft.summary(data)) == readme


def test_the_counts_are_the_rows_and_a_changed_row_changes_the_table():
    ft = _script()
    data = ft.load()
    c = ft.counts(data["rows"])
    assert sum(c.values()) == len(data["rows"])
    first = dict(data["rows"][0])
    flipped = {**data, "rows": [{**first, "result": "crash" if first["result"] != "crash" else "exact"}]
               + data["rows"][1:]}
    assert ft.summary(flipped) != ft.summary(data)
    assert ft.document(flipped) != ft.document(data)
