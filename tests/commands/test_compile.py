"""`dsforge compile`: the job directory, refusing bad jobs and targets, atomic writes, byte-stable output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from dsforge.cli import cli
from dsforge.compiler.emit import plan_doc, writer
from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.plan.plan import build_plan
from tests.test_compile_support import dry_run, example_path, write_variant


def compile_(*args: str) -> Result:
    """`dsforge compile --no-rewrite`: these tests are about the emitter, and the rewrite plan imports
    transformers (seconds); tests/commands/test_compile_rewrite.py covers it."""
    return CliRunner().invoke(cli, ["compile", "--no-rewrite", *args])


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_compile_writes_the_job_directory(tmp_path: Path) -> None:
    out = tmp_path / "job"
    result = compile_(str(example_path("tiny-3d")), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(out)) == ["README.md", "ds_config.json", "launch.sh", "plan.json", "train.py"]
    assert os.access(out / "launch.sh", os.X_OK) and os.access(out / "train.py", os.X_OK)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary sibling left


def test_plan_json_holds_what_the_runtime_needs(tmp_path: Path) -> None:
    path = example_path("tiny-3d")
    assert compile_(str(path), "-o", str(tmp_path / "job")).exit_code == 0
    doc = json.loads((tmp_path / "job" / "plan.json").read_text())
    job, _ = load_job(path)
    assert job is not None
    plan = build_plan(job.spec)
    expected = json.loads(json.dumps(job.spec.model_dump(mode="json", by_alias=True)))
    expected["launch"]["python"] = sys.executable  # the launcher runs the interpreter that compiled the job
    assert doc["job"] == expected
    assert doc["degrees"] == {"tp": 2, "pp": 2, "dp": 2, "cp": 1, "ep": 1}
    assert doc["world_size"] == 8 and doc["zero"] == 1 and doc["seed"] == 7
    assert doc["batch"] == {"global_batch": 8, "micro_batch": 1, "grad_accum": 4}
    assert doc["stage_layers"] == plan.stage_layers and plan.placement is not None
    assert doc["placement"]["groups"] == plan.placement.groups
    assert doc["deepspeed"]["batch_world_size"] == 2 and doc["deepspeed"]["processes"] == 8
    assert doc["dist_backend"] == "gloo" and doc["files"] == sorted(os.listdir(tmp_path / "job"))


def test_plan_json_carries_the_explain_summary_when_the_cost_model_has_one(tmp_path: Path) -> None:
    summary = pytest.importorskip("dsforge.compiler.estimate.summary")
    path = example_path("tiny-pp2-dp2")
    assert compile_(str(path), "-o", str(tmp_path / "job")).exit_code == 0
    job, _ = load_job(path)
    assert job is not None
    expected = json.loads(json.dumps(summary.summarize(build_plan(job.spec))))
    assert json.loads((tmp_path / "job" / "plan.json").read_text())["summary"] == expected


def test_output_is_byte_identical_and_free_of_local_paths(tmp_path: Path) -> None:
    path = example_path("llama3-70b-multinode")
    for name in ("a", "b"):
        assert compile_(str(path), "-o", str(tmp_path / name)).exit_code == 0
    a, b = snapshot(tmp_path / "a"), snapshot(tmp_path / "b")
    assert a == b
    for content in a.values():  # the one local path is, on purpose, the interpreter the launcher runs
        content = content.replace(sys.executable.encode(), b"<python>")
        assert str(tmp_path).encode() not in content and str(Path.cwd()).encode() not in content


def test_a_job_with_errors_writes_nothing(tmp_path: Path) -> None:
    path = write_variant(tmp_path, "tiny-tp2-dp2", {"deepspeed": {"train_batch_size": 99}})
    result = compile_(str(path), "-o", str(tmp_path / "job"))
    assert result.exit_code == 1
    assert "DSF508" in result.output and "nothing written" in result.output
    assert not (tmp_path / "job").exists()


def test_unusable_input_exits_2(tmp_path: Path) -> None:
    result = compile_(str(tmp_path / "missing.yaml"), "-o", str(tmp_path / "job"))
    assert result.exit_code == 2 and not (tmp_path / "job").exists()


EMIT_ERRORS: dict[str, tuple[str, dict[str, Any]]] = {
    "DSF601": ("llama3-8b-dgx-h100",
               {"parallel": {"zero": 3}, "training": {"optimizer": {"offload": "nvme"}}}),
    "DSF602": ("llama3-70b-multinode", {"launch": {"launcher": "deepspeed"}}),
    "DSF603": ("llama3-70b-multinode", {"launch": {"launcher": "torchrun"}}),
    "DSF604": ("tiny-tp2-dp2", {"launch": {"env": {"BAD-KEY": "1"}}}),
    "DSF605": ("llama3-8b-dgx-h100", {"launch": {"launcher": "kubernetes"}}),
    "DSF606": ("tiny-tp2-dp2", {"deepspeed": {"tensor_parallel": {"autotp_size": 2}}}),
    "DSF608": ("llama3-70b-multinode", {"deepspeed": {"pipeline": {"pipe_partitioned": True}}}),
}


@pytest.mark.parametrize("rule", sorted(EMIT_ERRORS))
def test_emit_checks_refuse_with_a_located_diagnostic(tmp_path: Path, rule: str) -> None:
    base, changes = EMIT_ERRORS[rule]
    path = write_variant(tmp_path, base, changes)
    result = compile_(str(path), "-o", str(tmp_path / "job"), "--format", "json")
    assert result.exit_code == 1
    found = [d for d in json.loads(result.stdout)["diagnostics"] if d["rule"] == rule]
    assert found and found[0]["line"] > 0 and found[0]["fix"], result.output
    assert not (tmp_path / "job").exists()


def test_a_name_with_shell_syntax_injects_nothing(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    name = f"x; touch {canary}; $(touch {canary}) `touch {canary}` ' \" \\"
    path = write_variant(tmp_path, "tiny-tp2-dp2",
                         {"name": name, "launch": {"python": f"py $(touch {canary})"}})
    assert compile_(str(path), "-o", str(tmp_path / "job")).exit_code == 0
    variables, argv = dry_run(tmp_path / "job" / "launch.sh")
    assert variables["JOB_NAME"] == name and argv[0] == f"py $(touch {canary})"
    assert not canary.exists()


def test_non_empty_target_is_refused_without_force(tmp_path: Path) -> None:
    out = tmp_path / "job"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = compile_(str(example_path("tiny-tp2-dp2")), "-o", str(out))
    assert result.exit_code == 2 and "--force" in result.output
    forced = compile_(str(example_path("tiny-tp2-dp2")), "-o", str(out), "--force")
    assert forced.exit_code == 2 and "not a job directory dsforge wrote" in forced.output
    assert os.listdir(out) == ["notes.txt"]


def test_force_replaces_an_earlier_compile_but_never_foreign_files(tmp_path: Path) -> None:
    out = tmp_path / "job"
    assert compile_(str(example_path("tiny-tp2-dp2")), "-o", str(out)).exit_code == 0
    assert compile_(str(example_path("tiny-3d")), "-o", str(out)).exit_code == 2
    assert compile_(str(example_path("tiny-3d")), "-o", str(out), "--force").exit_code == 0
    assert json.loads((out / "plan.json").read_text())["name"] == "tiny-3d"
    (out / "checkpoints").mkdir()
    result = compile_(str(example_path("tiny-tp2-dp2")), "-o", str(out), "--force")
    assert result.exit_code == 2 and "checkpoints" in result.output
    assert json.loads((out / "plan.json").read_text())["name"] == "tiny-3d"


def test_an_empty_directory_or_a_file_as_target(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert compile_(str(example_path("tiny-tp2-dp2")), "-o", str(tmp_path / "empty")).exit_code == 0
    (tmp_path / "file").write_text("x")
    assert compile_(str(example_path("tiny-tp2-dp2")), "-o", str(tmp_path / "file")).exit_code == 2
    below_a_file = compile_(str(example_path("tiny-tp2-dp2")), "-o", str(tmp_path / "file" / "job"))
    assert below_a_file.exit_code == 2 and "cannot write" in below_a_file.output


@pytest.mark.parametrize("existing", [False, True])
def test_a_failure_while_writing_leaves_the_target_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             existing: bool) -> None:
    out = tmp_path / "job"
    if existing:
        assert compile_(str(example_path("tiny-tp2-dp2")), "-o", str(out)).exit_code == 0
    before = snapshot(out) if existing else None
    real_fill = writer._fill

    def fill_then_fail(directory: Path, files: Any) -> None:
        real_fill(directory, dict(list(files.items())[:2]))
        raise KeyboardInterrupt  # an interruption half-way through writing

    monkeypatch.setattr(writer, "_fill", fill_then_fail)
    with pytest.raises(KeyboardInterrupt):
        writer.write_job_dir(out, {"a.txt": writer.JobFile("a"), "b.txt": writer.JobFile("b"),
                                   "c.txt": writer.JobFile("c")}, force=True)
    assert (snapshot(out) if existing else out.exists()) == (before if existing else False)
    assert [p.name for p in tmp_path.iterdir()] == (["job"] if existing else [])


def test_train_py_fails_clearly_without_the_runtime(tmp_path: Path) -> None:
    assert compile_(str(example_path("tiny-tp2-dp2")), "-o", str(tmp_path / "job")).exit_code == 0
    train = tmp_path / "job" / "train.py"
    # None in sys.modules makes `import dsforge.runtime` raise ImportError, as if it were not installed.
    hide = ("import runpy, sys; sys.modules['dsforge.runtime'] = None; "
            f"runpy.run_path({str(train)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", hide], check=False, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "dsforge.runtime.main.run_job is not available" in proc.stderr and "Traceback" not in proc.stderr


def test_compile_without_the_rewrite_plan_imports_neither_torch_nor_deepspeed(tmp_path: Path) -> None:
    code = ("import sys; from dsforge.commands.compile import compile_file; "
            f"r = compile_file({str(example_path('mixtral-8x7b-ep'))!r}, {str(tmp_path / 'job')!r}, "
            f"rewrite=False); assert r.written, r.diagnostics; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed')))")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_failing_cost_model_costs_only_the_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_summary.py").write_text("def summarize(plan):\n    raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plan_doc, "SUMMARY_MODULE", "broken_summary")
    result = compile_(str(example_path("tiny-tp2-dp2")), "-o", str(tmp_path / "job"))
    assert result.exit_code == 0 and "DSF690" in result.output and "boom" in result.output
    assert "summary" not in json.loads((tmp_path / "job" / "plan.json").read_text())
