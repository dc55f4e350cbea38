"""Third-party extensions through Python entry points: discovery, loading, and what each plugin added.

The bottom layer of dsforge: it imports nothing else of the package. Four entry-point groups, one per
extension point; the module that owns each table registers the loader that fills it
(`register_loader`), so this module never reaches up into the tables:

* ``dsforge.presets`` an iterable of ``dsforge.compiler.frontend.presets.Preset`` (or a callable returning
  one); loader in dsforge/compiler/frontend/presets.py
* ``dsforge.rules``     a module or callable whose import/call registers rules with ``@rule``;
  loader in dsforge/compiler/rules/registry.py
* ``dsforge.rewrite_policies``  a ``Policy`` or an iterable of them (or a callable returning one);
  loader in dsforge/compiler/model/rewrite_policies.py
* ``dsforge.launchers`` a ``dsforge.compiler.launch_targets.LaunchTarget`` or an iterable of them;
  loader in dsforge/compiler/launch_targets.py

Discovery is a plain scan of the ``*.dist-info``/``*.egg-info`` folders on ``sys.path`` for an
``entry_points.txt`` that mentions ``[dsforge.``: ~2 ms, where ``importlib.metadata.entry_points()``
parses every installed distribution's metadata (~30 ms, a tenth of a `dsforge validate`). A group is
loaded only when a lookup first needs it. A plugin that fails — on import, or by returning the wrong
thing — is recorded with its error and contributes nothing; the other plugins still load.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

#: Extension point -> entry-point group.
GROUPS: dict[str, str] = {
    "presets": "dsforge.presets",
    "rules": "dsforge.rules",
    "policies": "dsforge.rewrite_policies",
    "launchers": "dsforge.launchers",
}
_MARK = b"[dsforge."


class PluginEntry(NamedTuple):
    """One entry point of an installed distribution."""

    kind: str
    name: str
    value: str
    dist: str
    version: str
    location: str

    @property
    def label(self) -> str:
        """Where it came from, as `dsforge plugins` and diagnostics print it."""
        return f"{self.dist} {self.version} ({GROUPS[self.kind]}: {self.name} = {self.value})"


class LoadRecord:
    """The outcome of loading one entry point: what it added, or why it was skipped.

    A plain class, not a dataclass: this module is imported by every `dsforge validate`, and
    generating a dataclass costs more start-up than the whole entry-point scan.
    """

    __slots__ = ("entry", "error", "provides")

    def __init__(self, entry: PluginEntry, provides: list[str] | None = None,
                 error: str | None = None) -> None:
        self.entry, self.provides, self.error = entry, provides or [], error

    @property
    def ok(self) -> bool:
        """True when the entry point loaded and registered everything it offered."""
        return self.error is None


class PluginLoadError(Exception):
    """A plugin offered something dsforge cannot register; the message says what and why."""


_entries: list[PluginEntry] | None = None
_records: dict[str, list[LoadRecord]] = {}
_loaders: dict[str, Callable[[PluginEntry, Callable[[], Any]], list[str]]] = {}


def _parse_entry_points(text: str) -> Iterable[tuple[str, str, str]]:
    """(group, name, value) of an entry_points.txt (an INI file; comments start with # or ;)."""
    group = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            group = line[1:-1].strip()
        elif "=" in line and group:
            name, _, value = line.partition("=")
            yield group, name.strip(), value.strip()


def _dist_name_version(path: str, folder: str) -> tuple[str, str]:
    """Name and version from the metadata file, else from the folder's name (``name-1.0.dist-info``)."""
    stem = folder.rsplit(".", 1)[0]
    name, _, version = stem.partition("-")
    fields = {"Name": name, "Version": version.split("-")[0] or "?"}
    for meta in ("METADATA", "PKG-INFO"):  # only read for plugin distributions: a handful of files
        try:
            with open(os.path.join(path, meta), encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if not line.strip():
                        break  # the headers end at the first blank line
                    key, _, value = line.partition(":")
                    if key in fields and value.strip():
                        fields[key] = value.strip()
            break
        except OSError:
            continue
    return fields["Name"], fields["Version"]


def _scan_folder(base: str) -> Iterable[tuple[str, str, str]]:
    """(metadata folder path, its name, entry_points.txt text) of the distributions under ``base`` with
    dsforge plugins."""
    try:
        listing = os.scandir(base or ".")
    except OSError:
        return
    with listing:
        folders = sorted(e.name for e in listing if e.name.endswith((".dist-info", ".egg-info")))
    for folder in folders:
        path = os.path.join(base or ".", folder)
        try:
            with open(os.path.join(path, "entry_points.txt"), "rb") as fh:
                data = fh.read()
        except OSError:  # most distributions have none
            continue
        if _MARK in data:
            yield path, folder, data.decode("utf-8", "replace")


def discover(paths: list[str] | None = None) -> list[PluginEntry]:
    """Every dsforge entry point on ``paths`` (default: sys.path); the first copy of a distribution wins."""
    global _entries
    if paths is None and _entries is not None:
        return _entries
    kinds = {group: kind for kind, group in GROUPS.items()}
    seen: set[str] = set()
    found: list[PluginEntry] = []
    for base in sys.path if paths is None else paths:
        for path, folder, text in _scan_folder(base):
            dist, version = _dist_name_version(path, folder)
            key = re.sub(r"[-_.]+", "_", dist).lower()  # PEP 503 normalisation
            if key in seen:  # shadowed by an earlier sys.path entry, as the import system would
                continue
            seen.add(key)
            found += [PluginEntry(kinds[g], n, v, dist, version, path) for g, n,
                      v in _parse_entry_points(text) if g in kinds]
    if paths is None:
        _entries = found
    return found


def register_loader(kind: str, loader: Callable[[PluginEntry, Callable[[], Any]], list[str]]) -> None:
    """Set how one extension point registers a plugin: given the entry and a function importing its object,
    return the names it added, or raise to refuse the plugin."""
    _loaders[kind] = loader


def load_object(entry: PluginEntry) -> Any:
    """Import the entry point's object (``module`` or ``module:attr.attr``)."""
    import importlib

    module_name, _, attrs = entry.value.partition(":")
    obj: Any = importlib.import_module(module_name.strip())
    for attr in filter(None, attrs.strip().split(".")):
        obj = getattr(obj, attr)
    return obj


def _load_one(entry: PluginEntry) -> LoadRecord:
    record = LoadRecord(entry)
    try:
        record.provides = _loaders[entry.kind](entry, lambda: load_object(entry))
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure of third-party code skips that plugin only
        record.error = f"{type(exc).__name__}: {exc}"
    return record


def ensure_loaded(kind: str) -> list[LoadRecord]:
    """Load every plugin of one extension point once (its owner must have registered the loader);
    later calls return the same records."""
    if kind not in _records:
        if kind not in _loaders:
            raise KeyError(f"no loader registered for the extension point {kind!r}: import its owner first")
        _records[kind] = []  # set first: a plugin whose import triggers a lookup must not recurse
        _records[kind] = [_load_one(e) for e in discover() if e.kind == kind]
    return _records[kind]


def load_all() -> list[LoadRecord]:
    """Load every extension point's plugins and return all records, in group order (the owners of all
    four tables must be imported: dsforge.commands.plugins does that)."""
    return [r for kind in GROUPS for r in ensure_loaded(kind)]


def items_of(obj: Any, kind: type) -> list[Any]:
    """The items an entry point offers: one instance, an iterable of them, or a callable returning either."""
    if callable(obj) and not isinstance(obj, kind):
        obj = obj()
    if isinstance(obj, kind):
        return [obj]
    if isinstance(obj, (str, bytes, dict)) or not isinstance(obj, Iterable):
        raise PluginLoadError(f"expected {kind.__name__} objects (or an "
                              f"iterable of them), got {type(obj).__name__}")
    items = list(obj)
    wrong = [type(i).__name__ for i in items if not isinstance(i, kind)]
    if wrong:
        raise PluginLoadError(f"expected {kind.__name__} objects, got {', '.join(sorted(set(wrong)))}")
    return items


def origin_label(entry: PluginEntry) -> str:
    """How a registered item records the plugin it came from (``plugin <dist> <version>``)."""
    return f"plugin {entry.dist} {entry.version}"


def failures() -> list[LoadRecord]:
    """The plugins loaded so far that failed."""
    return [r for records in _records.values() for r in records if not r.ok]

