"""Accelerate integration: the plugin holds the compiled ds_config, `dsforge compile` writes an accelerate
launch config that accelerate's own parser accepts, and the compiled launch.sh trains on 2 CPU processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

pytest.importorskip("accelerate")
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType

from dsforge.commands.compile import compile_file
from dsforge.plugins.accelerate import check_accelerator, deepspeed_plugin
from dsforge.plugins.job import PlanMismatchError
from tests.plugins.conftest import ROOT

EXAMPLE = ROOT / "examples" / "trainers" / "accelerate"


def compiled(tmp: Path, job: Path = EXAMPLE / "job.yaml") -> Path:
    out = tmp / "job-dir"
    result = compile_file(job, out)
    assert result.written, [d.message for d in result.diagnostics]
    return out


def test_plugin_config_is_the_compiled_ds_config_key_for_key(tmp_path: Path) -> None:
    plugin = deepspeed_plugin(EXAMPLE / "job.yaml")
    assert plugin.deepspeed_config == json.loads((compiled(tmp_path) / "ds_config.json").read_text())
    assert (
        plugin.zero_stage == 1 and plugin.gradient_accumulation_steps == 2 and plugin.zero3_init_flag is False
    )


def dry_run(launch: Path, *args: str) -> list[str]:
    """The command the compiled launch.sh would run (its DSFORGE_DRY_RUN mode), after the `--`."""
    out = subprocess.run([str(launch), *args], env={**os.environ, "DSFORGE_DRY_RUN": "1", "NODE_RANK": "1"},
                         capture_output=True, check=True).stdout.decode().split("\0")
    return [w for w in out[out.index("--") + 1:] if w]


def test_compiled_launcher_is_accepted_by_accelerate_launch(tmp_path: Path) -> None:
    out = compiled(tmp_path)
    cmd = dry_run(out / "launch.sh", "my_train.py", "--lr", "3")
    assert cmd[1:3] == ["-m", "accelerate.commands.launch"] and cmd[-3:] == ["my_train.py", "--lr", "3"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(cmd[3:]))
    assert args.use_deepspeed and args.num_processes == 2 and args.num_machines == 1
    assert args.deepspeed_config_file == str(out / "ds_config.json") and args.main_process_port == 29500
    assert dry_run(out / "launch.sh")[-1] == str(out / "train.py")  # no script: dsforge's own entry point


def test_multi_node_config_names_the_master_and_each_node_its_rank(tmp_path: Path) -> None:
    doc = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    doc["hardware"]["nodes"] = 2
    doc["launch"].update(master_addr="node0", master_port=6000)
    job = tmp_path / "multi.yaml"
    job.write_text(yaml.safe_dump(doc))
    out = compiled(tmp_path, job)
    cmd = dry_run(out / "launch.sh", "t.py")
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(cmd[3:]))
    assert (args.num_processes, args.num_machines, args.machine_rank) == (4, 2, 1)
    assert (args.main_process_ip, args.main_process_port,
            args.deepspeed_multinode_launcher) == ("node0", 6000,
                                                                                                  "standard")


def test_check_names_a_world_accelerate_got_wrong(tmp_path: Path) -> None:
    """accelerate's own CPU default: one process per world and no DeepSpeed; the check says so."""
    acc = SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO, state=None)
    with pytest.raises(PlanMismatchError, match=r"(?s)world size: the Accelerator has 1, the job file plans "
                                                r"2.*ZeRO stage: the Accelerator has none \(accelerate runs"):
        check_accelerator(EXAMPLE / "job.yaml", acc)


@pytest.mark.slow
def test_compiled_launch_sh_trains_the_example_on_two_processes(tmp_path: Path) -> None:
    out = compiled(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # launch.sh exports DS_ACCELERATOR=cpu itself
    # launch.sh runs `python` (launch.python): make it this interpreter, which has accelerate, as CI does not
    # activate the virtualenv.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    summary = tmp_path / "summary.json"
    proc = subprocess.run([str(out / "launch.sh"), str(EXAMPLE / "train_accelerate.py"),
                           str(EXAMPLE / "job.yaml"), "--summary",
                           str(summary)], check=False, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(summary.read_text())
    assert got["world"] == 2 and got["optimizer_steps"] == 4 and len(got["losses"]) == 8  # 4 steps x 2 micro
    assert all(5.0 < loss < 6.0 for loss in got["losses"])
    # What accelerate handed deepspeed.initialize: the compiled config, plus the disabled dtype sections
    # accelerate's set_mixed_precision writes for every dtype a config does not mention.
    expected = json.loads((out / "ds_config.json").read_text())
    assert got["ds_config"] == {**expected, "fp16": {"enabled": False}, "bf16": {"enabled": False}}
