"""Golden files pin the emitted job directories of three examples (local, SLURM via extends, Kubernetes).

A failure here means the emitted jobs changed. If the change is intended, regenerate with
`python scripts/update_goldens.py` and review `git diff tests/golden`.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import ROOT, load_script

UPDATER = load_script(ROOT / "scripts" / "update_goldens.py", "update_goldens")


@pytest.mark.parametrize("example", UPDATER.GOLDEN_EXAMPLES)
def test_emitted_files_match_the_goldens(example: str) -> None:
    golden = UPDATER.GOLDEN_DIR / example
    files = UPDATER.rendered(example)
    assert sorted(files) == sorted(os.listdir(golden)), "run python scripts/update_goldens.py"
    for name, content in files.items():
        expected = (golden / name).read_text(encoding="utf-8")
        assert content == expected, (f"{example}/{name} changed; run python "
                                     f"scripts/update_goldens.py and review")
