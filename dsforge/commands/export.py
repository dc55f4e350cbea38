"""`dsforge export`: a compiled job's checkpoint as an HF model directory (the runtime's export, imported
lazily)."""

from __future__ import annotations

import sys

import click

from dsforge.commands import EXIT_FINDINGS, EXIT_UNUSABLE


def command(job_dir: str, step: int | None, out: str) -> None:
    """Export ``job_dir``'s checkpoint of ``step`` (the newest by default) into ``out``; say what was
    written."""
    from dsforge.commands.run import INSTALL_HINT, missing_runtime

    missing = missing_runtime()
    if missing:
        click.echo(f"dsforge export: this Python has no {', '.join(missing)}; "
                   f"install the runtime: {INSTALL_HINT}",
                   err=True)
        sys.exit(EXIT_UNUSABLE)
    from dsforge.runtime.export import ExportError, export_checkpoint

    try:
        done = export_checkpoint(job_dir, out, step)
    except ExportError as exc:
        click.echo(f"dsforge export: {exc}", err=True)
        sys.exit(EXIT_FINDINGS)
    click.echo(f"dsforge export: wrote {done.directory}: step {done.step}, {done.tensors} tensors, "
               f"{done.parameters:,} parameters ({done.dtype}); load it with "
               f"AutoModelForCausalLM.from_pretrained({str(done.directory)!r})")
