"""Wall time of a full layout search with every search field `auto`, on one core, for four published scales.

Prints, per case, the CPU seconds of one `dsforge.compiler.search.engine.search` call in this process (the
figure "on one core" means: wall time on a shared machine counts other processes' time too) and its wall time,
how many candidates the space holds, how many were estimated in full and how many the bounds pruned, and the
winner. `--exhaustive` also times the search without pruning (slow on the largest).
Run: `OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python benchmarks/search_speed.py`.

Measured 2026-12-01 21:10 UTC at commit 3d21d05, `--only` one case at a time under `taskset -c 0`, on the
2-core VM shared with other jobs (`uptime` load average 3.9-4.7, so wall is about 2x CPU): Llama 3 405B on
16,384 H100 0.72 s CPU (1.58 s wall), 68,328 candidates, 12 estimated in full, 2,102 pruned by bounds; GPT-3
175B on 1,024 A100 0.49 s CPU (1.09 s wall), 88,626 candidates, 5 estimated, 224 pruned; Mixtral 8x7B on 64
H100 0.76 s CPU (1.56 s wall), 114,738 candidates, 5 estimated, 7,365 pruned; Llama 3 8B on 8 H100 0.47 s
CPU (0.99 s wall), 5,610 candidates, 5 estimated, 756 pruned (at load 3.4 a few minutes earlier: 0.53, 0.36,
0.63, 0.37 s CPU). The same cases at 44463d7, just before (same machine, load 2-4): 31.2, 65.5, 17.4 and
2.19 s CPU, with 30, 5, 143 and 232 estimated; both return the same top 5 and top 20 (layout, value and peak
memory, compared in full).

What made the difference (dsforge/compiler/search): the checks that declare the layout fields they read
(`Rule.reads`) are asked once per degree combination or memory group, before any bound, so DSF140, DSF106,
DSF142, DSF502 remove whole classes that used to pay a memory estimate, a pass floor and the rules each; the
pass floor prices the estimate's own passes with the pipeline transfers and rank 0's step tail (within 2 %
of the step for 405B's candidates, exactly the step at pp 1); under ZeRO-2/3 a per-micro-batch floor of the
data-parallel collectives prunes the pp-1 ZeRO-3 layouts whose gathers take minutes. What is left is spread
thin: building and grouping the candidates (69,000-115,000 `Layout`s), the memory staircase of the groups
that can still rank, and the estimates of those that rank (405B: 12 pipeline simulations).
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from dsforge.compiler.frontend.extends import deep_merge
from dsforge.compiler.frontend.parse import LoadedJob, load_job

ALL_AUTO = {"parallel": {"tp": "auto", "pp": "auto", "dp": "auto", "cp": "auto", "ep": "auto", "zero": "auto",
                         "sequence_parallel": "auto", "context_parallel": {"kind": "auto"},
                         "pipeline": {"schedule": "auto", "virtual_stages": "auto"}},
            "training": {"micro_batch": "auto", "recompute": "auto"}}

CASES = {
    "Llama 3 405B on 16,384 H100": {"model": {"preset": "llama3-405b"},
                                    "hardware": {"preset": "dgx-h100", "nodes": 2048},
                                    "training": {"global_batch": 2048}},
    "GPT-3 175B on 1,024 A100": {"model": {"preset": "gpt3-175b"},
                                 "hardware": {"preset": "dgx-a100-80gb", "nodes": 128},
                                 "training": {"global_batch": 1536}},
    "Mixtral 8x7B on 64 H100": {"model": {"preset": "mixtral-8x7b", "seq_len": 4096},
                                "hardware": {"preset": "dgx-h100", "nodes": 8},
                                "training": {"global_batch": 256}},
    "Llama 3 8B on 8 H100": {"model": {"preset": "llama3-8b"}, "hardware": {"preset": "dgx-h100", "nodes": 1},
                             "training": {"global_batch": 64}},
}


def job_of(body: dict, where: Path) -> LoadedJob:
    """A job with every search field `auto` over ``body`` (model, hardware, batch), written and loaded as a
    file; a multi-node case launches with slurm (the default `local` launcher is single-machine: DSF609 would
    refuse every candidate, and the search would estimate them all to say so)."""
    raw = deep_merge({"version": 1, "name": "bench", "training": {"precision": "bf16"}},
                     deep_merge(ALL_AUTO, body))
    if raw["hardware"].get("nodes", 1) > 1:
        raw["launch"] = {"launcher": "slurm"}
    path = where / "bench.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    job, diags = load_job(path)
    if job is None:
        raise SystemExit(f"bench job does not parse: {diags}")
    return job


def run_case(name: str, exhaustive: bool) -> str:
    """One case, timed in this process: its line of the report."""
    from dsforge.compiler.search.engine import search

    with tempfile.TemporaryDirectory() as tmp:
        job = job_of(CASES[name], Path(tmp))
    t0, c0 = time.perf_counter(), time.process_time()
    r = search(job)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    f, w = r.funnel, r.winner
    line = (f"{name}: {cpu:.2f} s CPU ({wall:.2f} s wall), {f.considered:,} candidates, {f.estimated:,} "
            f"estimated in full, {f.pruned:,} pruned by bounds; winner {w.layout.label() if w else 'none'}"
            + (f", {w.step.step_s:.2f} s/step, MFU {w.step.mfu:.1%}" if w else "")
            + ("; a bound failed its check, so it was searched without pruning" if r.exhaustive else ""))
    if exhaustive:
        t0 = time.perf_counter()
        e = search(job, exhaustive=True)
        same = [x.layout for x in e.ranked[: len(r.ranked)]] == [x.layout for x in r.ranked]
        line += f"; exhaustive {time.perf_counter() - t0:.2f} s, same top {len(r.ranked)}: {same}"
    return line


def _child(name: str, exhaustive: bool, budget: float, conn: Any) -> None:
    if budget > 0:  # the kernel stops the case at its CPU budget (SIGXCPU), whatever the machine's load
        resource.setrlimit(resource.RLIMIT_CPU, (int(budget), int(budget) + 5))
    conn.send(run_case(name, exhaustive))


def main() -> None:
    """Time every case, each in its own process under an optional CPU budget, and print one line each."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--exhaustive", action="store_true", help="also time the search without pruning")
    ap.add_argument("--only", help="run only the cases whose name contains this")
    ap.add_argument("--budget", type=float, default=0.0, help="CPU seconds a case may take (0: no limit)")
    ap.add_argument("--parallel", action="store_true", help="run the cases at once (one process each)")
    args = ap.parse_args()
    names = [n for n in CASES if not args.only or args.only in n]
    ctx = multiprocessing.get_context("fork")
    procs = []
    for name in names:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(name, args.exhaustive, args.budget, send))
        proc.start()
        send.close()  # the child holds the write end: its death reads as EOF here
        procs.append((name, proc, recv))
        if not args.parallel:
            proc.join()
    for name, proc, recv in procs:
        try:
            line = recv.recv()
        except EOFError:  # stopped at its CPU budget
            line = f"{name}: did not finish within {args.budget:.0f} s CPU"
        proc.join()
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
