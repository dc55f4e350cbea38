"""An `extends` cycle closed in an included file is reported at the job file's own `extends:` line too.

The loader finds the cycle where it closes, in a base file the user may never have opened; the
diagnostic points at the job file's `extends:` line (where the chain starts, and what `validate`
was asked about) and names the included file's line that closes the cycle.
"""

from __future__ import annotations

from dataclasses import replace

from dsforge.diagnostics import InputError, Location


def at_job_file(exc: InputError, own: Location) -> InputError:
    """``exc`` with a cycle found in an included file moved to the job file's ``extends:`` line ``own``."""
    out = []
    for d in exc.diagnostics:
        if d.details.get("extends_cycle") and d.location.file != own.file:
            d = replace(d, location=own, message=f"{d.message} (closed by `extends:` at {d.location.file} "
                                                 f"line {d.location.line}, column {d.location.column})")
        out.append(d)
    return InputError(out)
