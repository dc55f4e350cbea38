"""The launcher files of a plugin's launch target, for `dsforge compile` (torch-free).

The target's ``render`` is third-party code: whatever it raises or returns wrongly becomes an
EmitError naming the plugin (compile reports it as DSF699 and writes nothing).
"""

from __future__ import annotations

from typing import Any

from dsforge import __version__
from dsforge.compiler.emit.ds_config import EmitError
from dsforge.compiler.emit.launchers import LaunchFile
from dsforge.compiler.plan import Plan
from dsforge.plugins.api import LaunchedFile
from dsforge.plugins.extensions import check_file_name, launch_target
from dsforge.plugins.registry import PluginLoadError


def plugin_launch_files(plan: Plan, context: dict[str, Any]) -> tuple[LaunchFile, ...]:
    """Render the files of the plan's plugin launch target (EmitError when it is missing or misbehaves)."""
    from dsforge.compiler.emit.job_dir import CORE_FILES

    name = plan.spec.launch.launcher
    try:
        target, entry = launch_target(name)
    except KeyError:
        raise EmitError(f"no installed plugin offers the launcher {name!r} (`dsforge plugins` lists them)") from None
    try:
        produced = list(target.render(plan, {**context, "version": __version__}))
    except Exception as exc:  # third-party code: any failure becomes a report naming the plugin
        raise EmitError(f"launcher {name!r} of {entry.label} failed: {type(exc).__name__}: {exc}") from exc
    out: list[LaunchFile] = []
    for f in produced:
        if not isinstance(f, LaunchedFile) or not isinstance(f.content, str):
            raise EmitError(f"launcher {name!r} of {entry.label} returned {type(f).__name__}, not LaunchedFile")
        try:
            check_file_name(name, f.name, (*CORE_FILES, *(o.name for o in out)))
        except PluginLoadError as exc:
            raise EmitError(f"{exc} ({entry.label})") from None
        out.append(LaunchFile(f.name, "", f.executable, f.purpose or f"written by launcher {name!r}", f.content))
    if not out:
        raise EmitError(f"launcher {name!r} of {entry.label} wrote no files")
    return tuple(out)


def launcher_context(plan: Plan) -> dict[str, Any]:
    """Template values of the `accelerate` launcher (its config text) and of plugin targets (their run command)."""
    name = plan.spec.launch.launcher
    if name == "accelerate":
        from dsforge.plugins.accelerate_config import accelerate_config_yaml

        return {"accelerate_yaml": accelerate_config_yaml(plan).rstrip("\n")}
    try:
        target, _ = launch_target(name)
    except KeyError:
        return {"plugin_run": ""}
    return {"plugin_run": target.run}
