"""`dsforge search` winner of every shipped example (its `auto` fields, or `--compare` for a job without any).

    python benchmarks/lean_search_winners.py
    PYTHONPATH=<other checkout> python benchmarks/lean_search_winners.py   # e.g. main before the lean kernels

Prints one row per example: the winning layout (tp/pp/dp/cp, ZeRO, SP, micro-batch, recompute), its estimated
tokens/s and peak memory. Runs from a scratch directory so that PYTHONPATH, not this one, says which dsforge
runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def winner(job: Path, cwd: str) -> str:
    """One table row's cells for the search winner of ``job`` (or why there is none)."""
    args = [sys.executable, "-m", "dsforge", "search", "--top", "1", "--format", "json", str(job)]
    run = subprocess.run(args, capture_output=True, text=True, check=False, cwd=cwd)
    if run.returncode == 0 and "nothing to search" in run.stdout + run.stderr:
        run = subprocess.run(args[:4] + ["--compare"] + args[4:], capture_output=True, text=True, check=False,
                             cwd=cwd)
    try:
        ranked = json.loads(run.stdout)["ranked"]
    except (json.JSONDecodeError, KeyError):
        return "no result | - | -"
    if not ranked:
        return "nothing fits | - | -"
    best = ranked[0]
    lay = best["layout"]
    text = (f"tp{lay['tp']} pp{lay['pp']} dp{lay['dp']} cp{lay['cp']} ep{lay['ep']} z{lay['zero']}"
            f"{' sp' if lay['sequence_parallel'] else ''} mb{lay['micro_batch']} {lay['recompute']}")
    return f"{text} | {best['tokens_per_s']:,.0f} | {best['peak_bytes'] / 1e9:.2f} GB"


def main() -> None:
    print("| example | winner | tokens/s | peak |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for job in sorted(p for p in (ROOT / "examples").rglob("*.yaml") if "common" not in p.parts):
            print(f"| {job.relative_to(ROOT)} | {winner(job, tmp)} |", flush=True)


if __name__ == "__main__":
    main()
