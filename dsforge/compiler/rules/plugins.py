"""DSF701: installed plugins that failed to load.

Registered whether or not any plugin failed, so the rule set, and docs/rules.md generated from it, do not
depend on the installation.
"""

from __future__ import annotations

from collections.abc import Iterator

from dsforge import extensions
from dsforge.compiler.rules.registry import Context, Finding, rule
from dsforge.diagnostics import Severity


@rule("DSF701", "an installed dsforge plugin failed to load", severity=Severity.WARNING,
      source="dsforge/extensions.py")
def _broken_plugins(ctx: Context) -> Iterator[Finding]:
    """A plugin that fails to load is skipped: its presets, rules, policies or launchers are missing.

    Reported with every job so a broken installation does not pass unnoticed (`dsforge plugins`
    lists every plugin and its state).
    """
    for rec in extensions.failures():
        yield Finding(f"plugin {rec.entry.name!r} from {rec.entry.label} failed to load and was skipped: "
                      f"{rec.error}", "fix or uninstall the plugin (`dsforge plugins` lists every plugin)")
