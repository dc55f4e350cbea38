"""Every shipped example validates clean (no errors and no warnings)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsforge.compiler.validate import validate_file
from dsforge.diagnostics import Severity
from tests.conftest import EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates_clean(path: Path) -> None:
    result = validate_file(path)
    bad = [d for d in result.diagnostics if d.severity in (Severity.ERROR, Severity.WARNING)]
    assert not bad, "\n".join(f"{d.location} {d.rule} {d.message}" for d in bad)
