"""A project's dsforge settings: `dsforge.toml`, or the `[tool.dsforge]` table of `pyproject.toml`.

Looked up from the job file's directory upwards (from the working directory for a job read from
standard input); the nearest file that holds settings wins, `dsforge.toml` before `pyproject.toml` in
the same directory, as ruff and pytest look theirs up. Keys (the same in both files):

    [tool.dsforge]            # in dsforge.toml the table is the top level (or [dsforge])
    select = ["DSF1", "DSF3"] # report only these ids / prefixes (default: all)
    ignore = ["DSF204"]       # never report these (warnings, notes and estimate errors such as DSF301)
    strict = true             # warnings fail, as --strict
"""

from __future__ import annotations

import functools
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsforge.compiler.rules.selection import Selection, check_known, parse_ids

KEYS = ("select", "ignore", "strict")
#: The settings files are small; anything larger is not one (and is not read whole).
MAX_BYTES = 1024 * 1024


class ConfigError(ValueError):
    """A settings file dsforge found but cannot use; the message names the file and the key."""


@dataclass(frozen=True)
class ProjectConfig:
    """The settings that apply to one job file, and the file they came from (None: no settings file)."""

    selection: Selection = field(default_factory=Selection)
    strict: bool = False
    path: Path | None = None


def _table(path: Path) -> dict[str, Any] | None:
    """The dsforge settings in ``path``, or None when the file holds none."""
    if sys.version_info >= (3, 11):  # imported here: most validate runs find no settings file to parse
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib

    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_BYTES // 1024} KiB; not a settings file")
    if path.name == "pyproject.toml" and b"dsforge" not in raw:
        return None  # most projects' pyproject has no dsforge table: not worth parsing
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    if path.name == "pyproject.toml":
        tool = data.get("tool")
        table = tool.get("dsforge") if isinstance(tool, dict) else None
    else:
        table = data.get("dsforge", data)
    if table is not None and not isinstance(table, dict):
        raise ConfigError(f"{path}: the dsforge settings must be a table of {', '.join(KEYS)}")
    return table


def _parse(path: Path, table: dict[str, Any]) -> ProjectConfig:
    prefix = "[tool.dsforge]" if path.name == "pyproject.toml" else "dsforge.toml"
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise ConfigError(f"{path}: {prefix} has unknown key(s) {', '.join(map(repr, unknown))}; "
                          f"known: {', '.join(KEYS)}")
    lists: dict[str, list[str]] = {}
    for key in ("select", "ignore"):
        value = table.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path}: {prefix} {key} must be a list of rule ids, e.g. [\"DSF204\"]")
        try:
            lists[key] = parse_ids(value)
            check_known(lists[key])
        except ValueError as exc:
            raise ConfigError(f"{path}: {prefix} {key}: {exc}") from None
    strict = table.get("strict", False)
    if not isinstance(strict, bool):
        raise ConfigError(f"{path}: {prefix} strict must be true or false")
    origin = {p: str(path) for p in (*lists["select"], *lists["ignore"])}
    return ProjectConfig(Selection(tuple(lists["select"]), tuple(lists["ignore"]), origin), strict, path)


@functools.lru_cache(maxsize=256)
def _settings_in(path: Path, mtime_ns: int, size: int) -> ProjectConfig | None:
    """The settings of one file, parsed once per version of it (a run over 1,000 job files reads it once)."""
    table = _table(path)
    return None if table is None else _parse(path, table)


def find_config(start: Path) -> ProjectConfig:
    """The settings that apply to a job file in directory ``start`` (nearest file upwards), or the
    defaults."""
    folder = start.resolve()
    for candidate in (folder, *folder.parents):
        for name in ("dsforge.toml", "pyproject.toml"):
            path = candidate / name
            try:
                st = path.stat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                found = _settings_in(path, st.st_mtime_ns, st.st_size)
                if found is not None:
                    return found
    return ProjectConfig()
