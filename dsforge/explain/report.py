"""Explain one plan: run every estimate once and hand the results to the text, JSON, plot and HTML views."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsforge.compiler.emit.rewrite_doc import with_exact_params
from dsforge.compiler.estimate.memory import MemoryEstimate, estimate_memory
from dsforge.compiler.estimate.steptime import StepTime, estimate_step
from dsforge.compiler.estimate.summary import summarize
from dsforge.compiler.plan.plan import ResolvedPlan
from dsforge.explain.units import plural


@dataclass(frozen=True)
class Explanation:
    """A plan with its estimates: the JSON-ready summary plus the objects the pictures are drawn from."""

    plan: ResolvedPlan
    summary: dict[str, Any]
    step: StepTime
    memory: MemoryEstimate


def explain_plan(plan: ResolvedPlan, tokens: float | None = None,
                 rewrite: dict[str, Any] | None = None) -> Explanation:
    """Estimate a valid plan (raises EstimateError/ValueError when its layout does not resolve).

    ``rewrite``: the rewrite plan's description (dsforge.runtime.rewrite.describe); it goes into the
    summary and, where it is ok, its exact parameter counts replace the formula's.
    """
    step = estimate_step(plan)
    memory = estimate_memory(plan)
    summary = summarize(plan, tokens, step, memory)
    from dsforge.compiler.frontend.pretrained_params import param_count_gap

    gap = param_count_gap(plan.spec.model.pretrained, summary["params"]["total"])
    if gap is not None:  # the model keys cannot state every feature of the checkpoint's family
        # each parameter costs 6 FLOPs per token in a training step's matmuls (2 forward, 4 backward)
        flop_gap = 6.0 * gap[1] * summary["time"]["tokens_per_step"]
        model_flops = summary["flops"]["model_per_step"]
        share = f" ({flop_gap / model_flops:+.2%})" if model_flops else ""
        approx = f"{gap[0]}; model FLOPs/step off by about {flop_gap:+.3e}{share} (6 per parameter and token)"
        summary = {**summary, "params": {**summary["params"], "approximate": approx}}
    from dsforge.compiler.frontend.pretrained_params import attention_core_gaps

    m = plan.model
    core = attention_core_gaps(m.pretrained, m.seq_len, m.heads, m.head_dim, m.layers)
    if core:  # attention the cost model prices as plain softmax attention
        tokens, model_flops = summary["time"]["tokens_per_step"], summary["flops"]["model_per_step"]
        notes = [f"{what}: model FLOPs/step off by about {-gap * tokens:+.3e}"
                 + (f" ({-gap * tokens / model_flops:+.2%})" if model_flops else "") for what, gap in core]
        summary = {**summary, "flops": {**summary["flops"], "approximate": "; ".join(notes)}}
    if rewrite is not None:
        summary = {**with_exact_params(summary, rewrite), "rewrite": rewrite}
    from dsforge.compiler.frontend.data_files import data_summary

    data = data_summary(plan.spec)  # text / megatron corpora: tokens and epochs
    if data is not None:
        summary = {**summary, "data": data}
    return Explanation(plan, summary, step, memory)


def placement_kinds(plan: ResolvedPlan) -> list[str]:
    """The group kinds the placement map shows: those of tp, pp, dp, cp and ep above 1 (dp alone if none)."""
    d = plan.degrees
    kinds = [k for k, n in (("tp", d.tp), ("pp", d.pp), ("dp", d.dp), ("cp", d.cp), ("ep", d.ep)) if n > 1]
    return kinds or ["dp"]


@contextmanager
def figures(ex: Explanation) -> Iterator[dict[str, Any]]:
    """The three pictures (timeline, memory, placement) as matplotlib figures, closed on exit."""
    from dsforge.explain import plots

    name, s = ex.plan.spec.name, ex.summary["pipeline"]
    figs = {
        "timeline": plots.timeline_figure(
            ex.step.timeline, f"{name}: {s['schedule']} schedule, {plural(s['stages'], 'stage')}, "
                              f"{plural(s['micro_batches'], 'micro-batch', 'micro-batches')}",
            ideal=s["bubble_fraction_closed_form"] if s["stages"] > 1 else None),
        "memory": plots.memory_figure(ex.memory, f"{name}: memory per stage"),
        "placement": plots.placement_figure(ex.plan.placement, placement_kinds(ex.plan),
                                            f"{name}: rank placement (order {ex.plan.spec.parallel.order})"),
    }
    try:
        yield figs
    finally:
        for fig in figs.values():
            plots.close(fig)


def write_outputs(ex: Explanation, plot_dir: str | Path | None, html_path: str | Path | None) -> list[Path]:
    """Draw the pictures once; write them as PNG and SVG into ``plot_dir`` and/or into one HTML page."""
    from dsforge.explain import plots
    from dsforge.explain.html import render_html

    written: list[Path] = []
    svgs: dict[str, str] = {}
    with figures(ex) as figs:
        for stem, fig in figs.items():
            if plot_dir is not None:
                paths, svgs[stem] = plots.save(fig, Path(plot_dir), stem)
                written += paths
            else:
                svgs[stem] = plots.svg_text(fig, stem)
    if html_path is not None:
        Path(html_path).write_text(render_html(ex.summary, svgs), encoding="utf-8")
        written.append(Path(html_path))
    return written
