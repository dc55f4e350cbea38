#!/usr/bin/env python3
"""Step time of a dsforge-run tiny job against a hand-written DeepSpeed script with the same ds_config.

Both drive the same tiny GPT-2 (same seed) on the same ranks (2 CPU processes, gloo, data parallel 2,
ZeRO-1) with the ds_config dsforge compiles for the job: dsforge through its runtime (rewritten model,
CausalLMLoss, its data pipeline, progress and loss all-reduce), the hand-written script through
``deepspeed.initialize`` and an ``engine(input_ids, labels)`` loop. Blocks of steps alternate
(dsforge, hand, dsforge, hand, ...) in the same processes so machine noise hits both alike; the
median and best block of each one's time per step, wall clock and rank 0's CPU time (both less sensitive
to other processes on a shared machine than a single block), are printed with their ratio (target <= 1.05).

A third loop runs dsforge with every lean kernel off (``training.kernels`` all false: HF's modules and the
unfused loss), so the lean kernels' own cost or gain shows as the ratio lean / unfused.

Run: ``python benchmarks/runtime_overhead.py [--steps 12] [--blocks 3] [--preset tiny-llama]`` (needs the
runtime extra).
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

JOB = """version: 1
name: overhead
model: {preset: PRESET}
hardware: {preset: cpu-local, gpus_per_node: 2}
parallel: {dp: auto, zero: 1}
training:
  global_batch: 8
  micro_batch: 2
  precision: fp32
  steps: 1000
  optimizer: {name: adamw, lr: 1.0e-3}
  scheduler: {name: constant}
"""
PLAIN = "  kernels: {fused_loss: false, swiglu: false, gelu: false, norm: false}\n"


def _plan(tmp: str, preset: str = "tiny-gpt2", plain: bool = False):  # type: ignore[no-untyped-def]
    from dsforge.compiler.frontend.parse import load_job
    from dsforge.compiler.plan.plan import build_plan

    path = Path(tmp) / f"overhead{'-plain' if plain else ''}.yaml"
    path.write_text(JOB.replace("PRESET", preset) + (PLAIN if plain else ""), encoding="utf-8")
    job, diags = load_job(path)
    if job is None:
        raise SystemExit(f"benchmark job does not parse: {[d.message for d in diags]}")
    return build_plan(job.spec)


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def dsforge_block(engine, plan, groups, steps: int, start: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(wall, CPU) seconds per step over a block of dsforge's own loop (progress into a buffer, as off a
    terminal)."""
    from dsforge.runtime.data import batches_for
    from dsforge.runtime.train_loop import Progress, train

    progress = Progress(10**9, start, 1, groups.rank == 0, stream=io.StringIO())
    batches = batches_for(plan, groups)
    w, c = _clock()
    train(engine, batches, groups, steps=start + steps, start=start, progress=progress)
    w2, c2 = _clock()
    return (w2 - w) / steps, (c2 - c) / steps


def hand_block(engine, plan, steps: int, start: int, rank: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(wall, CPU) seconds per step over a block of a plain DeepSpeed loop over random token batches."""
    import torch

    t, m = plan.spec.training, plan.spec.model
    w, c = _clock()
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        for _ in range(plan.grad_accum):
            ids = torch.randint(0, m.vocab, (t.micro_batch, m.seq_len), generator=g)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
    w2, c2 = _clock()
    return (w2 - w) / steps, (c2 - c) / steps


def worker(rank: int, world: int, port: int, steps: int, blocks: int, tmp: str, preset: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    import deepspeed

    from dsforge.compiler.emit.ds_config import build_ds_config
    from dsforge.runtime.engine import build_engine
    from dsforge.runtime.groups import create_groups, ensure_deepspeed_comm
    from dsforge.runtime.main import quiet
    from dsforge.runtime.models import build_model

    deepspeed.utils.logger.setLevel("WARNING")
    plan = _plan(tmp, preset)
    plain_plan = _plan(tmp, preset, plain=True)
    config = {**build_ds_config(plan), "steps_per_print": 10**9}
    with quiet():
        ensure_deepspeed_comm()
        groups = create_groups(plan)
        lean = build_engine(plan, config, groups)
        unfused = build_engine(plain_plan, config, groups)
        model = build_model(plan.spec.model, "cpu", 1, seed=plan.spec.training.seed)
        hand, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    warm = 3
    dsforge_block(lean, plan, groups, warm, 0)
    dsforge_block(unfused, plain_plan, groups, warm, 0)
    hand_block(hand, plan, warm, 0, rank)
    ours: list[tuple[float, float]] = []
    plain: list[tuple[float, float]] = []
    theirs: list[tuple[float, float]] = []
    for b in range(blocks):
        first = warm + b * steps
        ours.append(dsforge_block(lean, plan, groups, steps, first))
        plain.append(dsforge_block(unfused, plain_plan, groups, steps, first))
        theirs.append(hand_block(hand, plan, steps, first, rank))
    if rank == 0:
        print(f"{preset}, dp=2 ZeRO-1, {plan.grad_accum} micro-batches of {plan.spec.training.micro_batch} x "
              f"{plan.spec.model.seq_len} tokens per rank per step; {blocks} alternating blocks of {steps} "
              f"steps each; load average before: {os.getloadavg()[0]:.2f}")
        for i, what in ((0, "wall"), (1, "CPU (rank 0)")):
            for stat, fn in (("median", statistics.median), ("best", min)):
                a, u, h = fn(x[i] for x in ours), fn(x[i] for x in plain), fn(x[i] for x in theirs)
                print(f"{what:>12} {stat:>6}: dsforge {a * 1000:7.2f} ms/step, hand-written DeepSpeed "
                      f"{h * 1000:7.2f} ms/step, ratio {a / h:.3f} (target <= 1.05); dsforge unfused "
                      f"{u * 1000:7.2f} ms/step, lean / unfused {a / u:.3f}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="steps per block")
    ap.add_argument("--blocks", type=int, default=12, help="alternating blocks of each loop")
    ap.add_argument("--preset", default="tiny-gpt2", help="the model preset (tiny-llama: SwiGLU and RMSNorm)")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, port, args.steps, args.blocks, tmp, args.preset), nprocs=2, join=True)


if __name__ == "__main__":
    main()
