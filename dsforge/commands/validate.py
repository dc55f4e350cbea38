"""`dsforge validate`: check job files and print the report in the chosen format."""

from __future__ import annotations

import sys
from typing import Any

import click

from dsforge.commands import EXIT_CLEAN, EXIT_FINDINGS, EXIT_UNUSABLE


def command(files: tuple[str, ...], fmt: str, strict: bool, output: str | None, selection: Any) -> None:
    """Validate ``files`` with ``selection``; print or write the report; exit 0 clean, 1 findings, 2
    unusable."""
    from dsforge.compiler.rules.shared_checkpoints import shared_checkpoint_dirs
    from dsforge.compiler.validate import validate_file
    from dsforge.diagnostics import has_errors
    from dsforge.formatters import get, write_report

    results = [validate_file(f, selection=selection) for f in files]
    shared = shared_checkpoint_dirs(results)  # DSF613: files validated together, one checkpoint directory
    diags = [d for r in results for d in r.diagnostics] + shared
    text = get(fmt)(diags)
    if output:
        problem = write_report(text, output)
        if problem:
            click.echo(f"dsforge: {problem}", err=True)
            sys.exit(EXIT_UNUSABLE)
    else:
        click.echo(text, nl=False)
    if any(r.unusable for r in results):
        sys.exit(EXIT_UNUSABLE)
    failed = any(has_errors(r.diagnostics, strict or r.strict) for r in results) or bool(shared)
    sys.exit(EXIT_FINDINGS if failed else EXIT_CLEAN)
