"""One self-contained HTML page of a plan: the tables and the pictures as inline SVG (no external files)."""

from __future__ import annotations

from html import escape
from typing import Any

from dsforge.explain.text import Section, headline, sections

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; color: #222; padding: 0 1em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 2em; border-bottom: 1px solid #ddd; }
p.lead { white-space: pre-line; color: #444; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { padding: 3px 9px; border-bottom: 1px solid #eee; text-align: left; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
p.note { font-size: 0.85em; color: #555; margin: 0.2em 0; }
figure { margin: 1em 0; } figure svg { max-width: 100%; height: auto; }
"""

_FIGURE_CAPTIONS = {
    "timeline": ("Pipeline timeline of one step, simulated: forward and backward passes per stage; grey is "
                 "idle time (bubble), with uneven stages and transfers included."),
    "memory": "Device memory of one rank per pipeline stage, "
              "stacked by component, against the capacity line.",
    "placement": "Rank placement: nodes x GPUs, each rank coloured by its group (pipeline ranks by stage).",
}


def _table(sec: Section) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in sec.headers)
    body = "".join(
        "<tr>" + "".join(f"<td class=\"num\">{escape(c)}</td>" if i in sec.right else f"<td>{escape(c)}</td>"
                         for i, c in enumerate(row)) + "</tr>"
        for row in sec.rows)
    notes = "".join(f"<p class=\"note\">{escape(n)}</p>" for n in sec.notes)
    return f"<h2>{escape(sec.title)}</h2>\n<table><tr>{head}</tr>{body}</table>\n{notes}"


def render_html(summary: dict[str, Any], svgs: dict[str, str]) -> str:
    """The whole report of an explain ``summary`` as one HTML document, with the pictures (``svgs``: name ->
    SVG element) inlined."""
    s = summary
    parts = [f"<h1>dsforge explain: {escape(s['job'])}</h1>", f"<p class=\"lead\">{escape(headline(s))}</p>"]
    parts += [_table(sec) for sec in sections(s)]
    parts.append("<h2>Pictures</h2>")
    for name, svg in svgs.items():
        caption = _FIGURE_CAPTIONS.get(name, name)
        parts.append(f"<figure "
                     f"id=\"{escape(name)}\">{svg}<figcaption>{escape(caption)}</figcaption></figure>")
    body = "\n".join(parts)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>dsforge explain: {escape(s['job'])}</title><style>{_STYLE}</style></head>\n"
            f"<body>\n{body}\n</body></html>\n")
