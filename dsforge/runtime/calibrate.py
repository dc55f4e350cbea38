"""`dsforge calibrate`: measure this machine's GEMM, memory and collective rates into a hardware file.

What is measured, and how each figure enters the cost model (dsforge/compiler/estimate/compute.py, comm.py):

* GEMM rate by size and precision: square matmuls of n = 32 ... 1024 (median of repeats); the best rate
  is the accelerator's peak for that precision (``fp32_tflops``/``bf16_tflops``) and ``gemm_efficiency`` is
  1, so the roofline and the per-operation cost, both measured too, must explain the smaller sizes (the
  file lists the measured rate of every size beside the model's prediction for it);
* memory bandwidth: a copy of a 64 MiB tensor (read + write) is ``hbm_gbs`` with ``memory_efficiency`` 1;
* per-operation cost: the forward and backward time one more layer of dsforge's tiny HF Llama adds, over
  the 211 aten operations it dispatches: ``op_overhead_us`` (on a GPU: a bare autograd op chain's);
* collectives over the real backend (gloo on CPU, NCCL on GPU) with ``ranks`` processes on this node:
  all-reduce by message size, fitted to the ring model 2(n-1)·alpha + 2(n-1)/n·bytes/beta by least squares:
  ``intra_node.latency_us`` = alpha and ``bandwidth_gbs`` = beta (``bus_efficiency`` 1: beta is already what
  the backend achieves). One node only: ``inter_node`` is written equal to ``intra_node`` and says so;
* the DeepSpeed engine's own host work (``engine_overhead``, priced by estimate/engine_overhead.py): on
  one CPU process, a real engine of dsforge's tiny Llama at 2 and 8 layers (T = 21 and 75 parameter
  tensors) per ZeRO stage 0-3, four micro-batches per step, each ``engine(...)``, ``backward``, ``step``
  timed on its own, beside the same module's forward and backward without an engine (timed in between,
  so the machine's load drifts out of the difference). A micro-batch that is not the step's last costs
  ``micro_batch_us + T x tensor_micro_batch_us`` over the bare module; the last one adds
  ``step_us + T x tensor_step_us``; the two depths solve for the constant and the per-tensor term (a
  negative term, noise, is set to 0 and the constant refitted as the mean). GPUs: not measured (the host
  work runs beside the kernels there), the section is left out.

The output is a job-file fragment (`hardware:` only) that a job uses through ``extends:``.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

GEMM_SIZES = (32, 64, 128, 256, 512, 1024)
MESSAGE_BYTES = tuple(2 ** k for k in range(10, 23, 2))  # 1 KiB ... 4 MiB


def _median_seconds(fn: Callable[[], Any], repeats: int, inner: int = 1) -> float:
    """Median wall seconds of ``inner`` calls of ``fn`` over ``repeats`` timed runs (one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def gemm_rates(dtype: torch.dtype, device: str, sizes: tuple[int, ...] = GEMM_SIZES) -> dict[int, float]:
    """FLOP/s of an n x n x n matmul for each n (2n^3 FLOPs per call)."""
    rates = {}
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        inner = max(1, int(2e7 // n ** 3))
        seconds = _median_seconds(lambda a=a, b=b: torch.matmul(a, b), 5, inner)
        rates[n] = 2.0 * n ** 3 / seconds
    return rates


def memory_bandwidth(device: str, size_bytes: int = 64 << 20) -> float:
    """Bytes per second of a tensor copy (bytes read plus bytes written)."""
    src = torch.empty(size_bytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), 7)
    return 2.0 * size_bytes / seconds


def op_overhead(device: str, ops: int = 200) -> float:
    """Seconds per dispatched operation: a chain of tiny elementwise ops, forward and backward."""
    x = torch.ones(4, 4, device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()

    # forward ops (multiplications and the sum) plus their backward ops, as a profile counts them
    return _median_seconds(chain, 5) / (2 * ops + 2)


def layer_op_overhead(ops_per_layer: int = 73 + 138) -> float:
    """Seconds per operation of dsforge's own HF layer: the forward and backward time one more layer of the
    tiny Llama adds (4 layers against 2, hidden 64, one sequence of 64 tokens) over the aten operations it
    dispatches (73 forward, 138 backward, counted with a TorchDispatchMode). This prices what the runtime
    really pays per operation (module calls, hooks, autograd), which a bare op loop underestimates."""
    from dsforge.compiler.frontend.presets import presets
    from dsforge.compiler.model.resolved import resolve_model
    from dsforge.compiler.spec.schema import ModelSpec
    from dsforge.runtime.models import build_model

    spec = dict(presets("models")["tiny-llama"].spec)
    times = {}
    for layers in (2, 4):
        model = build_model(resolve_model(ModelSpec(**{**spec, "layers": layers})), device="cpu")
        ids = torch.randint(0, spec["vocab"], (1, spec["seq_len"]))

        def step(model: Any = model, ids: torch.Tensor = ids) -> None:
            model(input_ids=ids, labels=ids).loss.backward()

        times[layers] = _median_seconds(step, 7)
    return max(0.0, times[4] - times[2]) / 2 / ops_per_layer


def _collective_worker(rank: int, world: int, init: str, out: str, backend: str) -> None:
    """One rank of the collective benchmark: all-reduce by size; rank 0 writes the medians."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    rows = []
    for size in MESSAGE_BYTES:
        t = torch.ones(size // 4, dtype=torch.float32, device=device)

        def call(t: torch.Tensor = t) -> None:
            dist.all_reduce(t)
            if backend == "nccl":
                torch.cuda.synchronize()

        dist.barrier()
        rows.append((size, _median_seconds(call, 7, 3)))
    if rank == 0:
        Path(out).write_text("\n".join(f"{s} {sec}" for s, sec in rows), encoding="utf-8")
    dist.barrier()
    dist.destroy_process_group()


def collective_fit(ranks: int, backend: str) -> tuple[float, float, list[tuple[int, float]]]:
    """(alpha seconds, beta bytes/s, measured rows) of the ring all-reduce model fitted over message sizes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.txt")
        mp.spawn(_collective_worker, args=(ranks, f"file://{tmp}/store", out, backend), nprocs=ranks, join=True)
        rows = [(int(a), float(b)) for a, b in (line.split() for line in Path(out).read_text().splitlines())]
    alpha, beta = fit_ring(rows, ranks)
    return alpha, beta, rows


def fit_ring(rows: list[tuple[int, float]], n: int) -> tuple[float, float]:
    """(alpha, beta) of t = 2(n-1)·alpha + 2(n-1)/n·bytes/beta fitted to (bytes, seconds) all-reduce rows by
    least squares; alpha is clipped at 0 and a non-positive slope (noise) gives an unbounded beta."""
    xs = [2 * (n - 1) / n * s for s, _ in rows]  # bytes on the wire
    ys = [sec for _, sec in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = max(0.0, my - slope * mx)
    return intercept / (2 * (n - 1)), 1.0 / slope if slope > 0 else 1e13


ENGINE_LAYERS = (2, 8)
ENGINE_MICRO_BATCHES = 4


def _engine_job(directory: Path, zero: int, layers: int) -> Path:
    """A one-rank tiny-Llama job at ZeRO ``zero`` with ``layers`` layers, fp32 on the CPU."""
    import yaml

    job = {"version": 1, "name": f"calibrate-z{zero}-l{layers}", "model": {"preset": "tiny-llama", "layers": layers},
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
            plan = validate_file(_engine_job(folder, zero, layers)).plan
            assert plan is not None  # a fixed, valid job
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


def fit_engine(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The `hardware.engine_overhead` terms (us, per ZeRO stage) solved from `_engine_worker` rows.

    Per stage, a micro-batch costs ``micro + T x tensor_micro`` over the bare module and the step's last
    one ``step + T x tensor_step`` more; a line through the two depths gives each pair, its slope clipped
    at 0 (the constant then the mean), its constant clipped at 0."""
    def line(points: list[tuple[float, float]]) -> tuple[float, float]:
        (t0, y0), (t1, y1) = points[0], points[-1]
        slope = (y1 - y0) / (t1 - t0) if t1 != t0 else 0.0
        if slope < 0:
            return max(0.0, statistics.fmean(y for _, y in points)), 0.0
        return max(0.0, y0 - slope * t0), slope

    out: dict[str, list[float]] = {k: [] for k in ("step_us", "micro_batch_us", "tensor_step_us",
                                                   "tensor_micro_batch_us")}
    for zero in range(4):
        mine = sorted((r for r in rows if r["zero"] == zero), key=lambda r: r["tensors"])
        micro = line([(r["tensors"], r["micro_batch_s"] - r["bare_s"]) for r in mine])
        step = line([(r["tensors"], r["last_micro_batch_s"] - r["micro_batch_s"]) for r in mine])
        out["micro_batch_us"].append(round(micro[0] * 1e6, 2))
        out["tensor_micro_batch_us"].append(round(micro[1] * 1e6, 3))
        out["step_us"].append(round(step[0] * 1e6, 2))
        out["tensor_step_us"].append(round(step[1] * 1e6, 3))
    return out


def engine_rows(repeats: int = 5) -> list[dict[str, Any]]:
    """Run `_engine_worker` in a one-rank process group of its own (DeepSpeed keeps global state)."""
    import json

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "engine.json")
        mp.spawn(_engine_worker, args=(f"file://{tmp}/store", out, repeats), nprocs=1, join=True)
        rows: list[dict[str, Any]] = json.loads(Path(out).read_text(encoding="utf-8"))
    return rows


def _host_ram_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def _link_of(fit: dict[str, Any]) -> dict[str, Any]:
    return {k: fit[k] for k in ("bandwidth_gbs", "latency_us", "bus_efficiency")}


def calibrate(ranks: int = 2, links_only: bool = False) -> dict[str, Any] | None:
    """Measure this machine (CPU ranks over gloo, or its GPUs over NCCL) and return the hardware mapping.

    Launched as several ranks (torchrun over one or more nodes), the links are measured in that world
    (`calibrate_links`: inside a node and across nodes, apart) and rank 0 alone goes on and returns the
    mapping; the other ranks return None. ``links_only`` measures the links and nothing else."""
    from dsforge.runtime.calibrate_links import launched, measure_links

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    launch = launched()
    world_links = measure_links(launch, "nccl" if on_gpu else "gloo") if launch is not None else None
    if launch is not None and world_links is None:
        return None
    if on_gpu:
        ranks = min(ranks, torch.cuda.device_count())
    if world_links is not None:
        ranks = world_links["ranks_per_node"]
    if links_only:
        return _links_only(ranks, world_links)
    fp32 = gemm_rates(torch.float32, device)
    bf16 = gemm_rates(torch.bfloat16, device, GEMM_SIZES if on_gpu else GEMM_SIZES[:4])  # CPU bf16 is slow
    bandwidth = memory_bandwidth(device)
    overhead = op_overhead(device)
    per_layer = layer_op_overhead() if not on_gpu else overhead
    if world_links is not None and world_links["intra_node"] is not None:
        alpha, beta, rows = (world_links["intra_node"]["latency_us"] * 1e-6,
                             world_links["intra_node"]["bandwidth_gbs"] * 1e9, world_links["intra_node"]["rows"])
    elif world_links is None and ranks > 1:
        alpha, beta, rows = collective_fit(ranks, "nccl" if on_gpu else "gloo")
    else:
        alpha, beta, rows = 0.0, 1e12, []
    engine = [] if on_gpu else engine_rows()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    memory_gb = (torch.cuda.get_device_properties(0).total_memory / 1e9) if on_gpu else _host_ram_gb() / ranks
    link = {"bandwidth_gbs": round(beta / 1e9, 4), "latency_us": round(alpha * 1e6, 2), "bus_efficiency": 1.0}
    inter = world_links["inter_node"] if world_links is not None else None
    return {
        "measured": {"fp32_gemm_tflops": {n: r / 1e12 for n, r in fp32.items()},
                     "bf16_gemm_tflops": {n: r / 1e12 for n, r in bf16.items()},
                     "copy_gbs": bandwidth / 1e9, "bare_op_us": overhead * 1e6, "op_overhead_us": per_layer * 1e6,
                     "all_reduce_seconds": rows, "engine_steps": engine, "ranks": ranks, "cores": cores,
                     "nodes": world_links["nodes"] if world_links is not None else 1,
                     "inter_node_all_reduce_seconds": inter["rows"] if inter is not None else None,
                     "host": platform.node(), "torch": torch.__version__,
                     "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
        "hardware": {
            "nodes": world_links["nodes"] if world_links is not None else 1, "gpus_per_node": ranks,
            "host_cores": cores, "host_ram_gb": round(_host_ram_gb(), 2),
            "accelerator": {"name": name, "memory_gb": round(memory_gb, 2),
                            "fp32_tflops": round(max(fp32.values()) / 1e12, 6),
                            "bf16_tflops": round(max(bf16.values()) / 1e12, 6),
                            "fp16_tflops": 0 if not on_gpu else round(max(bf16.values()) / 1e12, 6),
                            "hbm_gbs": round(bandwidth / 1e9, 3), "gemm_efficiency": 1.0,
                            "memory_efficiency": 1.0, "op_overhead_us": round(per_layer * 1e6, 3)},
            "intra_node": link, "inter_node": _link_of(inter) if inter is not None else dict(link),
            **({"engine_overhead": fit_engine(engine)} if engine else {})},
    }


def _links_only(ranks: int, world_links: dict[str, Any] | None) -> dict[str, Any]:
    """The `--links-only` result: the two links (measured in the launched world, or intra-node here)."""
    if world_links is None:
        alpha, beta, rows = collective_fit(ranks, "nccl" if torch.cuda.is_available() else "gloo")
        world_links = {"nodes": 1, "ranks_per_node": ranks, "inter_node": None,
                       "intra_node": {"bandwidth_gbs": round(beta / 1e9, 4), "latency_us": round(alpha * 1e6, 2),
                                      "bus_efficiency": 1.0, "ranks": ranks, "rows": rows}}
    intra, inter = world_links["intra_node"], world_links["inter_node"]
    hardware: dict[str, Any] = {"nodes": world_links["nodes"], "gpus_per_node": world_links["ranks_per_node"]}
    if intra is not None:
        hardware["intra_node"] = _link_of(intra)
    if inter is not None:
        hardware["inter_node"] = _link_of(inter)
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"links_only": True, "measured": {"host": platform.node(), "when": when, "torch": torch.__version__,
                                             "intra_node": intra, "inter_node": inter}, "hardware": hardware}


def render(result: dict[str, Any]) -> str:
    """The hardware file: a commented `hardware:` fragment for `extends:`."""
    import yaml

    m = result["measured"]
    if result.get("links_only"):
        lines = [f"# written by `dsforge calibrate --links-only` on {m['host']} at {m['when']} (torch {m['torch']})",
                 "# the links alone: use it with `extends:` under a job whose accelerator is stated elsewhere"]
        for name in ("intra_node", "inter_node"):
            fit = m[name]
            lines.append(f"# {name}: " + ("not measured (one rank per group)" if fit is None else
                         f"{fit['ranks']} ranks per group, all-reduce seconds by bytes: "
                         + ", ".join(f"{s}: {sec:.3g}" for s, sec in fit["rows"])))
        return "\n".join(lines) + "\n" + yaml.safe_dump({"hardware": result["hardware"]}, sort_keys=False)
    lines = [(f"# written by `dsforge calibrate` on {m['host']} at {m['when']} (torch {m['torch']}, "
              f"{m['ranks']} ranks, {m['cores']} cores)"),
             "# use it from a job file: `extends: <this file>` (keys of the job override it)",
             "# measured GEMM TFLOP/s by n (n x n x n): fp32 "
             + ", ".join(f"{n}: {r:.4g}" for n, r in m["fp32_gemm_tflops"].items()),
             "#   bf16 " + ", ".join(f"{n}: {r:.4g}" for n, r in m["bf16_gemm_tflops"].items()),
             (f"# tensor copy {m['copy_gbs']:.2f} GB/s; {m['op_overhead_us']:.2f} us per operation of the HF layer "
              f"({m['bare_op_us']:.2f} us for a bare autograd op)"),
             "# all-reduce seconds by bytes: " + ", ".join(f"{s}: {sec:.3g}" for s, sec in m["all_reduce_seconds"]),
             ("# inter_node: one node was measured; it repeats intra_node" if not m.get("inter_node_all_reduce_seconds")
              else f"# inter_node: measured across {m['nodes']} nodes, all-reduce seconds by bytes: "
              + ", ".join(f"{s}: {sec:.3g}" for s, sec in m["inter_node_all_reduce_seconds"]))]
    for r in m.get("engine_steps", []):
        lines.append(f"# engine ZeRO-{r['zero']}, {r['layers']} layers ({r['tensors']} tensors): bare micro-batch "
                     f"{r['bare_s'] * 1e3:.2f} ms, engine {r['micro_batch_s'] * 1e3:.2f} ms, the step's last "
                     f"{r['last_micro_batch_s'] * 1e3:.2f} ms")
    return "\n".join(lines) + "\n" + yaml.safe_dump({"hardware": result["hardware"]}, sort_keys=False)
