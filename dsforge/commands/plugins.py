"""`dsforge plugins`: every installed plugin, where it came from, and what it added or why it was skipped."""

from __future__ import annotations

from typing import Any

from dsforge.extensions import GROUPS, LoadRecord

#: The modules that own the four extension tables; importing them registers their loaders.
OWNERS = ("dsforge.compiler.frontend.presets", "dsforge.compiler.rules.registry",
          "dsforge.compiler.model.rewrite_policies", "dsforge.compiler.launch_targets")


def plugin_report() -> dict[str, Any]:
    """Load every extension point and describe each entry point (JSON-ready)."""
    import importlib

    from dsforge.extensions import load_all

    for owner in OWNERS:
        importlib.import_module(owner)
    records = load_all()
    return {
        "groups": GROUPS,
        "plugins": [_record(r) for r in records],
        "failed": sum(not r.ok for r in records),
    }


def _record(r: LoadRecord) -> dict[str, Any]:
    e = r.entry
    return {"distribution": e.dist, "version": e.version, "location": e.location, "group": GROUPS[e.kind],
            "name": e.name, "object": e.value, "ok": r.ok, "provides": r.provides, "error": r.error}


def render_text(report: dict[str, Any]) -> str:
    """The report as lines grouped by distribution: each entry point, its state, what it added."""
    plugins = report["plugins"]
    if not plugins:
        groups = ", ".join(report["groups"].values())
        return f"no dsforge plugins installed (entry-point groups: {groups})\n"
    lines: list[str] = []
    by_dist: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for p in plugins:
        by_dist.setdefault((p["distribution"], p["version"], p["location"]), []).append(p)
    for (dist, version, location), entries in by_dist.items():
        lines.append(f"{dist} {version}  ({location})")
        for p in entries:
            head = f"  {p['group']:<25} {p['name']} = {p['object']}"
            if p["ok"]:
                lines.append(f"{head}\n      ok: {', '.join(p['provides']) or 'nothing'}")
            else:
                lines.append(f"{head}\n      FAILED, skipped: {p['error']}")
    ok = len(plugins) - report["failed"]
    lines.append(f"{len(plugins)} entry point(s): {ok} loaded, {report['failed']} failed")
    return "\n".join(lines) + "\n"


def command(fmt: str) -> None:
    """`dsforge plugins`: print the report (text or JSON); exits 1 when a plugin failed to load."""
    import json
    import sys

    import click

    from dsforge.commands import EXIT_CLEAN, EXIT_FINDINGS

    report = plugin_report()
    click.echo(json.dumps(report, indent=2) if fmt == "json" else render_text(report), nl=fmt == "json")
    sys.exit(EXIT_FINDINGS if report["failed"] else EXIT_CLEAN)
