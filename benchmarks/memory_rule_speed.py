"""How long does `dsforge validate` take when the memory rule (DSF301) fires and prices its fixes?

The job is examples/llama3-70b-multinode.yaml on accelerators of 24 GB instead of 80 GB, so the busiest
rank does not fit, no single change is enough, and DSF301 searches its single fixes and then their
combination. Prints the best and median milliseconds (wall and CPU: the CPU time is what a busy
machine inflates less) of one in-process `validate_file` over --runs runs (after one warm-up run, so
preset loading and imports are not counted), how many memory estimates one validate computes, and the
DSF301 fix text; asserts nothing.

    python benchmarks/memory_rule_speed.py [--runs 40] [--batch-error]

--batch-error also breaks the batch split (global_batch 129), an error unrelated to memory: the fix
text should stay the same (issue 10: pre-existing errors do not disqualify a memory fix).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "llama3-70b-multinode.yaml"

OVERRIDE = """\
version: 1
extends: {base}
hardware: {{accelerator: {{name: H100-24GB, memory_gb: 24, bf16_tflops: 989, hbm_gbs: 3350}}}}
{batch}"""


def forced_job(folder: Path, batch_error: bool) -> Path:
    """A copy of the example (its `extends` base alongside) with a memory error forced."""
    shutil.copytree(ROOT / "examples" / "common", folder / "common")
    shutil.copy(EXAMPLE, folder / EXAMPLE.name)
    path = folder / "forced.yaml"
    batch = "training: {global_batch: 129}\n" if batch_error else ""
    path.write_text(OVERRIDE.format(base=EXAMPLE.name, batch=batch), encoding="utf-8")
    return path


def count_estimates(path: Path) -> tuple[int, int]:
    """(memory estimates one validate computes, how many of them are of the job's own plan)."""
    from dsforge.compiler.estimate import memory, memory_fixes
    from dsforge.compiler.rules import memory as memory_rule
    from dsforge.compiler.validate import validate_file

    seen: list[object] = []
    real = memory.estimate_memory

    def counting(plan: object) -> object:
        seen.append(plan)
        return real(plan)  # type: ignore[arg-type]

    memory_rule.estimate_memory = memory_fixes.estimate_memory = counting  # type: ignore[assignment]
    try:
        plan = validate_file(path).plan
    finally:
        memory_rule.estimate_memory = memory_fixes.estimate_memory = real
    return len(seen), sum(p is plan for p in seen)


def main() -> int:
    """Time validate on the forced job and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="timed validate runs (best and median printed)")
    parser.add_argument("--batch-error", action="store_true", help="also break the batch split")
    args = parser.parse_args()

    from dsforge.compiler.validate import validate_file

    with tempfile.TemporaryDirectory() as tmp:
        path = forced_job(Path(tmp), args.batch_error)
        result = validate_file(path)  # warm-up: presets, rule modules, imports
        walls, cpus = [], []
        for _ in range(args.runs):
            wall, cpu = time.perf_counter(), time.process_time()
            validate_file(path)
            cpus.append(time.process_time() - cpu)
            walls.append(time.perf_counter() - wall)
        estimates, of_job = count_estimates(path)
    walls.sort()
    cpus.sort()
    rules = sorted({d.rule for d in result.diagnostics})
    print(f"validate {EXAMPLE.name} on 24 GB{', global_batch 129' if args.batch_error else ''} "
          f"({args.runs} runs): wall best {walls[0] * 1e3:.1f} ms, median {walls[len(walls) // 2] * 1e3:.1f} "
          f"ms; CPU best {cpus[0] * 1e3:.1f} ms, median {cpus[len(cpus) // 2] * 1e3:.1f} ms; "
          f"{estimates} memory estimates, {of_job} of the job itself; rules fired: {', '.join(rules)}")
    for d in result.diagnostics:
        if d.rule == "DSF301":
            print(f"DSF301 fix: {d.fix}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
