"""Model-state memory per rank: DeepSpeed's own estimators, dsforge's estimate and a real engine, side by side.

For the tiny GPT of tests/dist/tiny_gpt.py (2 layers, hidden 64, 136,960 parameters) on 2 CPU ranks
(gloo), for ZeRO 0-3 in fp32 and bf16, prints:

* DeepSpeed's `estimate_zero2_model_states_mem_needs_all_live` (used for stages 1 and 2; it models
  stage 2) and `estimate_zero3_model_states_mem_needs_all_live` (stage 3), the "per GPU" figure of
  their offload-free row (DeepSpeed prints its table; the number is taken from the same function
  it calls). They assume 16-bit weights and ignore buckets and the fp32 step buffers; there is no
  stage-0 estimator;
* dsforge's estimate (`model_states`, the larger of its backward and update moments);
* the measured peak: the largest sum of distinct tensor storages of the engine over the snapshots
  of tests/dist/measure_memory.py (one launcher run, ~40-80 s on 2 cores).

    python benchmarks/estimate_accuracy.py [--measured measured.json]

With ``--published`` it prints the published-run set instead (benchmarks/published_runs.py): how many of the
runs in benchmarks/published/ validate accepts, the median |TFLOP/s error|, the worst off-nominal error and
whether each scaling series comes out in the published order.
"""  # noqa: E501

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "dist"))



def job_yaml(zero: int, precision: str) -> str:
    """The measured job's text, from the measurement script (one source for both)."""
    from measure_memory import job_yaml as text

    return str(text(zero, precision))


def measure(out: Path) -> dict[str, Any]:
    """Run the measurement script on 2 CPU ranks and load its JSON."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29617",
           str(ROOT / "tests" / "dist" / "measure_memory.py"), str(out)]
    subprocess.run(cmd, env=env, cwd=out.parent, check=True, capture_output=True)
    return json.loads(out.read_text())


def dsforge_estimate(zero: int, precision: str) -> float:
    """dsforge's model-state peak for the tiny GPT on 2 ranks."""
    from dsforge.compiler.estimate.model_states import model_states
    from dsforge.compiler.estimate.shares import stage_share
    from dsforge.compiler.estimate.zero_config import zero_settings
    from dsforge.compiler.frontend.parse import load_job
    from dsforge.compiler.plan.plan import build_plan

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(job_yaml(zero, precision))
        job, _ = load_job(path)
    assert job is not None
    plan = build_plan(job.spec)
    z = zero_settings(plan)
    return model_states(stage_share(plan, 0, z.persistence_threshold), z, 2, 1, 2).peak


def deepspeed_estimates() -> dict[int, float]:
    """Per-GPU bytes from DeepSpeed's estimators (no offload, 1 node x 2 GPUs), by ZeRO stage."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.stage3 import (
        estimate_zero3_model_states_mem_needs,
        estimate_zero3_model_states_mem_needs_all_live,
        model_to_params,
    )
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
        estimate_zero2_model_states_mem_needs_all_live,
    )
    from tiny_gpt import GPTConfig, TinyGPT

    model = TinyGPT(GPTConfig())
    table = io.StringIO()
    with contextlib.redirect_stdout(table):  # the _all_live functions print their table
        estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=2, num_nodes=1)
        estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2, num_nodes=1)
    total, largest = model_to_params(model)
    _, z2 = estimate_zero2_model_states_mem_needs(total, 2, 1, cpu_offload=False)
    _, z3, _ = estimate_zero3_model_states_mem_needs(total, largest, 2, 1, cpu_offload=False,
                                                     cpu_offload_params=False)
    return {1: float(z2), 2: float(z2), 3: float(z3)}


def measured_peak(snaps: dict[str, dict[str, int]]) -> float:
    """The largest engine total over the snapshots (module buffers excluded)."""
    return max(sum(v for k, v in c.items() if k != "module_buffers") for c in snaps.values())


def main() -> int:
    """Print the side-by-side table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", type=Path, help="reuse a JSON written by tests/dist/measure_memory.py")
    parser.add_argument("--published", action="store_true",
                        help="instead: the published-run set of benchmarks/published/ "
                             "(accepted, TFLOP/s error, trends)")
    args = parser.parse_args()
    if args.published:
        from published_runs import main as published_main

        return published_main()
    if args.measured:
        data = json.loads(args.measured.read_text())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            data = measure(Path(tmp) / "measured.json")
    ds = deepspeed_estimates()
    print("model-state bytes per rank, tiny GPT (136,960 "
          "parameters), 2 ranks, AdamW, 2 micro-batches per step")
    print(f"{'config':12s} {'DeepSpeed est.':>15s} {'dsforge est.':>13s} {'measured':>10s} "
          f"{'DS err':>8s} {'dsforge err':>12s}")
    for precision in ("fp32", "bf16"):
        for zero in range(4):
            got = measured_peak(data["states"][f"zero{zero}-{precision}"])
            ours = dsforge_estimate(zero, precision)
            theirs = ds.get(zero)
            ds_text = f"{theirs:15,.0f}" if theirs else f"{'n/a':>15s}"
            ds_err = f"{theirs / got - 1:+8.1%}" if theirs else f"{'':>8s}"
            print(f"zero{zero}-{precision:6s} {ds_text} {ours:13,.0f} "
                  f"{got:10,.0f} {ds_err} {ours / got - 1:+12.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
