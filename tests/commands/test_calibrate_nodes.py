"""`dsforge calibrate` across nodes: two torchrun agents on this machine form a 2-"node" world (c10d
rendezvous, 2 ranks each); the link inside a node and the link between nodes are measured over their own
groups and written apart, and the file is a hardware file a job extends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dsforge.compiler.validate import validate_file
from tests.runtime.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_agents_write_an_intra_and_an_inter_node_link(tmp_path: Path) -> None:
    out = tmp_path / "links.yaml"
    port = free_port()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "calibrate-test",
             "--max-restarts", "0", "-m", "dsforge", "calibrate", "--links-only", "-o", str(out)]
    agents = [subprocess.Popen(agent, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
              for _ in range(2)]
    logs = [a.communicate(timeout=240)[0] for a in agents]
    assert all(a.returncode == 0 for a in agents), "\n".join(log[-3000:] for log in logs)
    text = out.read_text(encoding="utf-8")
    hw = yaml.safe_load(text)["hardware"]
    assert (hw["nodes"], hw["gpus_per_node"]) == (2, 2)
    for name in ("intra_node", "inter_node"):
        assert hw[name]["bandwidth_gbs"] > 0 and hw[name]["latency_us"] >= 0
        assert f"# {name}: 2 ranks per group" in text  # each fitted over its own 2-rank groups
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"version": 1, "extends": out.name, "model": {"preset": "tiny-llama"},
                                   "hardware": {"preset": "cpu-local"}, "parallel": {"dp": 4},
                                   "training": {"global_batch": 8, "precision": "fp32"}}), encoding="utf-8")
    result = validate_file(job)
    assert result.plan is not None, result.diagnostics
    spec = result.plan.spec.hardware
    assert (spec.nodes, spec.inter_node.latency_us) == (2, hw["inter_node"]["latency_us"])
