"""How each extension point registers what a plugin offers, and refuses what it cannot take.

A loader gets the entry point and a function that imports its object; it registers every item or
raises, and then the registry records the plugin as failed. Loaders check all items before they
register any (the rules loader, whose plugins register on import, removes what a failing import
left behind), so a failed plugin contributes nothing. Names a plugin may not take: a built-in preset, rule id, model
family or launcher (a plugin extends dsforge; it does not silently replace what a job file means).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from dsforge.compiler.presets import KINDS, Preset
from dsforge.plugins.api import FILE_NAME, TARGET_NAME, LaunchTarget
from dsforge.plugins.registry import PluginEntry, PluginLoadError, register_loader

Loader = Callable[[], Any]

#: Launch targets of plugins by name, with the entry point each came from.
_launch_targets: dict[str, tuple[LaunchTarget, PluginEntry]] = {}


def _items(obj: Any, kind: type) -> list[Any]:
    """The items an entry point offers: one instance, an iterable of them, or a callable returning either."""
    if callable(obj) and not isinstance(obj, kind):
        obj = obj()
    if isinstance(obj, kind):
        return [obj]
    if isinstance(obj, (str, bytes, dict)) or not isinstance(obj, Iterable):
        raise PluginLoadError(f"expected {kind.__name__} objects (or an iterable of them), got {type(obj).__name__}")
    items = list(obj)
    wrong = [type(i).__name__ for i in items if not isinstance(i, kind)]
    if wrong:
        raise PluginLoadError(f"expected {kind.__name__} objects, got {', '.join(sorted(set(wrong)))}")
    return items


def _load_presets(entry: PluginEntry, load: Loader) -> list[str]:
    from dsforge.compiler import presets as table

    items = _items(load(), Preset)
    for p in items:
        if p.kind not in KINDS:
            raise PluginLoadError(f"preset {p.name!r} has kind {p.kind!r}; use one of {', '.join(KINDS)}")
        if not isinstance(p.spec, dict):
            raise PluginLoadError(f"preset {p.name!r}: spec must be a mapping of job-file keys")
        # _builtin, not presets(): this runs inside the first presets() lookup.
        if p.name in table._builtin(p.kind):
            raise PluginLoadError(f"{p.kind} preset {p.name!r} would replace dsforge's built-in preset")
    for p in items:
        table.register(dataclasses.replace(p, origin=f"plugin {entry.dist} {entry.version}"))
    return [f"{p.kind} preset {p.name}" for p in items]


def _load_rules(entry: PluginEntry, load: Loader) -> list[str]:
    from dsforge.compiler.rules import registry

    table = registry._RULES  # the registry's own table: attribute the new rules, roll back a failed import
    before = dict(table)
    try:
        obj = load()  # a module registers its rules on import
        if callable(obj):
            obj()  # a `register()` function registers them when called
    except Exception:
        _restore(table, before)
        raise
    added = sorted(set(table) - set(before))
    if not added:
        raise PluginLoadError("registered no rules (decorate check functions with dsforge's @rule)")
    for rid in added:
        table[rid] = dataclasses.replace(table[rid], origin=f"plugin {entry.dist} {entry.version}")
    return [f"rule {rid}" for rid in added]


def _restore(table: dict[str, Any], before: dict[str, Any]) -> None:
    for rid in set(table) - set(before):
        del table[rid]


def _load_policies(entry: PluginEntry, load: Loader) -> list[str]:
    from dsforge.compiler.rewrite_policies import POLICIES, Policy, register_policy

    items = _items(load(), Policy)
    for p in items:
        if p.arch in POLICIES:
            raise PluginLoadError(f"a rewrite policy for arch {p.arch!r} already exists")
    for p in items:
        register_policy(p)
    return [f"rewrite policy {p.arch}" for p in items]


def _load_launchers(entry: PluginEntry, load: Loader) -> list[str]:
    from dsforge.compiler.schema import BUILTIN_LAUNCHERS

    items = _items(load(), LaunchTarget)
    for t in items:
        if not TARGET_NAME.match(t.name):
            raise PluginLoadError(f"launch target name {t.name!r} must match {TARGET_NAME.pattern}")
        if t.name in BUILTIN_LAUNCHERS or t.name in _launch_targets:
            raise PluginLoadError(f"launcher {t.name!r} already exists")
    for t in items:
        _launch_targets[t.name] = (t, entry)
    return [f"launcher {t.name}" for t in items]


def install_loaders() -> None:
    """Register the four loaders with the registry (idempotent)."""
    register_loader("presets", _load_presets)
    register_loader("rules", _load_rules)
    register_loader("policies", _load_policies)
    register_loader("launchers", _load_launchers)


def launch_target_names() -> list[str]:
    """Names of the launch targets installed plugins offer (loads the launcher plugins once)."""
    from dsforge.plugins.registry import ensure_loaded

    ensure_loaded("launchers")
    return sorted(_launch_targets)


def launch_target(name: str) -> tuple[LaunchTarget, PluginEntry]:
    """The plugin launch target called ``name`` and the entry point it came from (KeyError if none)."""
    launch_target_names()
    return _launch_targets[name]


def check_file_name(target: str, name: str, reserved: Iterable[str]) -> None:
    """Refuse a launch-target file name that leaves the job directory or replaces a core file."""
    if not FILE_NAME.match(name) or name in (".", ".."):
        raise PluginLoadError(f"launcher {target!r} wants to write {name!r}: not a plain file name")
    if name in reserved:
        raise PluginLoadError(f"launcher {target!r} wants to write {name!r}, which dsforge itself writes")


def report_failed_plugins() -> None:
    """Register rule DSF701, which reports every plugin that failed to load (call when some did)."""
    from dsforge.compiler.rules.registry import rule
    from dsforge.diagnostics import Severity
    rule("DSF701", "an installed dsforge plugin failed to load", severity=Severity.WARNING,
         source="dsforge/plugins/registry.py")(_broken_plugins)


def _broken_plugins(ctx: Any) -> Iterable[Any]:
    """A plugin that fails to load is skipped: its presets, rules, policies or launchers are missing.

    Reported with every job so a broken installation does not pass unnoticed (`dsforge plugins`
    lists every plugin and its state).
    """
    from dsforge.compiler.rules.registry import Finding
    from dsforge.plugins.registry import failures

    for rec in failures():
        yield Finding(f"plugin {rec.entry.name!r} from {rec.entry.label} failed to load and was skipped: "
                      f"{rec.error}", "fix or uninstall the plugin (`dsforge plugins` lists every plugin)")
