"""Emitted launchers: scripts parse (bash -n) and pass shellcheck, and every file carries the planned
node and process counts (read back by parsing the files and by running the scripts in dry-run mode)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsforge.compiler.emit.interpreter import launch_python
from dsforge.compiler.emit.job_dir import render_job
from dsforge.compiler.plan.plan import Plan
from tests.conftest import EXAMPLES
from tests.test_compile_support import (
    dry_run,
    example_plan,
    flag,
    render_to,
    sbatch_directives,
    variant_plan,
    write_files,
)

SCRIPTS = ("launch.sh", "slurm.sbatch")

#: Launcher set-ups beyond the examples: (base example, changes).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "torchrun-1node": ("tiny-tp2-dp2", {"launch": {"launcher": "torchrun"}}),
    "torchrun-c10d": ("llama3-70b-multinode",
                      {"launch": {"launcher": "torchrun", "master_addr": "node-0.cluster"}}),
    "torchrun-static": ("llama3-70b-multinode", {"launch": {"launcher": "torchrun", "master_addr": "10.0.0.1",
                                                            "rdzv_backend": "static"}}),
    "deepspeed-2node": ("tiny-tp2-dp2", {"hardware": {"nodes": 2, "gpus_per_node": 2},
                                         "launch": {"launcher": "deepspeed",
                                                    "hosts": ["worker-0", "worker-1"],
                                                    "env": {"NCCL_DEBUG": "INFO"}}}),
    "deepspeed-2node-addr": ("tiny-tp2-dp2", {"hardware": {"nodes": 2, "gpus_per_node": 2},
                                              "launch": {"launcher": "deepspeed", "master_addr": "worker-0",
                                                         "hosts": ["worker-0", "worker-1"]}}),
    "slurm-full": ("gpt3-175b-cluster", {"launch": {"account": "proj-1", "time_limit": "2-00:00:00",
                                                    "env": {"NCCL_IB_HCA": "mlx5"}}}),
    "kubernetes-1node": ("llama3-8b-dgx-h100", {"launch": {"launcher": "kubernetes", "image": "img:1",
                                                           "env": {"A": "$(HOME) stays"}}}),
    "slurm-cpu": ("tiny-3d", {"launch": {"launcher": "slurm"}}),
    "local-gpus": ("llama3-8b-dgx-h100", {"launch": {"launcher": "local"}}),
}


def plan_of(case: str, tmp_path: Path) -> Plan:
    if case in VARIANTS:
        base, changes = VARIANTS[case]
        return variant_plan(tmp_path, base, changes)
    return example_plan(case)


CASES = sorted([p.stem for p in EXAMPLES] + list(VARIANTS))


@pytest.fixture
def job_dir(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Plan, Path]:
    plan = plan_of(request.param, tmp_path)
    return plan, render_to(tmp_path / "job", plan)


@pytest.mark.parametrize("job_dir", CASES, indirect=True)
def test_scripts_parse_and_pass_shellcheck(job_dir: tuple[Plan, Path]) -> None:
    _, directory = job_dir
    scripts = [directory / s for s in SCRIPTS if (directory / s).exists()]
    for script in scripts:
        proc = subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    if not scripts:
        return
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    proc = subprocess.run(["shellcheck", "--shell=bash", *map(str, scripts)], check=False,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("job_dir", CASES, indirect=True)
def test_launcher_carries_the_planned_counts(job_dir: tuple[Plan, Path]) -> None:
    plan, directory = job_dir
    launcher = plan.spec.launch.launcher
    nodes, per_node = plan.nodes, plan.gpus_per_node
    if launcher == "kubernetes":
        check_pytorchjob(plan, directory)
        return
    script = directory / ("slurm.sbatch" if launcher == "slurm" else "launch.sh")
    variables, argv = dry_run(script, {"NODE_RANK": "0"})
    assert variables["JOB_NAME"] == plan.spec.name
    for key, value in plan.spec.launch.env.items():
        assert variables[key] == value
    if launcher == "local":
        cpu = plan.spec.hardware.accelerator.name == "cpu"
        assert flag(argv, "nproc_per_node") == str(plan.world_size)
        assert variables.get("DS_ACCELERATOR") == ("cpu" if cpu else None)
    elif launcher == "torchrun":
        assert (flag(argv, "nnodes"), flag(argv, "nproc_per_node")) == (str(nodes), str(per_node))
    elif launcher == "deepspeed":
        assert (flag(argv, "num_nodes"), flag(argv, "num_gpus")) == (str(nodes), str(per_node))
        hosts = (directory / "hostfile").read_text().splitlines()
        assert hosts == [f"{h} slots={per_node}" for h in (plan.spec.launch.hosts or ["localhost"])]
    elif launcher == "slurm":
        directives = sbatch_directives(script.read_text())
        assert directives["nodes"] == str(nodes) and directives["ntasks-per-node"] == "1"
        assert directives.get("gpus-per-node", str(per_node)) == str(per_node)
        assert ("gpus-per-node" in directives) != (plan.spec.hardware.accelerator.name == "cpu")
        assert argv[0] == "srun" and flag(argv, "nodes") == str(nodes)
        assert (flag(argv, "nnodes"), flag(argv, "nproc_per_node")) == (str(nodes), str(per_node))
        assert int(flag(argv, "nnodes")) * int(flag(argv, "nproc_per_node")) == plan.world_size
    python = launch_python(plan.spec)  # the compiling interpreter unless the job names one
    assert argv[argv.index(python) + 1: argv.index(python) + 2] == ["-m"]
    assert argv[-1] == "train.py"


def check_pytorchjob(plan: Plan, directory: Path) -> None:
    config_map, job = yaml.safe_load_all((directory / "pytorchjob.yaml").read_text())
    for name, content in config_map["data"].items():
        assert content == (directory / name).read_text(), name
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1
    assert 1 + specs.get("Worker", {"replicas": 0})["replicas"] == plan.nodes
    assert job["spec"]["nprocPerNode"] == str(plan.gpus_per_node)
    for spec in specs.values():
        container = spec["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch" and container["image"] == plan.spec.launch.image
        assert container["resources"]["limits"][plan.spec.launch.gpu_resource] == plan.gpus_per_node
        script, python = container["command"][2:4]
        # the image's interpreter, never this machine's
        assert python == (plan.spec.launch.python or "python")
        assert f"--nnodes={plan.nodes}" in script and f"--nproc_per_node={plan.gpus_per_node}" in script
        env = {e["name"]: e["value"].replace("$$", "$") for e in container.get("env", [])}
        assert env == dict(plan.spec.launch.env)


def test_multinode_torchrun_meets_at_master_addr(tmp_path: Path) -> None:
    plan = plan_of("torchrun-c10d", tmp_path)
    _, argv = dry_run(render_to(tmp_path / "j", plan) / "launch.sh")
    assert flag(argv, "rdzv_backend") == "c10d" and flag(argv, "rdzv_endpoint") == "node-0.cluster:29500"


def test_static_rendezvous_requires_node_rank(tmp_path: Path) -> None:
    script = render_to(tmp_path / "j", plan_of("torchrun-static", tmp_path)) / "launch.sh"
    _, argv = dry_run(script, {"NODE_RANK": "3"})
    assert flag(argv, "node_rank") == "3" and flag(argv, "master_addr") == "10.0.0.1"
    proc = subprocess.run(["bash", str(script)], env={"DSFORGE_DRY_RUN": "1", "PATH": "/usr/bin:/bin"},
                          check=False, capture_output=True, text=True)
    assert proc.returncode != 0 and "set NODE_RANK" in proc.stderr


def test_deepspeed_multinode_exports_env_and_finds_its_master(tmp_path: Path) -> None:
    files = render_job(plan_of("deepspeed-2node", tmp_path).resolve())
    # the CPU ranks' settings, then the job's own variables, one KEY=VALUE line each
    assert files[".deepspeed_env"].content == "DS_ACCELERATOR=cpu\nNCCL_DEBUG=INFO\nOMP_NUM_THREADS=1\n"
    _, argv = dry_run(write_files(tmp_path / "a", files) / "launch.sh")
    assert not any(a.startswith("--master_addr") for a in argv)  # the runner asks the first host
    assert "--no_ssh_check" not in argv
    _, argv = dry_run(render_to(tmp_path / "b", plan_of("deepspeed-2node-addr", tmp_path)) / "launch.sh")
    assert flag(argv, "master_addr") == "worker-0"


def test_single_node_deepspeed_skips_the_ssh_check(tmp_path: Path) -> None:
    _, argv = dry_run(render_to(tmp_path / "j", example_plan("llama3-8b-dgx-h100")) / "launch.sh")
    assert "--no_ssh_check" in argv and flag(argv, "master_addr") == "127.0.0.1"
    assert "--no_local_rank" in argv and flag(argv, "hostfile") == "hostfile"


def test_slurm_directives_carry_partition_account_time(tmp_path: Path) -> None:
    directory = render_to(tmp_path / "j", plan_of("slurm-full", tmp_path))
    directives = sbatch_directives((directory / "slurm.sbatch").read_text())
    assert directives["partition"] == "train" and directives["account"] == "proj-1"
    assert directives["time"] == "2-00:00:00" and directives["job-name"] == "gpt3-175b"


def test_slurm_script_refuses_to_run_outside_its_job_directory(tmp_path: Path) -> None:
    directory = render_to(tmp_path / "j", example_plan("llama3-70b-multinode"))
    (directory / "plan.json").unlink()
    proc = subprocess.run(["bash", str(directory / "slurm.sbatch")], check=False, capture_output=True,
                          text=True, env={"DSFORGE_DRY_RUN": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "job directory" in proc.stderr
