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
    from dsforge.runtime.measure import predicted, transient_logits

    job = {"version": 1, "model": {"preset": "tiny-llama"},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 2}, "parallel": {"zero": zero},
           "training": {"global_batch": 4, "micro_batch": 1, "precision": "fp32",
                                                    "recompute": "full"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    plan = validate_file(path).plan
    row = estimate_memory(plan).stages[0]
    backward = row.moments["backward"]
    got = predicted(plan.resolve(), 0)
    assert backward["activations"] > 0
    transient = transient_logits(plan.resolve())
    assert 0 < transient < backward["logits"]
    assert got["activations_per_micro_batch"] == backward["activations"] + backward["logits"] - transient
    if zero == 0:
        assert row.phase == "update"  # the case the report got wrong: the peak holds no activations


def test_the_last_stage_counts_the_saved_logits_only() -> None:
    # tiny-3d (tp 2, pp 2): the last stage's per-micro-batch figure is its layers, head and the saved loss
    # tensors (fp32 log-probabilities, targets), what the probe measures; the transient logits are not saved
    from dsforge.compiler.estimate import activations as act
    from dsforge.compiler.estimate.memory import activation_shape
    from dsforge.compiler.model.params import padded_vocab
    from dsforge.runtime.measure import predicted
    from tests.conftest import ROOT

    plan = validate_file(ROOT / "examples" / "tiny-3d.yaml").plan
    model, shape = plan.model, activation_shape(plan)
    saved = act.logits_bytes(model, shape, padded_vocab(model, 2))[0]
    expected = plan.stage_layers[1] * act.layer_bytes(model, shape, False,
                                                      "none") + act.head_bytes(model, shape) + saved
    got = predicted(plan.resolve(), 1)
    assert got["in_flight_micro_batches"] == 1
    assert got["activations_per_micro_batch"] == pytest.approx(expected, rel=1e-9)
    # measured by `dsforge run examples/tiny-3d.yaml` (rank 7's memory_report.json): 0.424 MiB before the lean
    # kernels (predicted then 0.471, +11 %, before this fix 0.440), 329,984 B with them on by default (issue
    # 25's fused loss keeps no logits); predicted now 346,880 B (+5.1 %), within the 10 %
    assert abs(got["activations_per_micro_batch"] / 329_984 - 1) < 0.10
