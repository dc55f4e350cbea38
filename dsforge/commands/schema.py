"""`dsforge schema`: the JSON Schema of job files."""

from __future__ import annotations

import json

import click


def command() -> None:
    """Print the JSON Schema of job files."""
    from dsforge.compiler.spec.json_schema import job_schema

    click.echo(json.dumps(job_schema(), indent=2))
