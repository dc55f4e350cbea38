"""Golden files pin the emitted job directories of three examples (local, SLURM via extends, Kubernetes).

A failure here means the emitted jobs changed. If the change is intended, regenerate with
`python scripts/update_goldens.py` and review `git diff tests/golden`.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import pytest

from tests.conftest import ROOT


def _updater() -> ModuleType:
    spec = importlib.util.spec_from_file_location("update_goldens", ROOT / "scripts" / "update_goldens.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


UPDATER = _updater()


@pytest.mark.parametrize("example", UPDATER.GOLDEN_EXAMPLES)
def test_emitted_files_match_the_goldens(example: str) -> None:
    golden = UPDATER.GOLDEN_DIR / example
    files = UPDATER.rendered(example)
    assert sorted(files) == sorted(os.listdir(golden)), "run python scripts/update_goldens.py"
    for name, content in files.items():
        expected = (golden / name).read_text(encoding="utf-8")
        assert content == expected, f"{example}/{name} changed; run python scripts/update_goldens.py and review"
