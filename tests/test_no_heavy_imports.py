"""`dsforge validate` (and the whole compiler) never imports torch, DeepSpeed, matplotlib or pydantic.

CI jobs that validate job files install dsforge without torch; an accidental `import torch` in the
front end would break them and add seconds to every run. Each check runs in a fresh interpreter,
because this test session itself may already have imported torch for other tests.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import EXAMPLES, ROOT

HEAVY = ("torch", "deepspeed", "matplotlib", "transformers", "accelerate", "pydantic")


def _fresh(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_validating_every_example_imports_nothing_heavy() -> None:
    code = f"""
import json, sys
from dsforge.cli import cli
codes = []
for path in {[str(p) for p in EXAMPLES]!r}:
    try:
        cli.main(["validate", "--format", "json", path], standalone_mode=False)
    except SystemExit as exc:
        codes.append(exc.code)
print(json.dumps({{"codes": codes, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    result = _fresh(code)
    assert result["codes"] == [0] * len(EXAMPLES)
    assert result["heavy"] == [], f"validate imported {result['heavy']}"


def test_no_compiler_module_imports_anything_heavy() -> None:
    code = f"""
import importlib, json, pkgutil, sys
import dsforge.commands, dsforge.compiler, dsforge.formatters
names = ["dsforge.cli", "dsforge.docs_gen", "dsforge.diagnostics"]
for pkg in (dsforge.commands, dsforge.compiler, dsforge.formatters):
    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
for name in names:
    importlib.import_module(name)
print(json.dumps({{"modules": len(names), "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    result = _fresh(code)
    assert result["modules"] > 20
    assert result["heavy"] == [], f"importing the compiler pulled in {result['heavy']}"
