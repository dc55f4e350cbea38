"""`hardware.preset: ./calibrated.yaml`: a hardware preset read from a file instead of dsforge's named
presets.

A preset value that looks like a path (it contains `/` or ends in `.yaml`/`.yml`) names a hardware file:
the `hardware:` fragment `dsforge calibrate` writes, or any file of that shape. The path is taken relative to
the file that wrote the key (the working directory for a job read from standard input), and the preset is
recorded as the absolute path. Its keys merge underneath the job's `hardware:` keys exactly as a named
preset's do, and the positions of its keys come along, so a bad value inside it is reported at its own
file, line and column. A preset file holds one `hardware:` mapping and nothing else: no `extends:`, no
other section, and no `preset:` of its own (chains belong in the job's `extends:`); each is DSF304.
"""

from __future__ import annotations

import os
from typing import Any

from dsforge.compiler.frontend.extends import display_path
from dsforge.compiler.frontend.job_paths import base_directory
from dsforge.compiler.frontend.source import SourceMap, load_yaml, read_text
from dsforge.diagnostics import Diagnostic, Location, Severity

RULE = "DSF304"
_PATH = ("hardware", "preset")


def is_preset_file(name: object) -> bool:
    """True when a preset value names a file rather than a built-in or plugin preset."""
    return isinstance(name, str) and ("/" in name or name.endswith((".yaml", ".yml")))


def _diag(message: str, loc: Location, fix: str, path: tuple[str | int, ...] = _PATH) -> Diagnostic:
    return Diagnostic(RULE, Severity.ERROR, message, loc, fix, path)


def load_preset_file(name: str, smap: SourceMap) -> tuple[dict[str, Any] | None, str, list[Diagnostic]]:
    """The hardware keys of the preset file ``name`` and its absolute path, or the reasons it cannot be used.

    On success the file's key positions are laid under ``smap``'s (the job's own keys keep theirs). A file
    that cannot be read or parsed raises the loader's InputError at the preset file's own position."""
    loc = smap.locate(_PATH, value=True)
    folder = base_directory(loc.file)
    shown = name if len(name) <= 120 else name[:117] + "..."
    try:
        target = (folder / os.path.expanduser(name)).resolve()
        exists, regular = target.exists(), target.is_file()
    except (OSError, ValueError, RuntimeError) as exc:  # a NUL byte, a name over the limits, a link loop
        return None, name, [_diag(f"hardware.preset {shown!r} cannot be resolved as a path "
                                  f"({getattr(exc, 'strerror', None) or exc})", loc,
                                  "name a hardware file by a plain path, or a preset from `dsforge presets`")]
    if not exists:
        return (
            None,
            name,
            [
                _diag(
                    f"hardware.preset names a file that does not exist: {display_path(target)}",
                    loc,
                    f"run `dsforge calibrate -o {shown}` or fix the path (it is relative to "
                    f"{display_path(folder) if loc.file and not loc.file.startswith('<') else 'the working directory'})",  # noqa: E501
                )
            ],
        )
    if not regular:
        return None, name, [_diag(f"hardware.preset names something that is not a regular file: "
                                  f"{display_path(target)}", loc,
                                  "name a YAML hardware file such as the one `dsforge calibrate` writes")]
    display = display_path(target)
    data, fsmap = load_yaml(read_text(target, display), display)
    top = fsmap.locate((), value=False)
    others = [k for k in data if k != "hardware"]
    if others:
        key = others[0]
        return None, name, [_diag(f"the hardware preset file {display} may hold only a `hardware:` section, "
                                  f"not {', '.join(map(repr, others))}", fsmap.locate((key,)),
                                  "move the other keys into the job file "
                                  "(or use `extends:` for a whole base job)",
                                  (key,))]
    body = data.get("hardware")
    if not isinstance(body, dict):
        where = fsmap.locate(("hardware",), value=True) if "hardware" in data else top
        return None, name, [_diag(f"the hardware preset file {display} has no `hardware:` mapping", where,
                                  "write `hardware:` with the machine's keys under it (what `dsforge "
                                  "calibrate` writes)", ("hardware",))]
    if "preset" in body:
        return None, name, [_diag(f"the hardware preset file {display} names a preset of its own; preset "
                                  f"files do not chain", fsmap.locate(_PATH),
                                  "write its keys out, or combine files with " "the job's `extends:`", _PATH)]
    for path, where in fsmap.keys.items():
        smap.keys.setdefault(path, where)
    for path, where in fsmap.values.items():
        smap.values.setdefault(path, where)
    return body, str(target), []


