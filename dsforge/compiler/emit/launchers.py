"""The launcher files of each `launch.launcher`, and the values their templates see.

One table row per built-in launcher: which files it writes, from which template, whether they are
executable and what each is for (the job's README lists them). The templates live in
dsforge/templates/launch/. Any other launcher name is the launch target of an installed plugin
(dsforge/compiler/launch_targets.py): its ``render`` is third-party code, so whatever it raises or
returns wrongly becomes an EmitError naming the plugin (compile reports it as DSF699 and writes nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsforge import extensions
from dsforge.compiler.deepspeed.ds_settings import on_cpu
from dsforge.compiler.emit.ds_config import EmitError
from dsforge.compiler.launch_targets import LaunchedFile, check_file_name, launch_target
from dsforge.compiler.plan.plan import ResolvedPlan
from dsforge.version import __version__


@dataclass(frozen=True)
class LaunchFile:
    """One emitted launcher file: its name in the job directory, its template, its mode and purpose.

    ``content`` is set instead of a template for the files of a plugin's launch target, which
    renders them itself (dsforge/compiler/launch_targets.py).
    """

    name: str
    template: str
    executable: bool
    purpose: str
    content: str | None = None


#: Files every job directory has, whatever the launcher (a launch target may not write them).
CORE_FILES = ("README.md", "ds_config.json", "plan.json", "train.py")
_SCRIPT = "the launcher: run it to start every rank"
LAUNCHERS: dict[str, tuple[LaunchFile, ...]] = {
    "local": (LaunchFile("launch.sh", "launch/local.sh.j2", True, _SCRIPT),),
    "torchrun": (LaunchFile("launch.sh", "launch/torchrun.sh.j2", True, _SCRIPT),),
    "deepspeed": (
        LaunchFile("launch.sh", "launch/deepspeed.sh.j2", True, _SCRIPT),
        LaunchFile("hostfile", "launch/hostfile.j2", False, "DeepSpeed's hostfile: one "
                                                            "line per node, its slots"),
    ),
    "slurm": (LaunchFile("slurm.sbatch", "launch/slurm.sbatch.j2", True, "the SLURM batch script (sbatch)"),),
    "kubernetes": (LaunchFile("pytorchjob.yaml", "launch/pytorchjob.yaml.j2", False,
                              "a ConfigMap with this directory's files and the Kubeflow PyTorchJob"),),
    # `accelerate launch` with the job's DeepSpeed config; launch.sh takes any Accelerate/HF script
    # as its first argument (README "Accelerate"), train.py otherwise.
    "accelerate": (
        LaunchFile("launch.sh", "launch/accelerate.sh.j2", True,
                   _SCRIPT + " (`./launch.sh my_script.py` runs yours)"),
        LaunchFile("accelerate_config.yaml", "launch/accelerate_config.yaml.j2", False,
                   "`accelerate launch --config_file` for DeepSpeed with ds_config.json"),
    ),
}
#: DeepSpeed's pdsh runner exports this file's variables on the other nodes (launcher/runner.py
#: DEEPSPEED_ENVIRONMENT_NAME, read from the working directory).
DEEPSPEED_ENV = LaunchFile(".deepspeed_env", "launch/deepspeed_env.j2", False,
                           "variables DeepSpeed's launcher exports on every node")


def launch_files(plan: ResolvedPlan) -> tuple[LaunchFile, ...]:
    """The launcher files of this plan's launcher (.deepspeed_env only when multi-node needs it)."""
    launch = plan.spec.launch
    if launch.launcher not in LAUNCHERS:
        return plugin_launch_files(plan, launch_context(plan))
    files = LAUNCHERS[launch.launcher]
    if launch.launcher == "deepspeed" and plan.nodes > 1 and rank_env(plan):
        files += (DEEPSPEED_ENV,)
    return files


def rank_env(plan: ResolvedPlan) -> list[tuple[str, str]]:
    """Environment of every rank, sorted: the CPU settings dsforge needs, then the job's `launch.env` over
    them."""
    env: dict[str, str] = {}
    if on_cpu(plan):
        # DeepSpeed picks its accelerator from DS_ACCELERATOR (accelerator/real_accelerator.py); one
        # OpenMP thread per rank keeps world_size processes from oversubscribing the cores.
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.update(plan.spec.launch.env)
    return sorted(env.items())


def launch_context(plan: ResolvedPlan) -> dict[str, Any]:
    """The values the launcher templates see (all quoting happens in the templates' filters)."""
    launch = plan.spec.launch
    explicit_addr = "master_addr" in launch.model_fields_set
    return {
        "name": plan.spec.name,
        "launch": launch,
        "nodes": plan.nodes,
        "gpus_per_node": plan.gpus_per_node,
        "world_size": plan.world_size,
        "env": rank_env(plan),
        "cpu": on_cpu(plan),
        "hosts": list(launch.hosts) or ["localhost"],
        "master_addr": launch.master_addr if explicit_addr else None,
        **_plugin_context(plan),
    }


def _plugin_context(plan: ResolvedPlan) -> dict[str, Any]:
    """What the accelerate launcher (its config text) and plugin launch targets (their run command) add to the
    context (nothing for the others)."""
    name = plan.spec.launch.launcher
    if name == "accelerate":
        from dsforge.compiler.emit.accelerate_config import accelerate_config_yaml

        return {"accelerate_yaml": accelerate_config_yaml(plan).rstrip("\n")}
    if name in LAUNCHERS:
        return {}
    try:
        target, _ = launch_target(name)
    except KeyError:
        return {"plugin_run": ""}
    return {"plugin_run": target.run}


def plugin_launch_files(plan: ResolvedPlan, context: dict[str, Any]) -> tuple[LaunchFile, ...]:
    """Render the files of the plan's plugin launch target (EmitError when it is missing or misbehaves)."""
    name = plan.spec.launch.launcher
    try:
        target, entry = launch_target(name)
    except KeyError:
        raise EmitError(f"no installed plugin offers the launcher {name!r} "
                        f"(`dsforge plugins` lists them)") from None
    try:
        produced = list(target.render(plan, {**context, "version": __version__}))
    except Exception as exc:  # third-party code: any failure becomes a report naming the plugin
        raise EmitError(f"launcher {name!r} of {entry.label} failed: {type(exc).__name__}: {exc}") from exc
    out: list[LaunchFile] = []
    for f in produced:
        if not isinstance(f, LaunchedFile) or not isinstance(f.content, str):
            raise EmitError(f"launcher {name!r} of {entry.label} returned "
                            f"{type(f).__name__}, not LaunchedFile")
        try:
            check_file_name(name, f.name, (*CORE_FILES, *(o.name for o in out)))
        except extensions.PluginLoadError as exc:
            raise EmitError(f"{exc} ({entry.label})") from None
        out.append(LaunchFile(f.name, "", f.executable, f.purpose or f"written by launcher {name!r}",
                              f.content))
    if not out:
        raise EmitError(f"launcher {name!r} of {entry.label} wrote no files")
    return tuple(out)
