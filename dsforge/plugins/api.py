"""What a plugin package hands dsforge besides presets, rules and policies: launch targets.

A launch target renders the launcher files of a job directory for a scheduler or platform dsforge
does not ship (LSF, a company's job service). It is registered under the ``dsforge.launchers``
entry-point group and selected with ``launch.launcher: <name>``; `dsforge compile` writes its files
next to ds_config.json, plan.json and train.py. This module never imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

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
