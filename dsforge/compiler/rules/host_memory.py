"""DSF302-DSF304: what the estimate checks on the host, the ZeRO features it does not model, and the hardware
file a `hardware.preset` path names (dsforge/compiler/frontend/preset_files.py)."""

from __future__ import annotations

from collections.abc import Iterator

from dsforge.compiler.deepspeed.ds_settings import emitted_zero_block
from dsforge.compiler.estimate.memory import estimate_memory
from dsforge.compiler.rules.registry import Context, Finding, report_id, rule
from dsforge.diagnostics import Severity

#: Ranks up to which every node's mix of pipeline stages is summed exactly; above it, the busiest stage's
#: host bytes times the ranks per node (an upper bound, and the message says so).
EXACT_RANKS = 65_536

#: ZeRO++ (Wang et al. 2023) and parameter offload settings whose effect on the step the estimate lacks.
NOT_MODELLED = {
    "zero_hpz_partition_size": "hierarchical weight partitions (secondary all-gathers inside a node)",
    "zero_quantized_weights": "int8 weight all-gathers (half the bytes of bf16)",
    "zero_quantized_gradients": "int4 gradient reduce-scatters over all-to-all",
}


def _estimable(ctx: Context) -> bool:
    p = ctx.plan
    return (p.layout_ok and p.placement is not None and bool(p.stage_layers)
            and ctx.spec.parallel.zero != "auto")


@rule("DSF302", "offloaded states fit the host memory of each node",
      source="Ren et al. 2021 (ZeRO-Offload); DeepSpeed stage_1_and_2.py / stage3.py cpu_offload buffers")
def host_memory_fits(ctx: Context) -> Iterator[Finding]:
    """With the optimizer (or parameters) offloaded, every rank keeps its fp32 master weights, moments and
    gradient partition in host memory; the ranks of a node share its RAM, so a node whose ranks together
    need more than `hardware.host_ram_gb` is killed by the kernel's out-of-memory handler mid-step. Checked
    only when the hardware states its host RAM."""
    ram, placement = ctx.spec.hardware.host_ram_gb, ctx.plan.placement
    if ram is None or placement is None or not _estimable(ctx):
        return
    est = estimate_memory(ctx.plan.priced())
    if not any(s.host_bytes for s in est.stages):
        return
    plan, per = ctx.plan, ctx.spec.hardware.gpus_per_node
    by_stage = [s.host_bytes for s in est.stages]
    if plan.world_size <= EXACT_RANKS:
        nodes: dict[int, float] = {}
        for rank in range(plan.world_size):
            node = rank // per
            nodes[node] = nodes.get(node, 0.0) + by_stage[placement.coordinates(rank)["pp"]]
        node, need = max(nodes.items(), key=lambda kv: kv[1])
        what = f"node {node} needs {need / 1e9:.1f} GB"
    else:
        need = max(by_stage) * min(per, plan.world_size)
        what = f"a node needs up to {need / 1e9:.1f} GB (the busiest stage's ranks on every GPU of it)"
    if need <= ram * 1e9:
        return
    yield Finding(f"{what} of host memory for its ranks' offloaded optimizer states and has "
                  f"{ram:g} GB (hardware.host_ram_gb)",
                  "offload less (training.optimizer.offload: none, or ZeRO-3 over more data-parallel ranks "
                  "to shrink each partition), use more nodes, or hosts with more RAM",
                  ("hardware", "host_ram_gb"))


@rule("DSF303", "the step-time estimate models every ZeRO setting the job uses", severity=Severity.WARNING,
      source="Wang et al. 2023 (ZeRO++); DeepSpeed runtime/zero/config.py", suppressible=True)
def zero_features_modelled(ctx: Context) -> Iterator[Finding]:
    """ZeRO++ changes how much each collective sends and over which link, and parameter offload streams the
    weights over PCIe every pass; dsforge's step-time estimate models neither, so `explain` would show the
    time of the plain ZeRO job. The memory estimate is unaffected by the ZeRO++ switches."""
    block = emitted_zero_block(ctx.plan)
    hpz = block.get("zero_hpz_partition_size")
    used = [key for key in ("zero_quantized_weights", "zero_quantized_gradients") if block.get(key) is True]
    if isinstance(hpz, int) and not isinstance(hpz, bool) and hpz > 1:
        used.insert(0, "zero_hpz_partition_size")
    offload = block.get("offload_param")
    if isinstance(offload, dict) and offload.get("device", "none") in ("cpu", "nvme"):
        used.append("offload_param")
    if not used:
        return
    what = "; ".join(f"{k} "
                     f"({NOT_MODELLED.get(k, 'weights streamed from the host every pass')})" for k in used)
    yield Finding(f"the step-time estimate does not model {what}: explain shows the step without them",
                  "read explain's step time as the plain ZeRO job's, or measure with benchmarks/gpu_check.sh",
                  ("deepspeed", "zero_optimization"))


report_id("DSF304", "a hardware.preset path names a usable hardware file",
          "`hardware.preset` may name a file (a value with `/` or a .yaml/.yml suffix), such as the one "
          "`dsforge calibrate` writes, relative to the file that wrote the key. The file must exist, be a "
          "regular file and hold exactly one `hardware:` mapping, without `extends:`, other sections or a "
          "`preset:` of its own; its values are then checked "
          "like the job's, at their own file, line and column.",
          "dsforge/compiler/frontend/preset_files.py")
