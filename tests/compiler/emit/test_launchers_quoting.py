"""Arbitrary strings from the job file (names, interpreter path, addresses, env values, checkpoint and data
paths) leave every emitted file parseable and arrive literally: scripts pass `bash -n` and, run in
dry-run mode, report exactly the strings; the manifest and plan.json load back to exactly them."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsforge.compiler.emit.job_dir import JobFile, render_job
from dsforge.compiler.emit.render import EmitError, shquote
from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.plan.plan import build_plan
from dsforge.compiler.spec.schema import JobSpec
from tests.test_compile_support import dry_run, example_path, flag, sbatch_directives, write_files

#: Every launcher on a small base (planning a tiny job keeps each example fast).
BASES: dict[str, tuple[str, dict[str, Any]]] = {
    "local": ("tiny-tp2-dp2", {}),
    "torchrun": ("tiny-tp2-dp2", {"hardware": {"nodes": 2, "gpus_per_node": 2}}),
    "deepspeed": ("tiny-tp2-dp2", {}),
    "slurm": ("tiny-3d", {}),
    "kubernetes": ("tiny-moe-ep2", {"launch": {"image": "img"}}),
}
DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")

# Any text a YAML job file can carry except NUL (DSF604 refuses it; see the last test).
text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), min_size=1, max_size=24)


def base_dump(launcher: str) -> dict[str, Any]:
    name, changes = BASES[launcher]
    job, _ = load_job(example_path(name))
    assert job is not None
    data = job.spec.model_dump(mode="json", by_alias=True)
    for section, values in changes.items():
        data[section].update(values)
    data["launch"]["launcher"] = launcher
    return data


DUMPS = {launcher: base_dump(launcher) for launcher in BASES}


def build(launcher: str, name: str, python: str, addr: str, value: str, path: str) -> dict[str, JobFile]:
    data = copy.deepcopy(DUMPS[launcher])
    data["name"] = name
    data["launch"].update(python=python, master_addr=addr, env={"DSF_VALUE": value})
    data["training"]["checkpoint"]["dir"] = path
    data["training"]["data"]["path"] = path
    return render_job(build_plan(JobSpec.model_validate(data)).resolve())


def leading_directives(script: str) -> list[str]:
    """The #SBATCH lines sbatch reads: those before the first line that is neither comment nor blank."""
    out = []
    for line in script.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            out.append(line)
    return out


def check_plan_json(content: str, name: str, path: str) -> None:
    doc = json.loads(content)
    assert doc["name"] == doc["job"]["name"] == name
    assert doc["job"]["training"]["checkpoint"]["dir"] == doc["job"]["training"]["data"]["path"] == path


@pytest.mark.parametrize("launcher", sorted(BASES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=text, python=text, addr=text, value=text, path=text)
def test_strings_arrive_literally(launcher: str, name: str, python: str, addr: str, value: str,
                                  path: str) -> None:
    files = build(launcher, name, python, addr, value, path)
    check_plan_json(files["plan.json"].content, name, path)
    if launcher == "kubernetes":
        check_manifest({n: f.content for n, f in files.items()}, name, python, value)
        return
    script_name = "slurm.sbatch" if launcher == "slurm" else "launch.sh"
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_files(Path(tmp), files)
        script = directory / script_name
        parsed = subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True)
        assert parsed.returncode == 0, parsed.stderr
        variables, argv = dry_run(script)
    assert variables["JOB_NAME"] == name and variables["DSF_VALUE"] == value
    assert python in argv and argv[-1] == "train.py"
    if launcher == "torchrun":
        assert flag(argv, "rdzv_endpoint") == f"{addr}:29500"
    if launcher == "slurm":
        script_text = files["slurm.sbatch"].content
        assert DNS_LABEL.match(sbatch_directives(script_text)["job-name"])
        reference = build(launcher, "ref", "python", "h", "v", "p")["slurm.sbatch"].content
        assert [d.split("=")[0] for d in leading_directives(script_text)] == [
            d.split("=")[0] for d in leading_directives(reference)]


def check_manifest(files: dict[str, str], name: str, python: str, value: str) -> None:
    config_map, job = yaml.safe_load_all(files["pytorchjob.yaml"])
    assert DNS_LABEL.match(job["metadata"]["name"]) and config_map["metadata"]["name"].startswith(
        job["metadata"]["name"])
    assert config_map["data"]["plan.json"] == files["plan.json"]
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    # Kubernetes turns $$ into $ in command, args and env values (and expands $(VAR) otherwise)
    assert container["command"][3].replace("$$", "$") == python
    env = {e["name"]: e["value"].replace("$$", "$") for e in container["env"]}
    assert env["DSF_VALUE"] == value
    assert json.loads(config_map["data"]["plan.json"])["name"] == name


def test_shquote_refuses_nul() -> None:
    with pytest.raises(EmitError, match="NUL"):
        shquote("a\x00b")


def test_sbatch_directives_refuse_what_sbatch_cannot_carry() -> None:
    data = copy.deepcopy(DUMPS["slurm"])
    data["launch"]["partition"] = "gpu\nrm -rf ~"
    with pytest.raises(EmitError, match="SBATCH"):
        render_job(build_plan(JobSpec.model_validate(data)).resolve())
