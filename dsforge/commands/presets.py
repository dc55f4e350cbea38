"""`dsforge presets`: the hardware and model presets, as a list or as JSON."""

from __future__ import annotations

import json

import click


def command(kind: str, fmt: str) -> None:
    """Print the presets of ``kind`` (all, hardware or models) as text or JSON."""
    from dsforge.compiler.frontend.presets import KINDS
    from dsforge.compiler.frontend.presets import presets as table

    kinds = KINDS if kind == "all" else (kind,)
    if fmt == "json":
        click.echo(json.dumps({k: {n: {"description": p.description, "origin": p.origin, "spec": p.spec}
                                   for n, p in table(k).items()} for k in kinds}, indent=2))
        return
    for k in kinds:
        click.echo(f"{k}:")
        for name, p in table(k).items():
            click.echo(f"  {name:<16} {p.description}")
