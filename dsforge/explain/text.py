"""Tables of a plan summary (the headline numbers, memory per stage, communication, timing) as text.

Each table is built once as a `Section` (title, header, rows, notes) that the text and HTML views share.
"""

from __future__ import annotations

from typing import Any

from dsforge.compiler.model.rewrite_policies import format_description
from dsforge.explain.checkpoint_text import checkpoint_rows
from dsforge.explain.section import Section
from dsforge.explain.units import count, gb, pct, plural, rate, seconds, table

#: Memory components in display order (others the estimate adds are appended).
_COMPONENTS = ("parameters", "gradients", "optimizer", "buffers", "activations", "logits", "reserve")


def headline(s: dict[str, Any]) -> str:
    """Two lines naming the job, its hardware and layout."""
    lay, par = s["layout"], s["params"]
    moe = (
        f", {count(par['active_per_token'])} active per token"
        if par["active_per_token"] != par["total"]
        else ""
    )
    if par.get("formula_total", par["total"]) != par["total"]:
        moe = f" (exact; formula {count(par['formula_total'])}){moe}"
    sp = ", SP" if lay["sequence_parallel"] and lay["tp"] > 1 else ""
    return (f"{s['job']}: {lay['world_size']} x {lay['accelerator']} ({plural(lay['nodes'], 'node')} x "
            f"{lay['gpus_per_node']}), tp {lay['tp']} x pp {lay['pp']} x dp {lay['dp']} x cp {lay['cp']} (ep "
            f"{lay['ep']}), ZeRO-{lay['zero']}{sp}\n"
            f"model {count(par['total'])} parameters{moe}; batch {lay['global_batch']} x {lay['seq_len']} "
            f"tokens as {plural(lay['micro_batches'], 'micro-batch', 'micro-batches')} of "
            f"{lay['micro_batch']} per replica, {lay['precision']}, recompute {lay['recompute']}")


def summary_section(s: dict[str, Any]) -> Section:
    """The headline estimates: step time, throughput, MFU, time to train, memory peak, the assumption."""
    t, mem = s["time"], s["memory"]
    rows = [["step time", seconds(t["step_s"])],
            ["tokens/s", count(t["tokens_per_s"])],
            ["TFLOP/s per GPU", (f"{rate(t['model_tflops_per_gpu'])} model, "
                                 f"{rate(t['hardware_tflops_per_gpu'])} hardware")],
            ["MFU", f"{pct(t['mfu'])} (HFU {pct(t['hfu'])}) of {rate(t['peak_tflops'])} TFLOP/s dense peak"],
            ["model FLOPs/step", f"{s['flops']['model_per_step']:.3e}"],
            ["time to train", (f"{seconds(t['train_time_s'])} for {count(t['train_tokens'])} tokens "
                              f"({count(t['train_steps'])} steps)")],
            ["memory peak", (f"{gb(mem['peak_bytes'])} on stage {mem['peak_stage']} (rank "
                            f"{mem['peak_rank']}), {pct(mem['utilization'])} of "
                            f"{gb(mem['capacity_bytes'])}")],
            *checkpoint_rows(s),
            _params_row(s["params"])]
    note = (f"assumption: kernels reach {t['achievable_fraction']:.2f} of peak "
            f"({t['achievable_fraction_source']})")
    approx = [f"approximate: {s[k]['approximate']}" for k in ("params", "flops") if s[k].get("approximate")]
    return Section("Summary", ["quantity", "estimate"], rows,
                   notes=[note, *pace_note(s["pipeline"]), *approx])


def pace_note(p: dict[str, Any]) -> list[str]:
    """Says when the step time is the slowest rank's pace rather than the simulated schedule (deep
    pipelines)."""
    if p.get("timeline_exact", True):
        return []
    return [(f"estimate: the {p['stages']}-stage pipeline has no steady state within the simulation budget, "
            f"so the step time extrapolates the slowest rank's pace over {count(p['micro_batches'])} "
            f"micro-batches (from a simulated "
            f"{plural(p['timeline_shown_micro_batches'] or 0, 'micro-batch', 'micro-batches')}); "
            f"it is not exact")]


def _params_row(par: dict[str, Any]) -> list[str]:
    """Parameters one GPU holds, by pipeline stage: the rewrite plan's exact count where the summary has it,
    with the formula's beside it where the two differ."""
    stages = par["per_gpu_by_stage"]
    exact = bool(stages) and all("exact" in st for st in stages)

    def one(st: dict[str, Any]) -> str:
        formula = st["dense"] + st["expert"]
        if not exact or st["exact"] == formula:
            return count(st["exact"] if exact else formula)
        return f"{count(st['exact'])} (formula {count(formula)})"

    return [f"parameters per GPU by stage ({'exact' if exact else 'formula'})",
            runs([one(st) for st in stages])]


def runs(values: list[str]) -> str:
    """Comma-separated values, a run of three or more equal neighbours written once with its stage range
    (a 1,024-stage pipeline would otherwise print a thousand equal counts)."""
    parts, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        parts.extend([f"{values[i]} (stages {i}-{j})"] if j - i >= 2 else values[i:j + 1])
        i = j + 1
    return ", ".join(parts)


def rewrite_section(desc: dict[str, Any]) -> Section:
    """The rewrite plan (one row per repeated module pattern, shards per rank), or why the model cannot be
    placed.

    Title and notes are `format_description`'s lines, the rows its module lines split into columns.
    """
    lines = format_description(desc)
    title = lines[0].rstrip(":")
    title = title[0].upper() + title[1:]
    if not desc.get("ok"):
        left = desc.get("leftover") or []
        notes = [(f"{plural(len(left), 'module')} with parameters left "
                  f"over: give them `rewrite:` rules")] if left else []
        return Section(title, ["problem"], [[e] for e in desc.get("errors", [])], notes=notes)
    rows = [[row["variant"], row["modules"] + (f" (tied to {row['tied_to']})" if row.get("tied_to") else ""),
             row["rule"], ", ".join(f"{name} {'x'.join(map(str, p['shape']))} -> "
                                    f"{'x'.join(map(str, p['shard']))}"
                                    for name, p in row["params"].items())] for row in desc["summary"]]
    notes = [line.strip() for line in lines[1 + len(desc["summary"]):]]
    return Section(title, ["variant", "modules", "rule", "parameters: full -> per rank"], rows, notes=notes)


def memory_section(s: dict[str, Any]) -> Section:
    """Device memory of one rank per pipeline stage, by component, with the peak rank marked."""
    mem = s["memory"]
    names = list(_COMPONENTS) + sorted(
        {k for st in mem["stages"] for k in st["components"]} - set(_COMPONENTS)
    )
    rows = [[f"{st['stage']}{' *' if st['stage'] == mem['peak_stage'] else ''}", str(st["rank"])]
            + [gb(st["components"].get(n, 0.0)) for n in names] + [gb(st["device_bytes"]),
                                                                   gb(st["host_bytes"])]
            for st in mem["stages"]]
    notes = [(f"* peak: stage {mem['peak_stage']}, rank {mem['peak_rank']}: {gb(mem['peak_bytes'])} of "
             f"{gb(mem['capacity_bytes'])} ({pct(mem['utilization'])})")]
    notes += [f"note: {a}" for a in mem.get("assumptions", [])]
    return Section("Memory per pipeline stage (one rank each)", ["stage", "rank"] + names + ["total", "host"],
                   rows, tuple(range(1, len(names) + 4)), notes)


def comm_section(s: dict[str, Any]) -> Section:
    """Every collective of one rank of the critical stage: size, link, bytes and time per step."""
    c = s["communication"]
    rows = [[r["group"], r["collective"], r["purpose"], str(r["group_size"]), r["link"],
             gb(r["payload_bytes"]), count(r["calls_per_step"]), gb(r["sent_bytes_per_step"]),
             seconds(r["time_per_step_s"]), r["overlap"]]
            for r in c["collectives"]]
    exposed = ", ".join(f"{k} {seconds(v)}" for k, v in c["exposed_s"].items()) or "none"
    head = ["group", "collective", "purpose", "ranks", "link", "per call", "calls", "sent/step", "time/step",
            "overlap"]
    return Section(f"Communication per group (one rank of stage {c['stage']}, per step)", head, rows,
                   (3, 5, 6, 7, 8), [f"exposed on the critical path: {exposed}"])


#: What each of the three bubble figures measures; the table, its notes, the picture and the HTML use these.
BUBBLE_ROW = "pipeline bubble (this rank idle)"
SIMULATED_LABEL = "simulated over all ranks with uneven stages and transfers"
IDEAL_LABEL = "ideal, (p-1)/(v*m+p-1): equal stages, no communication"


def bubble_notes(s: dict[str, Any]) -> list[str]:
    """The three bubble figures of one job, one line each, each saying what it measures."""
    t, p = s["time"], s["pipeline"]
    if p["stages"] <= 1:
        return ["pipeline bubble: none (one pipeline stage)"]
    share = t["bubble_s"] / t["step_s"] if t["step_s"] else 0.0
    return ["pipeline bubble, three ways:",
            (f"  {pct(share)} of this rank's step (the row above; "
             f"waiting for transfers counts as pp communication)"),
            (f"  {pct(p['bubble_fraction'])} of the pipeline's "
             f"rank-time, {SIMULATED_LABEL} (the timeline picture)"),
            f"  {pct(p['bubble_fraction_closed_form'])} {IDEAL_LABEL}"]


def timing_section(s: dict[str, Any]) -> Section:
    """Where the critical rank's step time goes, and the bubble as this rank, the simulation and the formula
    see it."""
    t, p = s["time"], s["pipeline"]
    step = t["step_s"]
    parts = [("compute", t["compute_s"]), (BUBBLE_ROW, t["bubble_s"])]
    parts += [(f"{k} communication (exposed)", v) for k, v in t["exposed_comm_s"].items()]
    parts += [("optimizer step", t["optimizer_s"])]
    if t.get("engine_s"):  # priced only where the hardware states engine_overhead (`dsforge calibrate`)
        parts += [("DeepSpeed engine host work", t["engine_s"])]
    rows = [[name, seconds(v), pct(v / step if step else 0.0)] for name, v in parts]
    rows.append(["step", seconds(step), pct(1.0)])
    note = (f"pipeline: {p['schedule']}, {plural(p['stages'], 'stage')} x "
            f"{plural(p['virtual_stages'], 'chunk')}, "
            f"{plural(p['micro_batches'], 'micro-batch', 'micro-batches')}, "
            f"layers per chunk {p['stage_layers']}")
    return Section(f"Timing (critical rank: stage {t['critical_stage']})", ["part", "time", "share"], rows,
                   (1, 2), [note, *bubble_notes(s)])


def sections(s: dict[str, Any]) -> list[Section]:
    """The four tables in display order, then the rewrite plan when the summary carries one (--rewrite)."""
    out = [summary_section(s), memory_section(s), comm_section(s), timing_section(s)]
    if "data" in s:
        from dsforge.explain.data_text import data_section

        out.append(data_section(s["data"]))
    return out + [rewrite_section(s["rewrite"])] if "rewrite" in s else out


def render_section(sec: Section) -> str:
    """One table as text: title, aligned columns, indented notes."""
    if not sec.rows:
        return f"{sec.title}\n  none"
    notes = "".join(f"\n  {n}" for n in sec.notes)
    return f"{sec.title}\n{table(sec.headers, sec.rows, sec.right)}{notes}"


def render(s: dict[str, Any]) -> str:
    """The headline and all tables, separated by blank lines."""
    return "\n\n".join([headline(s)] + [render_section(x) for x in sections(s)]) + "\n"
