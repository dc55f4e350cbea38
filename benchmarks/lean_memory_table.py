"""Activations + logits per GPU of every shipped example at its written layout, under stack dsforge and
megatron-te.

    python benchmarks/lean_memory_table.py            # this checkout
    PYTHONPATH=<other checkout> python benchmarks/lean_memory_table.py   # e.g. main before the lean kernels

Each job is explained as written (`dsforge explain --format json`) and again with `stack: megatron-te`
(a job that extends it); the figures are the peak stage's activations and logits, in MB (1e6 bytes).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def examples() -> list[Path]:
    """The shipped example jobs (not the shared bases under examples/common)."""
    return sorted(p for p in (ROOT / "examples").rglob("*.yaml") if "common" not in p.parts)


def peak(job: Path, cwd: str) -> tuple[float, float] | None:
    """(activations, logits) bytes of the stage whose sum is largest, or None when explain refuses the job
    (run from ``cwd``, so that PYTHONPATH, not this directory, says which dsforge runs)."""
    run = subprocess.run([sys.executable, "-m", "dsforge", "explain", "--format", "json", str(job)],
                         capture_output=True, text=True, check=False, cwd=cwd)
    if run.returncode != 0:
        return None
    stages = json.loads(run.stdout)["memory"]["stages"]
    best = max(stages, key=lambda s: s["components"]["activations"] + s["components"]["logits"])
    return best["components"]["activations"], best["components"]["logits"]


def main() -> None:
    print("| example | dsforge act | dsforge logits | dsforge sum | megatron-te act | megatron-te logits | "
          "megatron-te sum |")
    print("|---|---|---|---|---|---|---|")
    for job in examples():
        with tempfile.TemporaryDirectory() as tmp:
            other = Path(tmp) / "megatron.yaml"
            other.write_text(f"extends: {job}\nstack: megatron-te\n")
            ours, theirs = peak(job, tmp), peak(other, tmp)
        cells = []
        for got in (ours, theirs):
            cells += ["-"] * 3 if got is None else [f"{got[0] / 1e6:,.3f}", f"{got[1] / 1e6:,.3f}",
                                                    f"{(got[0] + got[1]) / 1e6:,.3f}"]
        print(f"| {job.relative_to(ROOT)} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
