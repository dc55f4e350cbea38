"""How fast is `dsforge validate` next to DeepSpeed's own config parser? Prints figures; asserts nothing.

1. Cold start: wall time of a fresh `dsforge validate examples/llama3-8b-dgx-h100.yaml` process, best of
   --runs (the console script, exactly as a CI job runs it), dsforge's bytecode compiled first as an install
   would have it.
2. DeepSpeed: wall time of a fresh process that imports DeepSpeed and builds
   `deepspeed.runtime.config.DeepSpeedConfig` from the ds_config dsforge emits for the same job, best of
   --runs. Without a process group DeepSpeed checks the batch identity against world size 1
   (research doc, headline 1), so `train_batch_size` is left out and DeepSpeed derives it from the
   micro-batch and accumulation steps; every other key is parsed as emitted.
3. Their ratio (target: dsforge >= 10x faster).
4. Throughput: validating --files distinct job files (variants of every example, the 1,024-rank
   GPT-3 layout included) in one process, timed after start-up (target < 2 s for 1,000).

    python benchmarks/validate_speed.py [--runs 7] [--files 1000] [--skip-deepspeed]
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "llama3-8b-dgx-h100.yaml"

DS_CHILD = """
import json, sys
from deepspeed.runtime.config import DeepSpeedConfig
cfg = DeepSpeedConfig(json.load(open(sys.argv[1])))
print(cfg.train_batch_size, cfg.gradient_accumulation_steps, cfg.zero_optimization_stage)
"""

BULK_CHILD = """
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
from dsforge.compiler.validate import validate_file
t1 = time.perf_counter()
files = sorted(Path(sys.argv[1]).glob("*.yaml"))
errors = sum(any(d.severity.value == "error" for d in validate_file(f).diagnostics) for f in files)
t2 = time.perf_counter()
print(json.dumps({"files": len(files), "with_errors": errors, "import_s": t1 - t0, "loop_s": t2 - t1}))
"""


def best_wall(cmd: list[str], runs: int,
              env: dict[str, str] | None = None) -> tuple[float, float, float, str]:
    """Best and median wall time of ``runs`` fresh processes, their best CPU time (user + system, which
    a machine busy with other work inflates less than wall time), and the last one's output."""
    walls, cpus, out = [], [], ""
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        if proc.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        out = proc.stdout
    walls.sort()
    return walls[0], walls[len(walls) // 2], min(cpus), out


def dsforge_command() -> list[str]:
    """The `dsforge` console script of this interpreter's environment (what CI runs)."""
    script = Path(sys.executable).with_name("dsforge")
    return [str(script)] if script.exists() else [sys.executable, "-m", "dsforge"]


def emitted_ds_config(path: Path) -> Path:
    """Write the ds_config dsforge emits for the example, minus train_batch_size (see the module
    docstring)."""
    from dsforge.compiler.emit.ds_config import build_ds_config
    from dsforge.compiler.frontend.parse import load_job
    from dsforge.compiler.plan.plan import build_plan

    job, diags = load_job(EXAMPLE)
    assert job is not None, diags
    cfg = build_ds_config(build_plan(job.spec))
    cfg.pop("train_batch_size", None)
    path.write_text(json.dumps(cfg), encoding="utf-8")
    return path


def write_variants(folder: Path, count: int) -> None:
    """``count`` distinct job files: every example in turn, each under a new name (bases copied alongside)."""
    shutil.copytree(ROOT / "examples" / "common", folder / "common")
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    for i in range(count):
        src = examples[i % len(examples)]
        text = re.sub(r"^name: .*$", f"name: {src.stem}-v{i}", src.read_text(encoding="utf-8"),
                      flags=re.MULTILINE)
        (folder / f"{i:05d}-{src.name}").write_text(text, encoding="utf-8")


def main() -> int:
    """Measure and print the four figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="fresh processes per cold "
                                                            "measurement (best is kept)")
    parser.add_argument("--files", type=int, default=1000, help="job files for the throughput measurement")
    parser.add_argument("--skip-deepspeed", action="store_true", help="do not measure DeepSpeed")
    args = parser.parse_args()

    # pip byte-compiles an installed package (DeepSpeed's bytecode was written when it was installed); an
    # editable checkout under PYTHONDONTWRITEBYTECODE would otherwise recompile dsforge in every process.
    compileall.compile_dir(str(ROOT / "dsforge"), quiet=1)
    cold, cold_median, cold_cpu, _ = best_wall([*dsforge_command(), "validate", str(EXAMPLE)], args.runs)
    print(f"dsforge validate {EXAMPLE.relative_to(ROOT)} (fresh process): best {cold:.3f} s, "
          f"median {cold_median:.3f} s, best CPU {cold_cpu:.3f} s over {args.runs} runs")

    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_deepspeed:
            cfg = emitted_ds_config(Path(tmp) / "ds_config.json")
            env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
            ds, ds_median, ds_cpu, out = best_wall([sys.executable, "-c", DS_CHILD, str(cfg)], args.runs, env)
            print(f"DeepSpeedConfig of the emitted ds_config, import included (fresh process): best {ds:.3f} "
                  f"s, median {ds_median:.3f} s, best CPU {ds_cpu:.3f} s  [tbs, gas, zero = {out.strip()}]")
            print(f"ratio: dsforge is {ds / cold:.1f}x faster (best wall), {ds_median / cold_median:.1f}x "
                  f"(median wall), {ds_cpu / cold_cpu:.1f}x (best CPU)  (target >= 10x: "
                  f"{'met' if ds / cold >= 10 else 'NOT met'} on best wall)")
        folder = Path(tmp) / "jobs"
        folder.mkdir()
        write_variants(folder, args.files)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", BULK_CHILD, str(folder)], capture_output=True, text=True,
                              check=True)
        total = time.perf_counter() - start
        bulk = json.loads(proc.stdout)
        print(f"validate {bulk['files']} job files in one process: {bulk['loop_s']:.3f} s "
              f"({1000 * bulk['loop_s'] / bulk['files']:.2f} ms/file; import {bulk['import_s']:.3f} s; "
              f"process {total:.3f} s; files with errors: {bulk['with_errors']})  "
              f"(target < 2 s for 1,000: "
              f"{'met' if bulk['loop_s'] * 1000 / bulk['files'] < 2 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
