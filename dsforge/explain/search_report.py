"""`dsforge search` output: the ranked table, the funnel, the winner as a job-file fragment, JSON, the
plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsforge.compiler.search.engine import Evaluated, SearchResult
from dsforge.compiler.search.resolve import record
from dsforge.compiler.search.space import value_at
from dsforge.compiler.search.write import yaml_value
from dsforge.explain.units import gb, pct, plural, seconds, table

#: Funnel labels of the reasons that are not rule ids.
REASONS = {"memory": "memory over search.memory_fraction (model states alone, or the estimate)",
           "DSF301": "DSF301 (the memory estimate exceeds the accelerator)",
           "deadline": "missing the deadline"}


def objective_cell(result: SearchResult, e: Evaluated) -> str:
    """The objective's own figure for one candidate: time to train, or its cost."""
    o = result.objective
    train_s = o.tokens * e.step.step_s / e.step.tokens
    if o.name == "cost":
        return f"{train_s / 3600 * e.plan.world_size * (o.price_per_gpu_hour or 0):,.0f}"
    return seconds(train_s)


def row(result: SearchResult, rank: int | str, e: Evaluated) -> list[str]:
    """One table row."""
    lay, step, mem = e.layout, e.step, e.memory
    sched = (
        "-" if lay.pp == 1 else (lay.schedule + (f"/{lay.virtual_stages}" if lay.virtual_stages > 1 else ""))
    )
    cp = f"{lay.cp}" + (f" {lay.cp_kind}" if lay.cp > 1 else "")
    return [str(rank), str(e.plan.world_size), str(lay.tp), str(lay.pp), str(lay.dp), cp,
            str(lay.ep), str(lay.zero), "on" if lay.sequence_parallel else "-", str(lay.micro_batch),
            lay.recompute, sched, f"{gb(mem.peak.device_bytes)} ({mem.utilization:.0%})",
            seconds(step.step_s), f"{step.tokens_per_s:,.0f}", pct(step.mfu),
            pct(step.bubble_s / step.step_s if step.step_s else 0.0), seconds(sum(step.comm_s.values())),
            objective_cell(result, e)]


HEADERS = ["#", "gpus", "tp", "pp", "dp", "cp", "ep", "zero", "sp", "mb", "recompute", "schedule",
           "peak memory", "step", "tokens/s", "MFU", "bubble", "exposed comm"]


def ranked_table(result: SearchResult) -> str:
    """The top candidates (and the written layout under `--compare`) as a text table."""
    last = "cost" if result.objective.name == "cost" else "time to train"
    rows = [row(result, i + 1, e) for i, e in enumerate(result.ranked)]
    if result.written is not None:
        rows.append(row(result, f"written (#{result.written_rank})", result.written))
    return table([*HEADERS, last], rows, right=(1, 2, 3, 4, 6, 7, 9, 12, 13, 14, 15, 16, 17, 18))


def funnel_text(result: SearchResult) -> str:
    """Candidates considered, removed by each rule id and by memory, pruned, estimated, left."""
    f = result.funnel
    lines = [
        f"funnel: {f.considered:,} candidate(s) legal by construction"
        + (f" over {plural(len(result.nodes_tried), 'node count')}" if len(result.nodes_tried) > 1 else "")
    ]
    for reason, n in sorted(f.removed.items(), key=lambda kv: -kv[1]):
        lines.append(f"  - {n:,} removed by {REASONS.get(reason, reason)}")
    if f.pruned:
        lines.append(f"  - {f.pruned:,} never estimated: their lower bound could not reach the top")
    lines.append(f"  = {f.fitting:,} fit and were estimated in "
                 f"full{' (exhaustive)' if result.exhaustive else ''}")
    return "\n".join(lines)


def fragment(result: SearchResult) -> str:
    """The winner's values of the `auto` fields as a job-file fragment."""
    w = result.winner
    assert w is not None  # a public helper over a SearchResult; render asks it only of a search with a winner
    tree: dict[str, Any] = {}
    for key in result.keys:
        node = tree
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value_at(w.spec, key)
    return "\n".join(_yaml_lines(tree, 0))


def _yaml_lines(tree: dict[str, Any], depth: int) -> list[str]:
    out = []
    for k, v in tree.items():
        if isinstance(v, dict):
            out.append(f"{'  ' * depth}{k}:")
            out += _yaml_lines(v, depth + 1)
        else:
            out.append(f"{'  ' * depth}{k}: {yaml_value(v)}")
    return out


def misses_text(result: SearchResult, limit: int = 5) -> str:
    """The closest misses and what each lacks (when nothing fits)."""
    lines = ["closest misses:"]
    seen: set[str] = set()
    for m in result.misses:
        if m.reason != "memory" and m.reason in seen:
            continue
        seen.add(m.reason)
        lines.append(f"  {m.layout.label()}: {REASONS.get(m.reason, m.reason)}: {m.detail}")
        if len(lines) > limit:
            break
    return "\n".join(lines)


def render(result: SearchResult, name: str) -> str:
    """The whole text report."""
    o = result.objective
    head = (f"{name}: search for {', '.join('.'.join(k) for k in result.keys) or 'the written layout'}; "
            f"objective {o.name}")
    if o.name != "throughput":
        head += f" over {o.tokens:,.4g} tokens"
    if o.deadline_s is not None:
        head += f" within {seconds(o.deadline_s)}"
    parts = [head, ""]
    if result.ranked:
        parts += [ranked_table(result), ""]
    parts.append(funnel_text(result))
    if result.written_miss is not None:
        m = result.written_miss
        parts.append(f"written layout {m.layout.label()} does not fit: "
                     f"{REASONS.get(m.reason, m.reason)}: {m.detail}")
    if result.winner is None:
        parts += ["", misses_text(result)]
    else:
        nodes = f" on {plural(result.nodes or 0, 'node')}" if len(result.nodes_tried) > 1 else ""
        parts += ["", f"winner{nodes} (job-file fragment):", fragment(result)]
    return "\n".join(parts) + "\n"


def to_json(result: SearchResult) -> dict[str, Any]:
    """The report as JSON-ready data: plan.json's search record plus every ranked candidate's figures."""
    doc = record(result, runners_up=len(result.ranked))
    doc["ranked"] = [{"rank": i + 1, "layout": e.layout.as_dict(), "value": e.value, "step_s": e.step.step_s,
                      "tokens_per_s": e.step.tokens_per_s, "mfu": e.step.mfu,
                      "peak_bytes": e.memory.peak.device_bytes, "memory_utilization": e.memory.utilization,
                      "bubble_s": e.step.bubble_s,
                      "exposed_comm_s": sum(e.step.comm_s.values())} for i, e in enumerate(result.ranked)]
    doc["seconds"] = result.seconds
    doc["misses"] = [{"layout": m.layout.as_dict(), "reason": m.reason, "detail": m.detail}
                     for m in result.misses[:10]] if result.winner is None else []
    if result.written is not None or result.written_miss is not None:
        doc["written"] = {"rank": result.written_rank,
                          "value": result.written.value if result.written is not None else None,
                          "miss": result.written_miss.detail if result.written_miss is not None else None}
    return doc


def frontier(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (less memory, more tokens/s)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    best, out = -1.0, []
    for i in order:
        if points[i][1] > best:
            out.append(i)
            best = points[i][1]
    return out


def write_plot(result: SearchResult, directory: str | Path) -> list[Path]:
    """memory against throughput for every fitting candidate, the frontier marked (PNG and SVG)."""
    from dsforge.explain import plots

    plt = plots._pyplot()
    cands = result.fitting or result.ranked
    pts = [(e.memory.peak.device_bytes / 1e9, e.step.tokens_per_s) for e in cands]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, color="#9ecae9", label="fitting candidate")
    front = frontier(pts)
    ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "o-", color="#e45756", ms=4,
            label="frontier")
    if result.winner is not None:
        w = result.winner
        ax.scatter([w.memory.peak.device_bytes / 1e9], [w.step.tokens_per_s], marker="*", s=160,
                   color="#2f5b8a", label=f"winner {w.layout.label()}", zorder=3)
    ax.set_xlabel("peak memory of the busiest rank (GB)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{len(pts)} fitting candidates")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    try:
        paths, _ = plots.save(fig, Path(directory), "search")
    finally:
        plots.close(fig)
    return paths
