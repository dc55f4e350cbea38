"""DSF4xx: which parallel groups cross a node boundary, and what bandwidth they fall to."""

from __future__ import annotations

from collections.abc import Iterator

from dsforge.compiler.rules.registry import Context, Finding, rule
from dsforge.diagnostics import Severity

_WHY = {
    "tp": "two all-reduces of b*s*h activations per layer in each direction",
    "cp": "K/V blocks exchanged in every attention layer",
    "ep": "two all-to-alls of the routed tokens per MoE layer",
}


def _crossing(ctx: Context, kind: str, key: str) -> Iterator[Finding]:
    placement, d = ctx.plan.placement, ctx.plan.degrees
    if placement is None or d is None or getattr(d, kind) == 1 or not placement.crosses_nodes(kind):
        return  # a group of one rank never leaves its node (and its groups need not be built)
    hw = ctx.spec.hardware
    group = placement.crossing_group(kind, head=8)  # a million-rank cp group is shown by its first ranks
    assert group is not None  # crosses_nodes said one does
    intra, inter = hw.intra_node.bandwidth_gbs, hw.inter_node.bandwidth_gbs
    size = getattr(d, kind)
    fix = (f"keep {key} <= gpus_per_node={hw.gpus_per_node} and first in parallel.order"
           if size > hw.gpus_per_node else f"put {key} first in parallel.order so its ranks share a node")
    yield Finding(f"{key}={size} group {group[:8]}{'...' if size > 8 else ''} spans "
                  f"{placement.nodes_spanned(kind)} nodes: its traffic ({_WHY[kind]}) falls from "
                  f"{intra:g} GB/s inside a node to {inter:g} GB/s "
                  f"between nodes ({intra / inter:.0f}x slower)",
                  fix, ("parallel", key), details={"intra_gbs": intra, "inter_gbs": inter})


# These three warn or inform and never refuse a layout, so no field decides their verdict (reads=()): the
# layout search asks them once, not for every degree combination (a million-rank cp group's placement is not
# cheap).


@rule("DSF401", "tensor parallelism stays inside a node", severity=Severity.WARNING,
      source="Narayanan et al. 2021 sec. 3.2 (TP within a node, takeaway #1)", reads=())
def tp_in_node(ctx: Context) -> Iterator[Finding]:
    """Tensor parallelism all-reduces activations twice per layer per direction; across nodes it runs at
    network rather than NVLink bandwidth and usually dominates the step."""
    yield from _crossing(ctx, "tp", "tp")


@rule("DSF402", "context parallelism stays inside a node", severity=Severity.WARNING,
      source="Liu et al. 2023 (Ring Attention): overlap needs block compute >= K/V transfer",
      reads=())
def cp_in_node(ctx: Context) -> Iterator[Finding]:
    """Ring attention hides the K/V transfer behind block compute only when the link is fast enough;
    across nodes the exchange is usually exposed."""
    yield from _crossing(ctx, "cp", "cp")


@rule("DSF403", "expert parallelism crossing nodes is costed", severity=Severity.INFO,
      source="Lepikhin et al. 2020 (GShard); Rajbhandari et al. 2022 (DeepSpeed-MoE)",
      reads=())
def ep_in_node(ctx: Context) -> Iterator[Finding]:
    """Every MoE layer sends each token to its experts and back with all-to-alls; across nodes these run
    at network bandwidth. Common for large MoE runs, so reported as information."""
    yield from _crossing(ctx, "ep", "ep")
