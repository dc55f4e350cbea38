"""The ids only `dsforge compile` reports: DSF600 (a degree left `auto` where no search ran) and DSF699 (the
emitter failed)."""

from __future__ import annotations

from pathlib import Path

from dsforge.commands import compile as compile_module
from dsforge.commands.compile import compile_file
from dsforge.compiler.emit.ds_config import EmitError

JOB = """version: 1
model: {preset: tiny-llama}
hardware: {preset: cpu-local, gpus_per_node: 2}
parallel:
  tp: TP
  zero: 1
training: {global_batch: 4, micro_batch: 1, precision: fp32}
"""


def test_an_auto_degree_is_resolved_by_the_search_and_dsf600_guards_a_plan_that_was_not(
    write_job, tmp_path: Path
) -> None:
    # compile resolves `auto` with the layout search (validate's), so the directory is written ...
    result = compile_file(write_job(JOB.replace("TP", "auto")), tmp_path / "out", rewrite=False)
    assert result.written is not None and "DSF600" not in {d.rule for d in result.diagnostics}
    assert "DSF133" in {d.rule for d in result.diagnostics}  # ... and says which layout it chose
    # ... and DSF600 still refuses a job that reaches the compile checks with an `auto` left (no search ran)
    from dsforge.compiler.frontend.parse import load_job
    from dsforge.compiler.plan.plan import build_plan
    from dsforge.compiler.rules.registry import Context, checks, run_rules

    job, _ = load_job(write_job(JOB.replace("TP", "auto")))
    assert job is not None
    found = run_rules(Context(job.spec, build_plan(job.spec), job.source, job.raw), checks("compile"))
    (dsf600,) = [d for d in found if d.rule == "DSF600"]
    assert (dsf600.location.line, dsf600.path) == (5,
                                                   ("parallel",
                                                    "tp")) and "set parallel.tp to a number" in dsf600.fix


def test_an_auto_the_search_cannot_resolve_writes_nothing(write_job, tmp_path: Path) -> None:
    job = JOB.replace("TP", "auto").replace("gpus_per_node: 2}", "gpus_per_node: 2, nodes: auto}")
    result = compile_file(write_job(job), tmp_path / "out", rewrite=False)
    assert [d.rule for d in result.diagnostics] == ["DSF120"] and result.written is None
    assert not (tmp_path / "out").exists()


def test_an_emitter_failure_is_dsf699_and_writes_nothing(write_job, tmp_path: Path, monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise EmitError("the ConfigMap is too large")

    monkeypatch.setattr(compile_module, "render_job", fail)
    result = compile_file(write_job(JOB.replace("TP", "1")), tmp_path / "out", rewrite=False)
    assert [d.rule for d in result.diagnostics] == ["DSF699"]
    assert "the ConfigMap is too large" in result.diagnostics[0].message
    assert result.written is None and not (tmp_path / "out").exists()
