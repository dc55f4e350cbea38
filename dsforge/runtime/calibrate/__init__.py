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
  the backend achieves). Then the same small all-reduce in situ, after a chain of dispatched ops on every
  rank as a training step issues it (`links.in_situ_seconds`, against the same work without it, alternated
  over repeats): where it costs more than the back-to-back fit prices it (a rank that arrives first waits
  for its partner to be scheduled, which dominates on shared CPU cores), alpha is raised to it. The file
  states both, the in-situ figure's noise (spread of its repeats over their median) and the load average
  before and after. One node only: ``inter_node`` is written equal to ``intra_node`` and says so;
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
from typing import Any

import torch

from dsforge.runtime.calibrate.engine_overhead import engine_rows
from dsforge.runtime.calibrate.fits import fit_engine
from dsforge.runtime.calibrate.kernels import (
    GEMM_SIZES,
    gemm_rates,
    layer_op_overhead_spread,
    memory_bandwidth,
    op_overhead,
)
from dsforge.runtime.calibrate.links import collective_fit, launched, measure_links


def _host_ram_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def _link_of(fit: dict[str, Any]) -> dict[str, Any]:
    return {k: fit[k] for k in ("bandwidth_gbs", "latency_us", "bus_efficiency")}


def calibrate(ranks: int = 2, links_only: bool = False) -> dict[str, Any] | None:
    """Measure this machine (CPU ranks over gloo, or its GPUs over NCCL) and return the hardware mapping.

    Launched as several ranks (torchrun over one or more nodes), the links are measured in that world
    (`links`: inside a node and across nodes, apart) and rank 0 alone goes on and returns the
    mapping; the other ranks return None. ``links_only`` measures the links and nothing else."""
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    situ: dict[str, float] = {}
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
    per_layer, op_spread = layer_op_overhead_spread() if not on_gpu else (overhead, 0.0)
    if world_links is not None and world_links["intra_node"] is not None:
        alpha, beta, rows = (world_links["intra_node"]["latency_us"] * 1e-6,
                             world_links["intra_node"]["bandwidth_gbs"] * 1e9,
                             world_links["intra_node"]["rows"])
    elif world_links is None and ranks > 1:
        fit = collective_fit(ranks, "nccl" if on_gpu else "gloo")
        alpha, beta, rows = fit.alpha, fit.beta, fit.rows
        situ = {"in_situ_all_reduce_s": fit.in_situ_s, "in_situ_spread": fit.in_situ_spread,
                "fitted_latency_us": fit.fitted_alpha * 1e6}
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
                     "copy_gbs": bandwidth / 1e9, "bare_op_us": overhead * 1e6,
                     "op_overhead_us": per_layer * 1e6, "all_reduce_seconds": rows, "engine_steps": engine,
                     "ranks": ranks, "cores": cores,
                     "nodes": world_links["nodes"] if world_links is not None else 1,
                     "inter_node_all_reduce_seconds": inter["rows"] if inter is not None else None,
                     "host": platform.node(), "torch": torch.__version__, **situ,
                     "op_overhead_spread": op_spread,
                     "load": [load_before, os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0],
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
        fit = collective_fit(ranks, "nccl" if torch.cuda.is_available() else "gloo")
        alpha, beta, rows = fit.alpha, fit.beta, fit.rows
        world_links = {"nodes": 1, "ranks_per_node": ranks, "inter_node": None,
                       "intra_node": {"bandwidth_gbs": round(beta / 1e9, 4),
                                      "latency_us": round(alpha * 1e6, 2), "bus_efficiency": 1.0,
                                      "ranks": ranks, "rows": rows}}
    intra, inter = world_links["intra_node"], world_links["inter_node"]
    hardware: dict[str, Any] = {"nodes": world_links["nodes"], "gpus_per_node": world_links["ranks_per_node"]}
    if intra is not None:
        hardware["intra_node"] = _link_of(intra)
    if inter is not None:
        hardware["inter_node"] = _link_of(inter)
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"links_only": True,
            "measured": {"host": platform.node(), "when": when, "torch": torch.__version__,
                                             "intra_node": intra, "inter_node": inter}, "hardware": hardware}


def render(result: dict[str, Any]) -> str:
    """The hardware file: a commented `hardware:` fragment for `extends:`."""
    import yaml

    m = result["measured"]
    if result.get("links_only"):
        lines = [(f"# written by `dsforge calibrate --links-only` on "
                  f"{m['host']} at {m['when']} (torch {m['torch']})"),
                 ("# the links alone: use it with `extends:` under "
                  "a job whose accelerator is stated elsewhere")]
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
             (f"# tensor copy {m['copy_gbs']:.2f} GB/s; {m['op_overhead_us']:.2f} us per operation of the HF "
              f"layer ({m['bare_op_us']:.2f} us for a bare autograd op)"
              + (f"; noise of the per-operation figure: spread {m['op_overhead_spread']:.0%} of its median "
                 f"over 15 alternated 4- against 2-layer repeats" if "op_overhead_spread" in m else "")),
             "# all-reduce seconds by bytes: " + ", ".join(f"{s}: {sec:.3g}" for s,
                                                           sec in m["all_reduce_seconds"]),
             *([(f"# in situ (between compute, as a step issues it): a 16 KiB all-reduce adds "
                 f"{m['in_situ_all_reduce_s'] * 1e3:.3f} ms (noise: spread {m['in_situ_spread']:.0%} of the "
                 f"median over the repeats); latency_us is the larger of that and the back-to-back fit's "
                 f"{m['fitted_latency_us']:.2f} us")] if "in_situ_all_reduce_s" in m else []),
             *([(f"# load average {m['load'][0]:.2f} before, {m['load'][1]:.2f} after ({m['cores']} cores): "
                 f"the rates are this machine's under that load")] if "load" in m else []),
             ("# inter_node: one node was measured; it repeats intra_node" if not m.get("inter_node_all_reduce_seconds")  # noqa: E501
              else f"# inter_node: measured across {m['nodes']} nodes, all-reduce seconds by bytes: "
              + ", ".join(f"{s}: {sec:.3g}" for s, sec in m["inter_node_all_reduce_seconds"]))]
    for r in m.get("engine_steps", []):
        lines.append(f"# engine ZeRO-{r['zero']}, {r['layers']} layers ({r['tensors']} tensors): bare "
                     f"micro-batch {r['bare_s'] * 1e3:.2f} ms, engine {r['micro_batch_s'] * 1e3:.2f} ms, the "
                     f"step's last {r['last_micro_batch_s'] * 1e3:.2f} ms")
    return "\n".join(lines) + "\n" + yaml.safe_dump({"hardware": result["hardware"]}, sort_keys=False)
