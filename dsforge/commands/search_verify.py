"""`dsforge search --verify K`: run the top K candidates (and the last-ranked) for the job's steps with
`dsforge run` on this machine, and set the measured step time and peak memory beside the cost model's, with
the rank correlation of the step times. Each run is a subprocess, so the search itself never imports torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dsforge.compiler.frontend.parse import LoadedJob
from dsforge.compiler.search.engine import Evaluated, SearchResult
from dsforge.compiler.search.write import rewrite_text
from dsforge.explain.units import gb, seconds, table

#: Seconds one verification run may take before it is stopped (tiny jobs take ~10-30 s on two cores).
RUN_TIMEOUT_S = 600


@dataclass(frozen=True)
class Verified:
    """One candidate run: its rank, the prediction, and what the run measured (None where it failed)."""

    rank: int
    candidate: Evaluated
    step_s: float | None
    peak_bytes: float | None
    error: str | None = None


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank); 0 for fewer than two pairs or no spread."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return out

    if len(xs) < 2:
        return 0.0
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx > 0 and vy > 0 else 0.0


def chosen(result: SearchResult, k: int) -> list[tuple[int, Evaluated]]:
    """The top k and the last-ranked candidate, with their ranks (an exhaustive search lists every fitting
    one)."""
    every = result.fitting or result.ranked
    picks = list(enumerate(every[:k], start=1))
    if len(every) > k:
        picks.append((len(every), every[-1]))
    return picks


def run_one(job: LoadedJob, rank: int, cand: Evaluated, work: Path) -> Verified:
    """Write the candidate's job file beside the original (so `extends:` and relative paths still resolve),
    run it with `dsforge run` into ``work``, read its memory_report.json."""
    source = Path(job.source.file)
    path = source.parent / f".{source.stem}.verify-{rank}-{os.getpid()}.yaml"
    out = work / f"rank-{rank}"
    try:
        path.write_text(rewrite_text(source.read_text(encoding="utf-8"), job, cand.layout), encoding="utf-8")
        proc = subprocess.run([sys.executable, "-m", "dsforge", "run", str(path), "-o", str(out), "--fresh"],
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
        report = out / "memory_report.json"
        if proc.returncode != 0 or not report.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return Verified(rank, cand, None, None, f"dsforge run exited {proc.returncode}: {tail[0]}")
        doc = json.loads(report.read_text(encoding="utf-8"))
        peak = max(r["measured"]["peak"] for r in doc["ranks"])
        return Verified(rank, cand, float(doc["step_seconds_median"]), float(peak))
    except subprocess.TimeoutExpired:
        return Verified(rank, cand, None, None, f"dsforge run took more than {RUN_TIMEOUT_S} s")
    finally:
        path.unlink(missing_ok=True)


def verify(job: LoadedJob, result: SearchResult, k: int, work: Path | None = None) -> list[Verified]:
    """Run the top k candidates and the last-ranked one (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="dsforge-verify-") as tmp:
        where = work or Path(tmp)
        return [run_one(job, rank, cand, where) for rank, cand in chosen(result, k)]


def render(rows: list[Verified]) -> str:
    """Predicted beside measured, and the rank correlation of the step times."""
    body = []
    for v in rows:
        c = v.candidate
        body.append([str(v.rank), c.layout.label(), seconds(c.step.step_s),
                     seconds(v.step_s) if v.step_s is not None else "failed", gb(c.memory.peak.device_bytes),
                     gb(v.peak_bytes) if v.peak_bytes is not None else "-"])
    ok = [v for v in rows if v.step_s is not None]
    rho = spearman([v.candidate.step.step_s for v in ok], [v.step_s for v in ok if v.step_s is not None])
    lines = ["verify: predicted against measured (dsforge run on this machine)",
             table(["rank", "layout", "step predicted", "step measured", "peak predicted", "peak measured"],
                   body, right=(0, 2, 3, 4, 5)),
             f"rank correlation of step times (Spearman, {len(ok)} runs): {rho:.2f}"]
    lines += [f"rank {v.rank}: {v.error}" for v in rows if v.error]
    return "\n".join(lines) + "\n"
