"""`dsforge calibrate`: measure this machine into a hardware file (the runtime's calibration, imported
lazily)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from dsforge.commands import EXIT_UNUSABLE


def command(out: str, ranks: int, links_only: bool) -> None:
    """Measure over ``ranks`` processes and write the hardware file ``out`` (rank 0 only); exit 2 without
    torch."""
    from dsforge.commands.run import INSTALL_HINT, missing_runtime

    if missing_runtime():
        click.echo(f"dsforge calibrate: this Python has no torch; install the runtime: {INSTALL_HINT}",
                   err=True)
        sys.exit(EXIT_UNUSABLE)
    from dsforge.runtime.calibrate import calibrate as measure
    from dsforge.runtime.calibrate import render

    result = measure(ranks, links_only=links_only)
    if result is None:  # a rank other than 0 of a launched world: it took part in the link measurement
        return
    Path(out).write_text(render(result), encoding="utf-8")
    click.echo(f"dsforge calibrate: wrote {out}")
