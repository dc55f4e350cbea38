"""The fits and the timer of the calibration: median seconds of a call, the ring all-reduce model, the
engine's terms."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_seconds(fn: Callable[[], Any], repeats: int, inner: int = 1) -> float:
    """Median wall seconds of ``inner`` calls of ``fn`` over ``repeats`` timed runs (one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def fit_ring(rows: list[tuple[int, float]], n: int) -> tuple[float, float]:
    """(alpha, beta) of t = 2(n-1)·alpha + 2(n-1)/n·bytes/beta fitted to (bytes, seconds) all-reduce rows by
    least squares; alpha is clipped at 0 and a non-positive slope (noise) gives an unbounded beta."""
    xs = [2 * (n - 1) / n * s for s, _ in rows]  # bytes on the wire
    ys = [sec for _, sec in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = max(0.0, my - slope * mx)
    return intercept / (2 * (n - 1)), 1.0 / slope if slope > 0 else 1e13


def fit_engine(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The `hardware.engine_overhead` terms (us, per ZeRO stage) solved from `engine_overhead.engine_rows`.

    Per stage, a micro-batch costs ``micro + T x tensor_micro`` over the bare module and the step's last
    one ``step + T x tensor_step`` more; a line through the two depths gives each pair, its slope clipped
    at 0 (the constant then the mean), its constant clipped at 0."""
    def line(points: list[tuple[float, float]]) -> tuple[float, float]:
        (t0, y0), (t1, y1) = points[0], points[-1]
        slope = (y1 - y0) / (t1 - t0) if t1 != t0 else 0.0
        if slope < 0:
            return max(0.0, statistics.fmean(y for _, y in points)), 0.0
        return max(0.0, y0 - slope * t0), slope

    out: dict[str, list[float]] = {k: [] for k in ("step_us", "micro_batch_us", "tensor_step_us",
                                                   "tensor_micro_batch_us")}
    for zero in range(4):
        mine = sorted((r for r in rows if r["zero"] == zero), key=lambda r: r["tensors"])
        micro = line([(r["tensors"], r["micro_batch_s"] - r["bare_s"]) for r in mine])
        step = line([(r["tensors"], r["last_micro_batch_s"] - r["micro_batch_s"]) for r in mine])
        out["micro_batch_us"].append(round(micro[0] * 1e6, 2))
        out["tensor_micro_batch_us"].append(round(micro[1] * 1e6, 3))
        out["step_us"].append(round(step[0] * 1e6, 2))
        out["tensor_step_us"].append(round(step[1] * 1e6, 3))
    return out
