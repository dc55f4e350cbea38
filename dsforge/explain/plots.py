"""Pictures of a plan: the pipeline timeline, memory per stage, the rank placement (PNG and SVG).

matplotlib is imported inside each function (with the Agg backend) so `validate` and the text tables
never pay for it; it comes with the `plots` extra.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsforge.compiler.estimate.memory import MemoryEstimate
from dsforge.compiler.estimate.schedule import Timeline
from dsforge.compiler.plan.placement import Placement
from dsforge.explain.text import IDEAL_LABEL, SIMULATED_LABEL
from dsforge.explain.units import plural, time_axis

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_FORWARD = ("#4c78a8", "#72a2d6", "#2f5b8a", "#9ecae9")  # one shade per chunk
_BACKWARD = ("#f58518", "#ffae5e", "#c4620b", "#ffd19b")
_IDLE = "#e9e3e3"
_COMPONENT_COLOURS = {"parameters": "#4c78a8", "gradients": "#f58518", "optimizer": "#e45756",
                      "buffers": "#b279a2", "activations": "#54a24b", "logits": "#eeca3b",
                      "reserve": "#9d9da0"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timeline_figure(timeline: Timeline, title: str, ideal: float | None = None) -> Figure:
    """Gantt chart of one step: a row per pipeline rank, forward/backward passes, idle time (bubble) shaded.

    The title gives the simulated idle share and, when ``ideal`` is given, the closed form's beside it.
    """
    plt = _pyplot()
    p, span = len(timeline.stages), timeline.makespan
    scale, unit = time_axis(span)
    height = 1.6 + 0.45 * p
    fig, ax = plt.subplots(figsize=(12, height))
    label_passes = sum(len(s) for s in timeline.stages) <= 160
    for s, slots in enumerate(timeline.stages):
        ax.broken_barh([(0, span * scale)], (s - 0.4, 0.8), facecolors=_IDLE, edgecolor="none")
        for kind, palette in (("F", _FORWARD), ("B", _BACKWARD)):
            for chunk in sorted({x.chunk for x in slots if x.kind == kind}):
                bars = [(x.start * scale, (x.end - x.start) * scale) for x in slots
                        if x.kind == kind and x.chunk == chunk]
                # thin white edges separate passes; with hundreds of passes they would read as idle time
                ax.broken_barh(bars, (s - 0.4, 0.8), facecolors=palette[chunk % len(palette)],
                               edgecolor="white", linewidth=0.0 if len(bars) > 60 else 0.8)
        if label_passes:
            for x in slots:
                ax.text((x.start + x.end) / 2 * scale, s, str(x.micro_batch), ha="center", va="center",
                        fontsize=7, color="white")
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, span * scale * 1.001)
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.set_xlabel(f"time within one step ({unit}); passes labelled by micro-batch" if label_passes
                  else f"time within one step ({unit})")
    idle = f"idle (bubble) {100 * timeline.bubble_fraction:.1f} % of rank-time ({SIMULATED_LABEL})"
    if ideal is not None:
        idle += f"\n{100 * ideal:.1f} % {IDEAL_LABEL}"
    ax.set_title(f"{title}\n{idle}")
    names = ["forward", "backward (incl. recompute)", "idle (bubble)"]
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (_FORWARD[0], _BACKWARD[0], _IDLE)]
    if max((x.chunk for row in timeline.stages for x in row), default=0) > 0:
        names[0:2] = ["forward (shade: chunk)", "backward (shade: chunk)"]
    fig.legend(handles, names, loc="lower center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1))
    return fig


def memory_figure(memory: MemoryEstimate, title: str) -> Figure:
    """Stacked device-memory bars of one rank per stage against the accelerator's capacity line."""
    plt = _pyplot()
    stages = memory.stages
    names = list(_COMPONENT_COLOURS) + sorted(
        {k for s in stages for k in s.components} - set(_COMPONENT_COLOURS)
    )
    fig, ax = plt.subplots(figsize=(max(7.0, 3.0 + 0.7 * len(stages)), 4.8))
    xs = list(range(len(stages)))
    bottom = [0.0] * len(stages)
    for name in names:
        values = [s.components.get(name, 0.0) / 1e9 for s in stages]
        if not any(values):
            continue
        ax.bar(xs, values, bottom=bottom, color=_COMPONENT_COLOURS.get(name, "#bab0ac"), label=name,
               width=0.7)
        bottom = [b + v for b, v in zip(bottom, values)]
    cap = memory.capacity_bytes / 1e9
    ax.axhline(cap, color="#d62728", linestyle="--", linewidth=1.5, label=f"capacity {cap:.0f} GB")
    peak = memory.peak.stage
    for x, total in zip(xs, bottom):
        ax.text(x, total, f"{total:.1f}" + ("\npeak" if x == peak else ""), ha="center", va="bottom",
                fontsize=8, fontweight="bold" if x == peak else "normal")
    ax.set_xticks(xs, [f"{s.stage}\nrank {s.rank}" for s in stages], fontsize=8 if len(stages) > 8 else 10)
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("device memory per rank (GB)")
    ax.set_ylim(0, max(cap, max(bottom)) * 1.18)
    ax.set_title(f"{title}\npeak {memory.peak.device_bytes / 1e9:.1f} GB on stage {peak} "
                 f"({100 * memory.utilization:.0f} % of capacity)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def _group_values(placement: Placement, kind: str) -> list[int]:
    """Per rank: its pipeline stage for "pp", otherwise the index of its group of this kind."""
    values = [0] * placement.world_size
    for index, group in enumerate(placement.groups[kind]):
        for position, rank in enumerate(group):
            values[rank] = position if kind == "pp" else index
    return values


_KIND_TITLES = {"tp": "tensor-parallel group", "pp": "pipeline stage", "dp": "data-parallel group",
                "cp": "context-parallel group", "ep": "expert-parallel group"}


def _describe(placement: Placement, kind: str, levels: int) -> str:
    """Panel title: what the colours mean, how many groups of how many ranks, and whether they leave a
    node."""
    groups = placement.groups[kind]
    where = "spanning nodes" if placement.crosses_nodes(kind) else "inside a node"
    if kind == "pp":
        return (f"pipeline stage\n{plural(levels, 'stage')}; {plural(len(groups), 'pipeline')} of "
                f"{plural(len(groups[0]), 'rank')}, {where}")
    return (f"{_KIND_TITLES.get(kind, kind)}\n{plural(len(groups), 'group')} of "
            f"{plural(len(groups[0]), 'rank')}, {where}")


def _colours(kind: str, levels: int) -> Any:
    """A categorical colour map: stages in sequential order, other groups cycling through 20 hues."""
    plt = _pyplot()
    from matplotlib.colors import ListedColormap

    if kind == "pp":
        base = plt.get_cmap("viridis")
        return ListedColormap([base(i / max(levels - 1, 1)) for i in range(levels)])
    base = plt.get_cmap("tab20")
    return ListedColormap([base(i % 20) for i in range(levels)])


def placement_figure(placement: Placement, kinds: list[str], title: str) -> Figure:
    """The nodes x GPUs grid once per group kind, each rank coloured by its group (pipeline ranks by
    stage)."""
    plt = _pyplot()
    nodes, gpn = placement.world_size // placement.gpus_per_node, placement.gpus_per_node
    by_node = nodes <= 16  # rows are nodes; with many nodes the grid is transposed to stay readable
    rows, cols = (nodes, gpn) if by_node else (gpn, nodes)
    side = by_node and cols <= 16  # small grids sit side by side, wide ones stack
    cell_w = min(0.42, (11.0 / len(kinds) if side else 12.0) / cols)
    cell_h = max(cell_w, 1.2 / rows)
    panel_w, panel_h = 1.0 + cols * cell_w, 1.1 + rows * cell_h
    shape = (1, len(kinds)) if side else (len(kinds), 1)
    size = (panel_w * len(kinds), panel_h + 0.6) if side else (panel_w, panel_h * len(kinds) + 0.6)
    fig, axes = plt.subplots(*shape, figsize=size, squeeze=False)
    annotate = rows * cols <= 256
    for ax, kind in zip(axes.flat, kinds):
        values = _group_values(placement, kind)
        grid = [
            [values[(r * gpn + c) if by_node else (c * gpn + r)] for c in range(cols)] for r in range(rows)
        ]
        levels = max(values) + 1
        ax.imshow(grid, cmap=_colours(kind, levels), vmin=-0.5, vmax=levels - 0.5, aspect="auto",
                  interpolation="nearest")
        if annotate:
            for r in range(rows):
                for c in range(cols):
                    rank = (r * gpn + c) if by_node else (c * gpn + r)
                    dark = kind == "pp" and grid[r][c] < levels / 2
                    ax.text(c, r, f"{rank}\n{kind}{grid[r][c]}", ha="center", va="center", fontsize=6,
                            color="white" if dark else "black")
        ax.set_title(_describe(placement, kind, levels), fontsize=8.5)
        ax.set_ylabel("node" if by_node else "GPU in node")
        ax.set_xlabel("GPU in node" if by_node else "node")
        ax.set_xticks(range(cols) if cols <= 32 else range(0, cols, max(1, cols // 16)))
        ax.set_yticks(range(rows) if rows <= 32 else range(0, rows, max(1, rows // 16)))
    fig.suptitle(f"{title}\ncells: rank and its group", fontsize=10)
    fig.tight_layout()
    return fig


def svg_text(fig: Figure, salt: str) -> str:
    """The figure as an SVG element string for inlining into HTML; ``salt`` keeps its element ids unique."""
    plt = _pyplot()
    buf = io.StringIO()
    with plt.rc_context({"svg.hashsalt": salt}):  # several SVGs share one page: clip-path ids must not
                                                  # collide
        fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.find("<svg"):]


def save(fig: Figure, directory: Path, stem: str) -> tuple[list[Path], str]:
    """Write ``stem``.png and ``stem``.svg into ``directory``; return their paths and the SVG element text."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{stem}.png", directory / f"{stem}.svg"]
    fig.savefig(paths[0], dpi=110)
    svg = svg_text(fig, stem)
    paths[1].write_text('<?xml version="1.0" encoding="utf-8" standalone="no"?>\n' + svg, encoding="utf-8")
    return paths, svg


def close(fig: Figure) -> None:
    """Free a figure's memory."""
    _pyplot().close(fig)
