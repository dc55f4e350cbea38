"""Hardware and model presets, shipped as YAML data inside the package (each file cites its sources)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from dsforge import extensions

try:
    from yaml import CSafeLoader as _Loader
except ImportError:  # pragma: no cover
    from yaml import SafeLoader as _Loader  # type: ignore[assignment]

KINDS = ("hardware", "models")


@dataclass(frozen=True)
class Preset:
    """One named preset: the job-file keys it supplies and where they come from."""

    kind: str
    name: str
    description: str
    spec: dict[str, Any]
    origin: str


@cache
def _builtin(kind: str) -> dict[str, Preset]:
    out: dict[str, Preset] = {}
    # A plain path, not importlib.resources: the data ships inside the package directory and the
    # resources machinery costs ~10 ms of start-up that `dsforge validate` does not need.
    folder = Path(__file__).resolve().parents[2] / "presets" / kind
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        if not entry.name.endswith(".yaml"):
            continue
        data = yaml.load(entry.read_text(encoding="utf-8"), Loader=_Loader) or {}
        for name, body in data.items():
            out[name] = Preset(kind, name, body.get("description", ""), body["spec"],
                               f"dsforge/{kind}/{entry.name}")
    return out


_extra: dict[str, dict[str, Preset]] = {k: {} for k in KINDS}


def register(preset: Preset) -> None:
    """Add a preset from outside the package (plugins); a later registration wins."""
    _extra[preset.kind][preset.name] = preset


def presets(kind: str) -> dict[str, Preset]:
    """All presets of one kind ("hardware" or "models"), built-in first, then those of installed plugins."""
    extensions.ensure_loaded("presets")  # entry points are read on the first lookup, not at import (start-up
                                         # time)
    return {**_builtin(kind), **_extra[kind]}


def _load_plugin_presets(entry: extensions.PluginEntry, load: Callable[[], Any]) -> list[str]:
    """The `dsforge.presets` loader: check every preset of the plugin, then register them all (or none)."""
    items = extensions.items_of(load(), Preset)
    for p in items:
        if p.kind not in KINDS:
            raise extensions.PluginLoadError(f"preset {p.name!r} has kind {p.kind!r}; "
                                             f"use one of {', '.join(KINDS)}")
        if not isinstance(p.spec, dict):
            raise extensions.PluginLoadError(f"preset {p.name!r}: spec must be a mapping of job-file keys")
        # _builtin, not presets(): this runs inside the first presets() lookup.
        if p.name in _builtin(p.kind):
            raise extensions.PluginLoadError(f"{p.kind} preset {p.name!r} would "
                                             f"replace dsforge's built-in preset")
    for p in items:
        register(dataclasses.replace(p, origin=extensions.origin_label(entry)))
    return [f"{p.kind} preset {p.name}" for p in items]


extensions.register_loader("presets", _load_plugin_presets)
