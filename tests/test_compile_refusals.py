"""The ids only `dsforge compile` reports: DSF600 (a degree left `auto`) and DSF699 (the emitter failed)."""

from __future__ import annotations

from pathlib import Path

from dsforge.compiler.emit import compile as compile_module
from dsforge.compiler.emit.compile import compile_file
from dsforge.compiler.emit.ds_config import EmitError

JOB = """version: 1
model: {preset: tiny-llama}
hardware: {preset: cpu-local, gpus_per_node: 2}
parallel:
  tp: TP
  zero: 1
training: {global_batch: 4, micro_batch: 1, precision: fp32}
"""


def test_an_auto_degree_is_dsf600_at_its_key(write_job, tmp_path: Path) -> None:
    result = compile_file(write_job(JOB.replace("TP", "auto")), tmp_path / "out", rewrite=False)
    (dsf600,) = [d for d in result.diagnostics if d.rule == "DSF600"]
    assert (dsf600.location.line, dsf600.path) == (5, ("parallel", "tp")) and "set parallel.tp to a number" in dsf600.fix
    assert result.written is None and not (tmp_path / "out").exists()


def test_an_emitter_failure_is_dsf699_and_writes_nothing(write_job, tmp_path: Path, monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise EmitError("the ConfigMap is too large")

    monkeypatch.setattr(compile_module, "render_job", fail)
    result = compile_file(write_job(JOB.replace("TP", "1")), tmp_path / "out", rewrite=False)
    assert [d.rule for d in result.diagnostics] == ["DSF699"]
    assert "the ConfigMap is too large" in result.diagnostics[0].message
    assert result.written is None and not (tmp_path / "out").exists()
