"""`hardware.preset: <file>`: a calibrated hardware file used as a preset, and every way the file can be
wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.estimate.steptime import estimate_step
from dsforge.compiler.validate import validate_file
from dsforge.runtime.calibrate import render

HARDWARE = {"nodes": 1, "gpus_per_node": 2, "host_cores": 2,
            "accelerator": {"name": "cpu", "memory_gb": 8.0, "fp32_tflops": 0.05, "bf16_tflops": 0.001,
                            "fp16_tflops": 0, "hbm_gbs": 5.0, "gemm_efficiency": 1.0,
                            "memory_efficiency": 1.0, "op_overhead_us": 20.0},
            "intra_node": {"bandwidth_gbs": 0.5, "latency_us": 200.0, "bus_efficiency": 1.0},
            "inter_node": {"bandwidth_gbs": 0.5, "latency_us": 200.0, "bus_efficiency": 1.0},
            "engine_overhead": {"step_us": [100.0, 200.0, 300.0, 400.0],
                                "micro_batch_us": [10.0, 20.0, 30.0, 40.0],
                                "tensor_step_us": [1.0, 2.0, 3.0, 4.0],
                                "tensor_micro_batch_us": [0.5, 1.0, 2.0, 4.0]}}


def _calibrated(path: Path) -> Path:
    """A hardware file as `dsforge calibrate` writes it (its comments included)."""
    measured = {"fp32_gemm_tflops": {64: 0.05}, "bf16_gemm_tflops": {64: 0.001}, "copy_gbs": 5.0,
                "bare_op_us": 10.0, "op_overhead_us": 20.0, "all_reduce_seconds": [(1024, 1e-3)], "ranks": 2,
                "cores": 2, "host": "t", "torch": "x", "when": "now"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render({"measured": measured, "hardware": HARDWARE}), encoding="utf-8")
    return path


def _job(path: Path, hardware: dict[str, Any], **top: Any) -> Path:
    job = {"version": 1, **top, "model": {"preset": "tiny-llama"}, "hardware": hardware,
           "parallel": {"dp": 2, "zero": 1}, "training": {"global_batch": 8, "precision": "fp32"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(job, sort_keys=False), encoding="utf-8")
    return path


def _errors(path: Path) -> list[Any]:
    return [d for d in validate_file(path).diagnostics if d.severity.name == "ERROR"]


def test_a_calibrated_file_as_preset_gives_the_plan_extends_gives(tmp_path: Path) -> None:
    hw = _calibrated(tmp_path / "hw" / "calibrated.yaml")
    by_preset = validate_file(_job(tmp_path / "jobs" / "a.yaml", {"preset": "../hw/calibrated.yaml"}))
    by_extends = validate_file(_job(tmp_path / "jobs" / "b.yaml", {}, extends="../hw/calibrated.yaml"))
    assert by_preset.plan is not None and by_extends.plan is not None, by_preset.diagnostics
    assert not _errors(tmp_path / "jobs" / "a.yaml")
    # recorded absolute: plan.json stands alone
    assert by_preset.plan.spec.hardware.preset == str(hw.resolve())
    assert (by_preset.plan.spec.hardware.model_copy(update={"preset": None})
            == by_extends.plan.spec.hardware)
    assert estimate_step(by_preset.plan).step_s == estimate_step(by_extends.plan).step_s
    assert estimate_step(by_preset.plan).engine_s > 0  # the calibrated engine overhead is used


def test_the_jobs_keys_override_the_file_and_a_base_resolves_from_its_own_folder(tmp_path: Path) -> None:
    _calibrated(tmp_path / "base" / "hw.yaml")
    base = tmp_path / "base" / "base.yaml"
    base.write_text(yaml.safe_dump({"hardware": {"preset": "./hw.yaml"}}), encoding="utf-8")
    job = _job(tmp_path / "deep" / "job.yaml", {"gpus_per_node": 4, "accelerator": {"memory_gb": 3.0}},
               extends="../base/base.yaml")
    plan = validate_file(job).plan
    assert plan is not None, validate_file(job).diagnostics
    hw = plan.spec.hardware
    assert (hw.gpus_per_node, hw.accelerator.memory_gb, hw.accelerator.hbm_gbs) == (4, 3.0, 5.0)


def test_a_bad_value_inside_the_file_is_reported_at_the_files_line(tmp_path: Path) -> None:
    hw = tmp_path / "hw.yml"
    hw.write_text("hardware:\n  nodes: 1\n  gpus_per_node: 2\n  accelerator: {name: cpu, memory_gb: -4, "
                  "bf16_tflops: 1, hbm_gbs: 1}\n  intra_node: {bandwidth_gbs: 1, latency_us: 1}\n"
                  "  inter_node: {bandwidth_gbs: 1, latency_us: 1}\n", encoding="utf-8")
    errors = _errors(_job(tmp_path / "job.yaml", {"preset": "hw.yml"}))
    assert [(Path(e.location.file).name, e.location.line) for e in errors] == [("hw.yml", 4)]
    assert "memory_gb" in e_path(errors[0])


def e_path(d: Any) -> str:
    return ".".join(map(str, d.path))


@pytest.mark.parametrize(("content", "line", "says"), [
    ("hardware:\n  nodes: 1\nparallel:\n  dp: 2\n", 3, "only a `hardware:` section"),
    ("extends: other.yaml\nhardware: {nodes: 1}\n", 1, "only a `hardware:` section"),
    ("hardware: 3\n", 1, "no `hardware:` mapping"),
    ("# comment\nnodes: 1\n", 2, "only a `hardware:` section"),
    ("hardware:\n  preset: dgx-h100\n", 2, "do not chain"),
])
def test_content_that_is_not_one_hardware_mapping_is_dsf304(tmp_path: Path, content: str, line: int,
                                                             says: str) -> None:
    (tmp_path / "hw.yaml").write_text(content, encoding="utf-8")
    errors = _errors(_job(tmp_path / "job.yaml", {"preset": "./hw.yaml"}))
    assert [(e.rule, Path(e.location.file).name,
             e.location.line) for e in errors] == [("DSF304", "hw.yaml", line)]
    assert says in errors[0].message and errors[0].fix


def test_a_missing_file_or_a_directory_is_dsf304_at_the_preset_line(tmp_path: Path) -> None:
    (tmp_path / "adir.yaml").mkdir()
    for name, says in (("./nothing.yaml", "does not exist"), ("adir.yaml", "not a regular file")):
        job = _job(tmp_path / "job.yaml", {"preset": name})
        errors = _errors(job)
        # hardware.preset
        assert [(e.rule, e.location.file, e.location.line) for e in errors] == [("DSF304", str(job), 5)]
        assert says in errors[0].message


def test_an_unparsable_file_is_the_loaders_error_at_its_own_position(tmp_path: Path) -> None:
    (tmp_path / "hw.yaml").write_text("hardware:\n  nodes: [1\n", encoding="utf-8")
    result = validate_file(_job(tmp_path / "job.yaml", {"preset": "hw.yaml"}))
    assert [(d.rule, Path(d.location.file).name) for d in result.diagnostics] == [("DSF004", "hw.yaml")]


def test_named_presets_are_unchanged(tmp_path: Path) -> None:
    assert not _errors(_job(tmp_path / "a.yaml", {"preset": "cpu-local"}))
    assert [e.rule for e in _errors(_job(tmp_path / "b.yaml", {"preset": "cpu-locl"}))] == ["DSF025"]


@given(st.text(min_size=1, max_size=40))
@settings(max_examples=60, deadline=None)
def test_any_preset_value_is_a_plan_or_a_diagnostic(tmp_path_factory: pytest.TempPathFactory,
                                                    name: str) -> None:
    folder = tmp_path_factory.mktemp("any")
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "model": {"preset": "tiny-llama"},
                                    "hardware": {"preset": name},
                                    "training": {"global_batch": 8}}), encoding="utf-8")
    result = validate_file(path)
    assert result.plan is not None or result.diagnostics
    assert all(d.rule and d.location.line >= 1 for d in result.diagnostics)
