#!/usr/bin/env python3
"""Regenerate tests/golden/<example>/: the job directories `dsforge compile` emits for the pinned examples.

The files are rendered without the cost model's summary and without the rewrite plan (plan.json's
"summary" and "rewrite" keys), and as if compiled by the interpreter GOLDEN_PYTHON (the launchers run the
compiling interpreter unless `launch.python` says otherwise, so the examples go through that default
with a path that is the same on every machine), so they change only when the emitter, the templates,
the plan or the schema change, and need neither torch nor transformers (tests/commands/test_compile_rewrite.py
covers "rewrite"). Review `git diff tests/golden` after running this: every change there is a change of the
emitted jobs.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsforge.compiler.emit.job_dir import render_job
from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.plan.plan import build_plan

GOLDEN_DIR = ROOT / "tests" / "golden"
#: One example per launcher family worth pinning: local CPU, SLURM through `extends:`, Kubernetes.
GOLDEN_EXAMPLES = ("tiny-3d", "llama3-70b-multinode", "mixtral-8x7b-ep")
#: The compiling interpreter the goldens are rendered as (sys.executable differs between machines).
GOLDEN_PYTHON = "/opt/venv/bin/python"


def rendered(example: str) -> dict[str, str]:
    """The emitted files of one example, by name."""
    job, diags = load_job(ROOT / "examples" / f"{example}.yaml")
    if job is None:
        raise SystemExit(f"{example}: cannot load: {[d.message for d in diags]}")
    return {name: f.content for name, f in render_job(build_plan(job.spec), python=GOLDEN_PYTHON).items()}


def main() -> int:
    """Rewrite every golden directory from the current emitter."""
    for example in GOLDEN_EXAMPLES:
        target = GOLDEN_DIR / example
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for name, content in rendered(example).items():
            (target / name).write_text(content, encoding="utf-8", newline="\n")
        print(f"wrote {target.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
