"""Predicted against measured step time and peak memory over tiny layouts on this machine's CPU processes.

Each layout is a tiny Llama job on a calibrated hardware file (`dsforge calibrate`, used through
``extends:``), trained for a few steps with `dsforge run`; memory_report.json gives the measured mean
step time (warm-up excluded) and every rank's peak resident size. The cost model's prediction comes from
`estimate_step` and `estimate_memory` of the same job file. Prints one row per layout, the median and max
relative error of the step time and the peak memory, and the Spearman rank correlation of step times.
The machine may be shared: the load average is printed before and after each run, and the predicted /
measured ratio of each layout, whose spread (max/min) says how well the model orders the layouts even when
the load scales every measurement alike.

Usage: python benchmarks/predict_vs_measure.py [--hardware calibrated.yaml] [--steps 8] [--only NAME ...]
       python benchmarks/predict_vs_measure.py --calibrate     (run `dsforge calibrate` first)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsforge.commands.search_verify import spearman
from dsforge.compiler.estimate.memory import estimate_memory
from dsforge.compiler.estimate.steptime import estimate_step
from dsforge.compiler.validate import validate_file

#: name -> (ranks, parallel, training overrides): dp, tp, pp, ZeRO 0-3, recompute, micro-batch sizes
LAYOUTS: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {
    "dp2-zero0": (2, {"dp": 2, "zero": 0}, {}),
    "dp2-zero1": (2, {"dp": 2, "zero": 1}, {}),
    "dp2-zero2": (2, {"dp": 2, "zero": 2}, {}),
    "dp2-zero3": (2, {"dp": 2, "zero": 3}, {}),
    "tp2": (2, {"tp": 2, "dp": 1, "zero": 1}, {}),
    "pp2": (2, {"pp": 2, "dp": 1, "zero": 0, "pipeline": {"schedule": "1f1b", "partition": "uniform"}}, {}),
    "dp2-full-recompute": (2, {"dp": 2, "zero": 1}, {"recompute": "full"}),
    "dp2-micro4": (2, {"dp": 2, "zero": 1}, {"micro_batch": 4, "global_batch": 16}),
    "dp1": (1, {"dp": 1, "zero": 0}, {}),
    "tp2-pp2": (4,
                {"tp": 2, "pp": 2, "dp": 1, "zero": 1,
                 "pipeline": {"schedule": "1f1b", "partition": "uniform"}}, {}),
}


def job_file(directory: Path, name: str, hardware: Path, steps: int) -> Path:
    """Write the job of layout ``name`` on the calibrated hardware; return its path."""
    ranks, parallel, training = LAYOUTS[name]
    job = {"version": 1, "name": f"pvm-{name}", "extends": str(hardware),
           "model": {"preset": "tiny-llama"}, "hardware": {"gpus_per_node": ranks},
           "parallel": parallel,
           "training": {"global_batch": 8, "micro_batch": 1, "precision": "fp32", "steps": steps, "seed": 7,
                        "optimizer": {"name": "adamw", "lr": 1e-3}, **training}}
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False), encoding="utf-8")
    return path


def predict(path: Path) -> tuple[float, float, float]:
    """(step seconds, of which DeepSpeed engine host work, peak bytes of the busiest rank) the cost model
    predicts for a job file."""
    result = validate_file(path)
    if result.plan is None or any(d.severity.name == "ERROR" for d in result.diagnostics):
        raise SystemExit(f"{path}: " + "; ".join(f"{d.rule} {d.message}" for d in result.diagnostics))
    step = estimate_step(result.plan)
    return step.step_s, step.engine_s, estimate_memory(result.plan).peak.device_bytes


def load() -> float:
    """The 1-minute load average of this machine."""
    return os.getloadavg()[0]


def measure(path: Path, out: Path) -> tuple[float, float]:
    """(mean step seconds, largest rank peak bytes) of a real `dsforge run` of the job."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    dsforge = [sys.executable, "-m", "dsforge"]
    proc = subprocess.run([*dsforge, "run", str(path), "-o", str(out), "--fresh"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{path.name}: dsforge run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads((out / "memory_report.json").read_text(encoding="utf-8"))
    peaks = [r["measured"]["peak"] for r in report["ranks"] if "measured" in r]
    return report["step_seconds_median"], max(peaks) if peaks else float("nan")


def main() -> None:
    """Run the layouts and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", type=Path, default=ROOT / "calibrated.yaml")
    parser.add_argument("--calibrate", action="store_true",
                        help="Run `dsforge calibrate` into --hardware first.")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--only", nargs="*", help="Layouts to run (default: all).")
    parser.add_argument("--json", type=Path, help="Also write the rows here.")
    args = parser.parse_args()
    if args.calibrate or not args.hardware.exists():
        subprocess.run([sys.executable, "-m", "dsforge", "calibrate", "-o", str(args.hardware)], check=True,
                       env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    names = args.only or list(LAYOUTS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dsforge-pvm-") as tmp:
        for name in names:
            path = job_file(Path(tmp), name, args.hardware.resolve(), args.steps)
            pred_s, engine_s, pred_b = predict(path)
            start, load_before = time.perf_counter(), load()
            meas_s, meas_b = measure(path, Path(tmp) / f"run-{name}")
            rows.append({"layout": name, "predicted_s": pred_s, "engine_s": engine_s, "measured_s": meas_s,
                         "predicted_bytes": pred_b, "measured_bytes": meas_b,
                         "wall_s": time.perf_counter() - start, "load_before": load_before,
                         "load_after": load()})
            r = rows[-1]
            print(f"{r['layout']:20s} step {pred_s * 1e3:8.1f} ms predicted (engine {engine_s * 1e3:6.1f}) "
                  f"{meas_s * 1e3:8.1f} ms measured ({(pred_s - meas_s) / meas_s:+.0%}, ratio "
                  f"{pred_s / meas_s:.2f}); peak {pred_b / 2**20:7.0f} MiB predicted {meas_b / 2**20:7.0f} "
                  f"MiB measured ({(pred_b - meas_b) / meas_b:+.0%}); load "
                  f"{r['load_before']:.1f} -> {r['load_after']:.1f}",
                  flush=True)
    t_err = [abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows]
    m_err = [abs(r["predicted_bytes"] - r["measured_bytes"]) / r["measured_bytes"] for r in rows]
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    print(f"step time: median error {statistics.median(t_err):.0%}, max {max(t_err):.0%}; "
          f"rank correlation {rho:.2f} over {len(rows)} layouts")
    ratios = [r["predicted_s"] / r["measured_s"] for r in rows]
    print(f"predicted/measured ratio: median {statistics.median(ratios):.2f}, min {min(ratios):.2f}, "
          f"max {max(ratios):.2f} (spread max/min {max(ratios) / min(ratios):.2f})")
    print(f"peak memory: median error {statistics.median(m_err):.0%}, max {max(m_err):.0%}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "rank_correlation": rho}, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
