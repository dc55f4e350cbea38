"""What issue 26's checks add to a resume of the 1B-shaped job of benchmarks/build_memory.py.

    python benchmarks/checkpoint_checks.py [--gib 2] [--dir /tmp]

The checks a resume runs before it loads (dsforge.runtime.resume_check, run_lock, preflight):

* the integrity manifest: every file's size (a stat) and XXH3-128 digest (the file read once), each
  rank a share balanced by bytes; measured here as digest seconds per GiB on a file of ``--gib`` GiB
  (BLAKE2b-256, the fallback without xxhash, beside it),
  once cold (its pages dropped from the page cache with posix_fadvise, as after a reboot or on a
  node that did not write it) and once warm (just written, as on the node that saved it);
* the job directory's lock (flock on a file), the free-space check (statvfs) and the build-lock scan
  (two globs): each timed over 1,000 calls.

The checkpoint of the 1B-shaped job comes from the cost model (dsforge.compiler.estimate.checkpoint_size,
the figure explain prints and tests/runtime_e2e/test_machine_faults.py checks against a real
checkpoint), for each of build_memory.py's layouts in bf16 on 2 CPU ranks; the resume time is that
checkpoint's bytes of the busiest rank times the measured seconds per GiB (the ranks digest in parallel).

Measured 2026-12-02 on the 2-core development machine shared with other work (load 2.33 / 4.33 / 5.79):

    xxh3-128     0.36 s/GiB cold, 0.08 s/GiB warm      blake2b-256  1.13 s/GiB cold, 0.94 s/GiB warm
    lock + release 2.3 ms; free-space check 8 us; build-lock scan (no lock present) 21 us

    layout     total GiB  largest file  share GiB  check cold s  check warm s
    tp2            32.23          6.91      16.11           5.8           1.3
    pp2            39.08          9.73      19.54           7.1           1.6
    zero3-dp2      29.92         13.81      14.96           5.4           1.2

An earlier run under load 5.8 / 5.4 / 3.9 gave 0.39 / 0.10 s/GiB for XXH3 and 1.69 / 1.43 for BLAKE2b.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.build_memory import LAYOUTS, MODEL

GIB = 1 << 30


def _plan(layout: dict[str, int]):  # type: ignore[no-untyped-def]
    import yaml

    from dsforge.compiler.frontend.parse import load_job
    from dsforge.compiler.plan.plan import build_plan

    doc = {"version": 1, "name": "bench-1b", "model": dict(MODEL),
           "hardware": {"preset": "cpu-local", "gpus_per_node": 2}, "parallel": dict(layout),
           "training": {"global_batch": 2, "micro_batch": 1, "precision": "bf16",
                                                  "steps": 10, "checkpoint": {"every": 5, "keep": 2}}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(yaml.safe_dump(doc), encoding="utf-8")
        job = load_job(path)[0]
        assert job is not None, "the 1B job does not parse"
        return build_plan(job.spec)


def _digest_rates(folder: Path, gib: float) -> dict[str, tuple[float, float]]:
    """Seconds per GiB of each digest over a file of ``gib`` GiB: algorithm -> (cold, warm)."""
    from dsforge.runtime.checkpoint_manifest import BLAKE2B, XXH3, digest

    path = folder / "dsforge-digest-bench.bin"
    block = os.urandom(64 << 20)
    size = int(gib * GIB) // len(block) * len(block)
    out = {}
    try:
        with open(path, "wb") as fh:
            fh.writelines(block for _ in range(size // len(block)))
            fh.flush()
            os.fsync(fh.fileno())
        for algorithm in (XXH3, BLAKE2B):
            t0 = time.perf_counter()
            digest(path, algorithm)
            warm = (time.perf_counter() - t0) / (size / GIB)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            t0 = time.perf_counter()
            digest(path, algorithm)
            out[algorithm] = ((time.perf_counter() - t0) / (size / GIB), warm)
    finally:
        path.unlink(missing_ok=True)
    return out


def _largest_file(plan) -> float:  # type: ignore[no-untyped-def]
    """The largest single file of one checkpoint: dsforge-state of the first data-parallel rank, or a model
    file."""
    from dsforge.compiler.estimate.shares import layer_kinds, stage_share
    from dsforge.compiler.estimate.zero_config import zero_settings

    z = zero_settings(plan)
    per = [stage_share(plan, s, z.persistence_threshold,
                       layer_kinds(plan, s)).total for s in range(plan.degrees.pp)]
    return max(per) * (4 + z.optimizer_bytes)  # fp32 weights and the optimizer's states, one safetensors file


def _per_call(fn, n: int = 1000) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> int:
    """Measure and print the figures (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="size of the file digested (GiB)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where that file is written")
    args = parser.parse_args()
    from dsforge.commands import preflight
    from dsforge.compiler.estimate.checkpoint_size import checkpoint_size
    from dsforge.runtime import run_lock
    from dsforge.runtime.disk_space import free_bytes

    folder = Path(args.dir)
    rates = _digest_rates(folder, args.gib)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        job = Path(tmp) / "job"

        def lock_once() -> None:
            run_lock.lock_job_dir(job, "bench")
            run_lock.release_all()

        lock_s = _per_call(lock_once)
        space_s = _per_call(lambda: free_bytes(Path(tmp)))
        scan_s = _per_call(lambda: preflight.build_lock_check(Path(tmp)))
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"load: {load} (1, 5, 15 min), {os.cpu_count()} CPUs")
    for algorithm, (cold, warm) in rates.items():
        print(f"{algorithm} over a {args.gib:g} GiB file in {folder}: {cold:.2f} s/GiB cold (page cache "
              f"dropped), {warm:.2f} s/GiB warm")
    print(f"lock + release: {lock_s * 1e6:.0f} us; free-space check: {space_s * 1e6:.0f} us; "
          f"build-lock scan: {scan_s * 1e6:.0f} us (each once per `dsforge run`)")
    cold, warm = rates["xxh3-128"]
    print("\nLlama-3.2-1B shape, bf16, 2 CPU ranks: one checkpoint (cost model) and the xxh3 manifest check "
          "it adds to a resume\n(the busiest rank's share: half "
          "the bytes, or the largest file when that is more)")
    print(f"{'layout':<10} {'total GiB':>9} {'largest file':>12} {'share GiB':>9} {'check cold s':>12} "
          f"{'check warm s':>12}")
    for name, layout in LAYOUTS.items():
        plan = _plan(layout)
        size = checkpoint_size(plan)
        largest = _largest_file(plan)
        share = max(size.total / 2, largest)
        print(f"{name:<10} {size.total / GIB:>9.2f} {largest / GIB:>12.2f} {share / GIB:>9.2f} "
              f"{share / GIB * cold:>12.1f} {share / GIB * warm:>12.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
