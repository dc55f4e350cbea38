"""Launch targets of plugins: what a plugin package hands dsforge to start a job on a platform dsforge does
not ship.

A launch target renders the launcher files of a job directory for a scheduler or platform dsforge
does not ship (LSF, a company's job service). It is registered under the ``dsforge.launchers``
entry-point group and selected with ``launch.launcher: <name>``; `dsforge compile` writes its files
next to ds_config.json, plan.json and train.py (dsforge/compiler/emit/launchers.py). This module owns
the table of installed targets and its loader; it never imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dsforge import extensions

#: Launchers dsforge ships; installed plugins can add launch targets (entry points `dsforge.launchers`).
BUILTIN_LAUNCHERS: tuple[str, ...] = ("local", "deepspeed", "torchrun", "slurm", "kubernetes", "accelerate")
#: Launchers that start every rank on the machine they run on (no scheduler, no hostfile, no rendezvous).
SINGLE_MACHINE_LAUNCHERS: tuple[str, ...] = ("local",)
#: Values the emitted launch files can carry (rules/launch.py checks them, emit/render.py relies on them).
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Values an `#SBATCH` directive can carry: sbatch reads directives up to the first non-comment line and
#: splits them on whitespace itself, so they are never shell-quoted (a newline would end the comment).
SBATCH_VALUE = re.compile(r"^[A-Za-z0-9_.:,@+=/-]+$")
#: Kubernetes namespaces are DNS-1123 labels.
DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
#: DeepSpeed's pdsh runner wraps an exported value in double quotes without escaping it
#: (launcher/multinode_runner.py MultiNodeRunner.add_export): these characters would be interpreted
#: by the remote shell; .deepspeed_env is read line by line and each value is stripped.
PDSH_UNSAFE = re.compile(r'["$`\\\n\r]|^\s|\s$')
#: Names a plugin launch target may take (they appear in job files and file names).
TARGET_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")
#: File names a launch target may write: one plain name inside the job directory.
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")


@dataclass(frozen=True)
class LaunchedFile:
    """One file a launch target writes: name in the job directory, text, mode, and what it is for."""

    name: str
    content: str
    executable: bool = False
    purpose: str = ""


@dataclass(frozen=True)
class LaunchTarget:
    """A plugin launcher: ``render(plan, context)`` returns its files.

    ``context`` holds what the built-in launcher templates see (name, launch, nodes,
    gpus_per_node, world_size, env, cpu, hosts, master_addr, version); quote job-file strings with
    ``dsforge.compiler.emit.render.shquote`` where they land in a shell script.
    """

    name: str
    description: str
    render: Callable[[Any, Mapping[str, Any]], Iterable[LaunchedFile]]
    run: str = "./launch.sh"  # the command the job's README tells the user to run


#: Launch targets of plugins by name, with the entry point each came from.
_targets: dict[str, tuple[LaunchTarget, extensions.PluginEntry]] = {}


def _load_plugin_targets(entry: extensions.PluginEntry, load: Callable[[], Any]) -> list[str]:
    """The `dsforge.launchers` loader: names are checked before any is registered; none replaces another."""
    items = extensions.items_of(load(), LaunchTarget)
    for t in items:
        if not TARGET_NAME.match(t.name):
            raise extensions.PluginLoadError(f"launch target name {t.name!r} must match "
                                             f"{TARGET_NAME.pattern}")
        if t.name in BUILTIN_LAUNCHERS or t.name in _targets:
            raise extensions.PluginLoadError(f"launcher {t.name!r} already exists")
    for t in items:
        _targets[t.name] = (t, entry)
    return [f"launcher {t.name}" for t in items]


extensions.register_loader("launchers", _load_plugin_targets)


def launch_target_names() -> list[str]:
    """Names of the launch targets installed plugins offer (loads the launcher plugins once)."""
    extensions.ensure_loaded("launchers")
    return sorted(_targets)


def launch_target(name: str) -> tuple[LaunchTarget, extensions.PluginEntry]:
    """The plugin launch target called ``name`` and the entry point it came from (KeyError if none)."""
    launch_target_names()
    return _targets[name]


def check_file_name(target: str, name: str, reserved: Iterable[str]) -> None:
    """Refuse a launch-target file name that leaves the job directory or replaces a core file."""
    if not FILE_NAME.match(name) or name in (".", ".."):
        raise extensions.PluginLoadError(f"launcher {target!r} wants to write "
                                         f"{name!r}: not a plain file name")
    if name in reserved:
        raise extensions.PluginLoadError(f"launcher {target!r} wants to write "
                                         f"{name!r}, which dsforge itself writes")
