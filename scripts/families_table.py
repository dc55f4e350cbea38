"""Generate docs/families.md and README's zoo table from the HF zoo's committed result file.

    python scripts/families_table.py          # rewrite both from benchmarks/results/hf_zoo.json
    python scripts/families_table.py --check  # exit 1 when either differs from what the result file gives

The result file is what `python benchmarks/hf_zoo.py --json benchmarks/results/hf_zoo.json` writes (a
list of rows: type, result, rule, arch, why, seconds; a row re-run after a fix carries ``run``; a
float32 difference re-checked in float64 carries ``dtype``/``float32`` when exact there, ``float64`` when
not). Nothing in the tables is typed by hand: a type's row says what the zoo measured for it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "hf_zoo.json"
#: `python benchmarks/hf_zoo.py --mode pp --json ...`: the types with a base_model_pp_plan at pp=2
RESULTS_PP = ROOT / "benchmarks" / "results" / "hf_zoo_pp.json"
#: `python benchmarks/hf_zoo.py --mode export --json ...`: save_pretrained, read at tp=2 (ep=2), export
RESULTS_EXPORT = ROOT / "benchmarks" / "results" / "hf_zoo_export.json"
#: `python benchmarks/hf_zoo.py --mode ep --json ...`: the types with an ep plan at ep=2 x dp=2
RESULTS_EP = ROOT / "benchmarks" / "results" / "hf_zoo_ep.json"
#: The other modes' files, in the tables' order: (key, path, column heading, how the doc names the mode).
EXTRA = (("pp", RESULTS_PP, "pp=2", "pp=2 (`--mode pp`)"), ("ep", RESULTS_EP, "ep=2", "ep=2 (`--mode ep`)"),
         ("export", RESULTS_EXPORT, "export", "Export (`--mode export`)"))
DOC = ROOT / "docs" / "families.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- hf-zoo-table:begin (scripts/families_table.py) -->", "<!-- hf-zoo-table:end -->"
ORDER = ("exact", "refused", "differs", "crash", "no build")


def load(path: Path = RESULTS, extra: tuple[tuple[str, Path, str, str], ...] = EXTRA) -> dict[str, Any]:
    """The result file: {"mode": ..., "seconds": ..., "rows": [...]}, with each other mode's file (EXTRA)
    under its key when there is one."""
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    for key, other, _, _ in extra:
        if other.exists():
            data[key] = json.loads(other.read_text(encoding="utf-8"))
    return data


def _mode_row(mode: str, rows: list[dict[str, Any]], seconds: object) -> str:
    c = counts(rows)
    built = len(rows) - c["no build"]
    share = f"{100 * c['exact'] / built:.0f} %" if built else "-"
    return (f"| {mode} | {built} | {c['exact']} ({share}) | {c['refused']} | {c['differs']} | {c['crash']} | "
            f"{seconds} s |")


def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Rows per result, in the table's order."""
    out = {k: 0 for k in ORDER}
    for r in rows:
        out[r["result"]] = out.get(r["result"], 0) + 1
    return out


def _wide_line(rows: list[dict[str, Any]]) -> list[str]:
    """The line saying how many exact types were found exact in float64 only (none: no line)."""
    wide = sorted(r["type"] for r in rows if r["result"] == "exact" and r.get("dtype") == "float64")
    if not wide:
        return []
    worst = [float(r["worst"]) for r in rows if r["type"] in wide and r.get("worst")]
    largest = f", largest error {max(worst):.1e} of the reference's scale" if len(worst) == len(wide) else ""
    return [(f"{len(wide)} of the exact types ({', '.join(wide)}) differ in float32 by more than the "
             f"tolerance and are exact in float64 with the models' own float32 casts promoted too{largest}: "
             f"float32's summation order, on gradients whose scale is near zero (each row gives the float32 "
             f"figure)."), ""]


def summary(data: dict[str, Any]) -> str:
    """README's block: one line per mode with the counts and where the rows are."""
    rows = data["rows"]
    built = len(rows) - counts(rows)["no build"]
    pp = data.get("pp")
    pp_line = (f" {len(pp['rows'])} of them state a base_model_pp_plan and run at pp=2 too (`--mode pp`)."
               if pp else "")
    if data.get("ep"):
        pp_line += (f" {len(data['ep']['rows'])} state an ep plan and run at ep=2 x dp=2 against one process "
                    f"(`--mode ep`).")
    if data.get("export"):
        pp_line += (" Each is saved by save_pretrained, read back at tp=2 (and ep=2 x dp=2) by each rank's "
                    "slices and exported by dsforge (`--mode export`).")
    lines = [BEGIN, "",
             (f"The HF zoo (`benchmarks/hf_zoo.py`, {data['mode']}): {len(rows)} causal-LM types of "
              f"transformers {data['transformers']} state a tp/ep plan, {built} build tiny on CPU."
              f"{pp_line}"), "",
             "| mode | types built | exact | refused | differs | crash | run time |",
             "|---|---|---|---|---|---|---|", _mode_row(data["mode"], rows, data["seconds"]),
             *(_mode_row(data[k]["mode"], data[k]["rows"], data[k]["seconds"]) for k, *_ in EXTRA
               if k in data),
             "",
             *_wide_line(rows),
             ("Every type, its policy and the reason of each refusal or difference: "
              "[docs/families.md](docs/families.md)."),
             "", END]
    return "\n".join(lines)


def _cell(text: object) -> str:
    return str(text or "").replace("|", "\\|").replace("\n", " ")[:160]


def _why(row: dict[str, Any]) -> str:
    """The row's reason, with what the other dtype gave when the zoo re-checked it in float64."""
    if row.get("float32"):
        return f"float32 rounding: {row['float32']}"
    if row.get("float64"):  # the float64 figure first: it is the one rounding cannot explain
        return f"float64: {row['float64']}; float32: {row.get('why', '')}"
    return str(row.get("why") or "")


def _pp_cell(row: dict[str, Any] | None) -> str:
    """The type's pp=2 (or export) result, with the rule and the start of the reason, and an export's ep=2
    result: '-' where the mode did not run the type."""
    if row is None:
        return "-"
    why = f": {row['why']}" if row.get("why") and row["result"] != "exact" else ""
    rule = f" {row['rule']}" if row.get("rule") else ""
    ep = f"; ep=2: {row['ep2'][:60]}" if row.get("ep2") else ""
    return _cell(f"{row['result']}{rule}{why}"[:100] + ep)


def document(data: dict[str, Any]) -> str:
    """docs/families.md: the summary and one row per type."""
    head = ["# Model families: the HF zoo", "",
            ("Generated by `python scripts/families_table.py` from "
             "`benchmarks/results/hf_zoo.json`; do not edit."),
            "",
            f"Measured with `python benchmarks/hf_zoo.py` ({data['mode']}). {data.get('note', '')}".rstrip(),
            *(line for k, _, _, named in EXTRA if k in data
              for line in ("", f"{named}: {data[k].get('note', '')}".rstrip())),
            "",
            summary(data).replace(BEGIN, "").replace(END, "").replace("[docs/families.md](docs/families.md)",
                                                                      "below")
            .strip(), "",
            "| type | result | rule | policy | s | why | " + " | ".join(h for _, _, h, _ in EXTRA) + " |",
            "|---|---|---|---|---|---|" + "---|" * len(EXTRA)]
    others = [{r["type"]: r for r in data.get(k, {}).get("rows", [])} for k, *_ in EXTRA]
    body = [
        f"| {r['type']} | {r['result']}{' (' + r['dtype'] + ')' if r.get('dtype') else ''} "
        f"| {r.get('rule', '')} | {r.get('arch', '')} | {r.get('seconds', '')} "
        f"| {_cell(_why(r))}{' (re-run: ' + r['run'] + ')' if r.get('run') else ''} "
        f"| {' | '.join(_pp_cell(o.get(r['type'])) for o in others)} |"
        for r in data["rows"]
    ]
    return "\n".join(head + body) + "\n"


def readme_with(text: str, block: str) -> str:
    """README's text with the zoo block replaced (or added before the section after `## Supported model
    families`)."""
    if BEGIN in text and END in text:
        start, end = text.index(BEGIN), text.index(END) + len(END)
        return text[:start] + block + text[end:]
    anchor = text.index("## Supported model families")
    nxt = text.index("\n## ", anchor + 1)
    return text[:nxt] + "\n" + block + "\n" + text[nxt:]


def main() -> int:
    """Write (or --check) docs/families.md and README's zoo block."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    data = load()
    want_doc, want_readme = document(data), readme_with(README.read_text(encoding="utf-8"), summary(data))
    if args.check:
        stale = [p.name for p,
                 want in ((DOC, want_doc), (README, want_readme)) if p.read_text(encoding="utf-8") != want]
        if stale:
            print(f"stale: {', '.join(stale)}; run python scripts/families_table.py")
        return 1 if stale else 0
    DOC.write_text(want_doc, encoding="utf-8")
    README.write_text(want_readme, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
