"""The published-run acceptance set (benchmarks/published/): which runs validate accepts, and how far the
step-time estimate's TFLOP/s per GPU lie from the published figures.

Each job file names its source, stack and what was filled in; `index.yaml` holds each run's published TFLOP/s
per GPU, what it counts (hardware FLOPs with the recomputed forward, or model FLOPs) and its scaling series.
A run is *accepted* when `dsforge validate` reports no error. The TFLOP/s error is (predicted - published) /
published over the accepted runs with a figure; the *off-nominal* runs are those the accelerators'
gemm_efficiency was not fitted on (`FITTED_ON`: Narayanan et al.'s ten weak-scaling runs on A100, the three
Llama 3 405B rows on H100).
A scaling series is in the right order when the predicted TFLOP/s rank its runs as the published ones do.

    python benchmarks/estimate_accuracy.py --published
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = ROOT / "benchmarks" / "published"
#: the runs the accelerators' gemm_efficiency was fitted on (dsforge/presets/hardware/nvidia_dgx.yaml)
FITTED_ON = tuple(f"narayanan21-gpt-{size}.yaml" for size in
                  ("1.7b", "3.6b", "7.5b", "18b", "39b", "76b", "146b", "310b", "530b", "1t")) + (
    "llama3-405b-8k-8192gpu.yaml", "llama3-405b-8k-16384gpu.yaml", "llama3-405b-128k-16384gpu.yaml")


@dataclass
class RunResult:
    """One published run: its errors (rule ids), and published and predicted TFLOP/s per GPU where known."""

    file: str
    stack: str
    errors: list[str]
    published: float | None
    predicted: float | None
    series: str | None

    @property
    def accepted(self) -> bool:
        """True when validate reports no error."""
        return not self.errors

    @property
    def error(self) -> float | None:
        """(predicted - published) / published, where both exist."""
        if self.published is None or self.predicted is None:
            return None
        return (self.predicted - self.published) / self.published


def index() -> list[dict[str, Any]]:
    """The entries of benchmarks/published/index.yaml."""
    return list(yaml.safe_load((PUBLISHED / "index.yaml").read_text(encoding="utf-8"))["runs"])


def evaluate(entry: dict[str, Any]) -> RunResult:
    """Validate one run and, when accepted, estimate its step (TFLOP/s as the source counts them)."""
    from dsforge.compiler.estimate.steptime import estimate_step
    from dsforge.compiler.validate import validate_file

    result = validate_file(PUBLISHED / entry["file"])
    errors = sorted({d.rule for d in result.diagnostics if d.severity.name == "ERROR"})
    predicted = None
    if not errors and entry.get("tflops_per_gpu"):
        step = estimate_step(result.plan)
        hardware = "hardware" in str(entry.get("counted") or "")
        flops = step.hardware_flops if hardware else step.model_flops
        predicted = flops / step.step_s / step.gpus / 1e12
    return RunResult(entry["file"], entry["stack"], errors, entry.get("tflops_per_gpu"), predicted,
                     entry.get("series"))


def _spearman_order(published: list[float], predicted: list[float]) -> bool:
    """True when the predicted values order the runs as the published ones do (ties in the published keep
    any)."""
    pairs = sorted(zip(published, predicted))
    return all(b[1] >= a[1] for a, b in pairwise(pairs) if b[0] > a[0])


def report(results: list[RunResult]) -> str:
    """The table: per run, then accepted, median |error|, worst off-nominal error and the scaling series."""
    lines = [f"{'run':44} {'stack':19} {'published':>9} {'predicted':>9} {'error':>7}  refused by"]
    for r in results:
        pub = f"{r.published:9.1f}" if r.published else f"{'-':>9}"
        pred = f"{r.predicted:9.1f}" if r.predicted else f"{'-':>9}"
        err = f"{100 * r.error:+6.1f}%" if r.error is not None else f"{'-':>7}"
        lines.append(f"{r.file[:-5]:44} {r.stack:19} {pub} {pred} {err}  {' '.join(r.errors)}")
    accepted = sum(r.accepted for r in results)
    errs = [r.error for r in results if r.error is not None]
    off = [abs(r.error) for r in results if r.error is not None and r.file not in FITTED_ON]
    lines += ["", f"accepted: {accepted} of {len(results)} ({100 * accepted / len(results):.0f} %)"]
    if errs:
        lines.append(f"median |TFLOP/s error|: {100 * statistics.median(abs(e) for e in errs):.1f} % over "
                     f"{len(errs)} runs with a published figure; worst off-nominal: {100 * max(off):.1f} %")
        lines.append(f"median |TFLOP/s error| off-nominal (not fitted on): "
                     f"{100 * statistics.median(off):.1f} % over {len(off)} runs")
    series: dict[str, list[RunResult]] = {}
    for r in results:
        if r.series:
            series.setdefault(r.series, []).append(r)
    right = 0
    for name, members in sorted(series.items()):
        known = [m for m in members if m.published is not None and m.predicted is not None]
        ok = len(known) == len(members) and _spearman_order([m.published or 0.0 for m in known],
                                                            [m.predicted or 0.0 for m in known])
        right += ok
        shown = ", ".join(
            f"{m.published:g}->{m.predicted:.0f}" if m.predicted else f"{m.published:g}->refused"
            for m in members
        )
        lines.append(f"  series {name}: {'right order' if ok else 'WRONG ORDER or refused'} ({shown})")
    lines.append(f"scaling trends in the right order: {right} of {len(series)}")
    return "\n".join(lines)


def main() -> int:
    """Print the table of the published set."""
    sys.path.insert(0, str(ROOT))
    print(report([evaluate(e) for e in index()]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
