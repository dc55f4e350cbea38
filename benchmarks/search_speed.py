"""Wall time of a full layout search with every search field `auto`, on one core, for four published scales.

Prints, per case, the CPU seconds of one `dsforge.compiler.search.engine.search` call in this process (the
figure "on one core" means: wall time on a shared machine counts other processes' time too) and its wall time,
how many candidates the space holds, how many were estimated in full and how many the bounds pruned, and the
winner. `--exhaustive` also times the search without pruning (slow on the largest).
Run: `OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python benchmarks/search_speed.py`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import yaml

from dsforge.compiler.extends import deep_merge
from dsforge.compiler.parse import LoadedJob, load_job

ALL_AUTO = {"parallel": {"tp": "auto", "pp": "auto", "dp": "auto", "cp": "auto", "ep": "auto", "zero": "auto",
                         "sequence_parallel": "auto", "context_parallel": {"kind": "auto"},
                         "pipeline": {"schedule": "auto", "virtual_stages": "auto"}},
            "training": {"micro_batch": "auto", "recompute": "auto"}}

CASES = {
    "Llama 3 405B on 16,384 H100": {"model": {"preset": "llama3-405b"}, "hardware": {"preset": "dgx-h100", "nodes": 2048},
                                    "training": {"global_batch": 2048}},
    "GPT-3 175B on 1,024 A100": {"model": {"preset": "gpt3-175b"}, "hardware": {"preset": "dgx-a100-80gb", "nodes": 128},
                                 "training": {"global_batch": 1536}},
    "Mixtral 8x7B on 64 H100": {"model": {"preset": "mixtral-8x7b", "seq_len": 4096},
                                "hardware": {"preset": "dgx-h100", "nodes": 8}, "training": {"global_batch": 256}},
    "Llama 3 8B on 8 H100": {"model": {"preset": "llama3-8b"}, "hardware": {"preset": "dgx-h100", "nodes": 1},
                             "training": {"global_batch": 64}},
}


def job_of(body: dict, where: Path) -> LoadedJob:
    """A job with every search field `auto` over ``body`` (model, hardware, batch), written and loaded as a file."""
    raw = deep_merge({"version": 1, "name": "bench", "training": {"precision": "bf16"}}, deep_merge(ALL_AUTO, body))
    path = where / "bench.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    job, diags = load_job(path)
    if job is None:
        raise SystemExit(f"bench job does not parse: {diags}")
    return job


def main() -> None:
    """Time every case and print one line each."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--exhaustive", action="store_true", help="also time the search without pruning")
    ap.add_argument("--only", help="run only the cases whose name contains this")
    args = ap.parse_args()
    from dsforge.compiler.search.engine import search

    for name, body in CASES.items():
        if args.only and args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            job = job_of(body, Path(tmp))
        t0, c0 = time.perf_counter(), time.process_time()
        r = search(job)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        f = r.funnel
        w = r.winner
        line = (f"{name}: {cpu:.2f} s CPU ({wall:.2f} s wall), {f.considered:,} candidates, {f.estimated:,} estimated in full, "
                f"{f.pruned:,} pruned by bounds; winner {w.layout.label() if w else 'none'}"
                + (f", {w.step.step_s:.2f} s/step, MFU {w.step.mfu:.1%}" if w else ""))
        if args.exhaustive:
            t0 = time.perf_counter()
            e = search(job, exhaustive=True)
            same = [x.layout for x in e.ranked[: len(r.ranked)]] == [x.layout for x in r.ranked]
            line += f"; exhaustive {time.perf_counter() - t0:.2f} s, same top {len(r.ranked)}: {same}"
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
