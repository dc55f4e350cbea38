"""memory_report.json's predicted activations per micro-batch come from the backward moment, even when the
rank's peak falls in the optimizer step (issue 24 item 6: full recompute with ZeRO 0 read 0)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dsforge.compiler.estimate.memory import estimate_memory
from dsforge.compiler.validate import validate_file

pytest.importorskip("torch")


@pytest.mark.parametrize("zero", [0, 1])
def test_activations_per_micro_batch_is_the_backward_figure(tmp_path: Path, zero: int) -> None:
    from dsforge.runtime.measure import predicted

    job = {"version": 1, "model": {"preset": "tiny-llama"}, "hardware": {"preset": "cpu-local", "gpus_per_node": 2},
           "parallel": {"zero": zero}, "training": {"global_batch": 4, "micro_batch": 1, "precision": "fp32",
                                                    "recompute": "full"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    plan = validate_file(path).plan
    row = estimate_memory(plan).stages[0]
    backward = row.moments["backward"]
    got = predicted(plan.resolve(), 0)
    assert backward["activations"] > 0
    assert got["activations_per_micro_batch"] == backward["activations"] + backward["logits"]
    if zero == 0:
        assert row.phase == "update"  # the case the report got wrong: the peak holds no activations
