"""Peak host memory while a rank builds its shard of a ~1B Llama, beside the shard's size (issue 12, item 1).

    DS_ACCELERATOR=cpu python benchmarks/build_memory.py [--precision bf16|fp32] [--layouts tp2,pp2,zero3-dp2]

For each layout, 2 CPU ranks (gloo) build the job's model the way `dsforge run` does
(dsforge.runtime.engine.build_parallel_model / build_pipeline_module: meta-device skeleton, the
rewrite, then only this rank's slices drawn from the seed) and report, per rank: resident memory
before the build (torch, transformers and DeepSpeed imported, the process group up: the fixed
framework reserve), the peak during the build (VmHWM), the growth, the shard's parameter bytes and
the growth / shard ratio. The model is Llama-3.2-1B's shape (16 layers, hidden 2048, 32 heads, 8 KV
heads, ffn 8192, vocabulary 128256, tied embeddings): 1.24B parameters. Under ZeRO-3 the shard is the
rank's partitions: each parameter is partitioned over dp as soon as it is filled (dsforge.runtime.rank_build).
The bound column is issue 12's target: RSS before + 1.3 x (shard + Adam's state for it, 12 bytes a
parameter in bf16: fp32 master and two moments).

Measured 2026-12-01 on the 2-core development machine (bf16, GiB; growth = peak - RSS before):

    layout     rank  shard params  shard  before  peak  growth  growth/shard  bound
    tp2           0   617,940,992   1.15    0.25  1.53    1.29          1.12  10.72
    tp2           1   617,940,992   1.15    0.25  1.53    1.29          1.12  10.72
    pp2           0   627,597,312   1.17    0.25  1.55    1.30          1.12  10.88
    pp2           1   870,885,376   1.62    0.25  2.00    1.76          1.08  15.01
    zero3-dp2     0   617,907,200   1.15    0.25  1.74    1.50          1.30  10.72
    zero3-dp2     1   617,907,200   1.15    0.25  1.61    1.36          1.18  10.72

Every rank is far inside the bound. ZeRO-3's growth is its partitions plus 0.2-0.35 GiB: the one
parameter being filled whole (the largest, the 0.49 GiB embedding, is filled first, while nothing else
is held), and heap that glibc keeps after each whole parameter is freed (the figure varies by rank and
run: 1.32 GiB on both ranks in an earlier run). Before, a ZeRO-3 rank at tp 1 built the whole model
(2.31 GiB of bf16 parameters, by count) and kept it until deepspeed.initialize partitioned it. The seeded
chunks are drawn into one reused fp32 buffer: a fresh 16 MB tensor per chunk left a tp2 rank with
1.96-2.33 GiB of growth (1.7-2.0 x its shard) in glibc's fragmented heap.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = {"arch": "llama", "layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "ffn_hidden": 8192,
         "vocab": 128256, "seq_len": 2048, "tied_embeddings": True}
LAYOUTS = {"tp2": {"tp": 2, "pp": 1, "dp": 1}, "pp2": {"tp": 1, "pp": 2, "dp": 1},
           "zero3-dp2": {"tp": 1, "pp": 1, "dp": 2, "zero": 3}}
# Adam's state per trained parameter beside the parameter itself: fp32 master weights (16-bit jobs) and
# the two fp32 moments, partitioned like the parameters here (dp 1, or ZeRO-3's dp partitions).
OPTIMIZER_BYTES = {"bf16": 12, "fp32": 8}
BOUND = 1.3  # issue 12's target: peak <= 1.3 x (shard + optimizer state) + the framework reserve


def _status(field: str) -> int:
    """A VmRSS/VmHWM line of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _rank(rank: int, world: int, port: int, layout: str, precision: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import faulthandler

    # Where a rank hangs, say so; never exit from here (a kill inside a JIT op build leaves its lock file
    # behind).
    faulthandler.dump_traceback_later(float(os.environ.get("BUILD_MEMORY_TIMEOUT_S", "900")), exit=False)
    import deepspeed  # noqa: F401  (all of DeepSpeed imported before the reserve is read: ZeRO-3 builds use zero.Init)
    import torch
    import torch.distributed as dist
    import yaml

    from dsforge.compiler.emit.ds_config import build_ds_config
    from dsforge.compiler.frontend.parse import load_job
    from dsforge.compiler.plan.plan import build_plan
    from dsforge.runtime.engine import build_parallel_model, build_pipeline_module
    from dsforge.runtime.groups import create_groups, ensure_deepspeed_comm
    from dsforge.runtime.teardown import before_init, leave

    torch.set_num_threads(1)
    before_init()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    doc = {"version": 1, "name": f"build-{layout}", "model": MODEL, "parallel": LAYOUTS[layout],
           "hardware": {"preset": "cpu-local", "gpus_per_node": world},
           "training": {"global_batch": 2, "micro_batch": 1, "precision": precision}}
    path = Path(out).with_suffix(f".{layout}.{rank}.yaml")
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    job, diags = load_job(path)
    assert job is not None, [d.message for d in diags]
    plan = build_plan(job.spec)
    groups = create_groups(plan)
    ensure_deepspeed_comm()
    dist.barrier()
    before = _status("VmRSS")
    _reset_peak()
    ds_config = build_ds_config(plan)
    # ds_config given: a ZeRO-3 build partitions each parameter as it is filled, as `dsforge run` does
    module = (build_pipeline_module(plan, groups, ds_config) if plan.degrees.pp > 1
              else build_parallel_model(plan, groups, ds_config=ds_config))
    peak = _status("VmHWM")
    seen: set[int] = set()
    shard = 0
    params = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            held = p.ds_tensor if hasattr(p, "ds_tensor") else p  # a ZeRO-3 parameter: its partition
            shard += held.numel() * held.element_size()
            params += held.numel()
    optimizer = params * OPTIMIZER_BYTES[precision]
    bound = before + BOUND * (shard + optimizer)
    row = {"layout": layout, "rank": rank, "precision": precision, "shard_params": params,
           "shard_bytes": shard, "rss_before": before, "peak": peak, "growth": peak - before,
           "growth_over_shard": (peak - before) / shard, "optimizer_bytes": optimizer, "bound": bound,
           "within": peak <= bound}
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(out, "a", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    del module
    leave(synchronize=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    """Build each layout on 2 ranks and print the table."""
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--layouts", default="tp2,pp2,zero3-dp2")
    args = parser.parse_args()
    gib = 2**30
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.jsonl")
        for layout in args.layouts.split(","):
            mp.spawn(_rank, args=(2, _port(), layout, args.precision, out), nprocs=2, join=True)
        rows = [json.loads(line) for line in Path(out).read_text().splitlines()]
    print(f"Llama-3.2-1B shape (1.24B parameters), {args.precision}, "
          f"2 CPU ranks: host RSS while building the shard")
    print(f"{'layout':<10}{'rank':>5}{'shard params':>15}{'shard GiB':>11}{'RSS before':>12}{'peak':>9}"
          f"{'growth':>9}{'growth/shard':>14}{'bound':>9}")
    for r in rows:
        print(f"{r['layout']:<10}{r['rank']:>5}{r['shard_params']:>15,}{r['shard_bytes'] / gib:>11.2f}"
              f"{r['rss_before'] / gib:>12.2f}{r['peak'] / gib:>9.2f}{r['growth'] / gib:>9.2f}"
              f"{r['growth_over_shard']:>14.2f}{r['bound'] / gib:>9.2f}{'' if r['within'] else '  OVER'}")
    print(f"bound: RSS before + {BOUND} x (shard + Adam state: {OPTIMIZER_BYTES[args.precision]} bytes per "
          f"shard parameter); shard: this rank's parameters (ZeRO-3: its partitions)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
