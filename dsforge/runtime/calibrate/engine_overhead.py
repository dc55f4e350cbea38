"""The DeepSpeed engine's own host work for the calibration: engine micro-batches timed against the bare
module."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ENGINE_LAYERS = (2, 8)
ENGINE_MICRO_BATCHES = 4


def _engine_job(directory: Path, zero: int, layers: int) -> Path:
    """A one-rank tiny-Llama job at ZeRO ``zero`` with ``layers`` layers, fp32 on the CPU."""
    import yaml

    job = {"version": 1, "name": f"calibrate-z{zero}-l{layers}",
           "model": {"preset": "tiny-llama", "layers": layers},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 1}, "parallel": {"dp": 1, "zero": zero},
           "training": {"global_batch": ENGINE_MICRO_BATCHES, "micro_batch": 1, "precision": "fp32",
                        "optimizer": {"name": "adamw", "lr": 1e-4}}}
    path = directory / f"z{zero}-l{layers}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False), encoding="utf-8")
    return path


def _engine_worker(rank: int, init: str, out: str, repeats: int) -> None:
    """Time engine micro-batches against the bare module for every ZeRO stage and depth; write JSON rows."""
    import contextlib
    import io
    import json

    import torch.distributed as dist

    from dsforge.compiler.emit.ds_config import build_ds_config
    from dsforge.compiler.estimate.engine_overhead import rank_tensors
    from dsforge.compiler.validate import validate_file
    from dsforge.runtime.engine import CausalLMLoss, build_engine, build_parallel_model
    from dsforge.runtime.groups import create_groups, ensure_deepspeed_comm

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # deepspeed.initialize reads the launcher's variables; this process is a world of its own
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    ensure_deepspeed_comm()
    rows = []
    folder = Path(out).parent
    for zero in range(4):
        for layers in ENGINE_LAYERS:
            checked = validate_file(_engine_job(folder, zero, layers)).plan
            assert checked is not None  # a fixed, valid job
            plan = checked.resolve()
            groups = create_groups(plan)
            with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's start-up chatter
                engine = build_engine(plan, build_ds_config(plan), groups, seed=1)
                bare = CausalLMLoss(build_parallel_model(plan, groups, 1), 1)
            seq = plan.model.seq_len
            ids = torch.randint(0, plan.model.vocab, (1, seq))
            pos = torch.arange(seq).unsqueeze(0)
            inner: list[list[float]] = [[] for _ in range(ENGINE_MICRO_BATCHES)]
            raw: list[float] = []
            for rep in range(repeats + 1):  # the first step warms up (optimizer states, buffers)
                for i in range(ENGINE_MICRO_BATCHES):
                    t0 = time.perf_counter()
                    bare(ids, ids, pos).backward()
                    t1 = time.perf_counter()
                    loss = engine(ids, ids, pos)
                    engine.backward(loss)
                    engine.step()
                    t2 = time.perf_counter()
                    if rep:
                        raw.append(t1 - t0)
                        inner[i].append(t2 - t1)
                bare.zero_grad(set_to_none=True)
            rows.append({"zero": zero, "layers": layers, "tensors": rank_tensors(plan, 0),
                         "bare_s": statistics.median(raw),
                         "micro_batch_s": statistics.median(t for ts in inner[:-1] for t in ts),
                         "last_micro_batch_s": statistics.median(inner[-1])})
            del engine, bare
    Path(out).write_text(json.dumps(rows), encoding="utf-8")
    dist.destroy_process_group()


def engine_rows(repeats: int = 5) -> list[dict[str, Any]]:
    """Run `_engine_worker` in a one-rank process group of its own (DeepSpeed keeps global state)."""
    import json

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "engine.json")
        mp.spawn(_engine_worker, args=(f"file://{tmp}/store", out, repeats), nprocs=1, join=True)
        rows: list[dict[str, Any]] = json.loads(Path(out).read_text(encoding="utf-8"))
    return rows
