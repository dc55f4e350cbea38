"""DSF301: over capacity is an error with a breakdown and legal, priced fixes; above 90 % warns."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsforge.compiler.estimate import estimate_memory
from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.plan.plan import build_plan
from dsforge.compiler.validate import validate_file
from dsforge.diagnostics import Diagnostic, Severity

WriteJob = Callable[..., Path]

LLAMA70B_ONE_NODE = """\
version: 1
model: {{preset: llama3-70b}}
hardware: {{preset: dgx-h100, nodes: 1}}
parallel: {{{parallel}}}
training: {{global_batch: 64, micro_batch: 1, precision: bf16, recompute: {recompute}{offload}}}
"""


def memory_diags(path: Path) -> list[Diagnostic]:
    return [d for d in validate_file(path).diagnostics if d.rule == "DSF301"]


def llama70b(write_job: WriteJob, parallel: str, recompute: str = "selective", offload: str = "") -> Path:
    extra = f", optimizer: {{offload: {offload}}}" if offload else ""
    return write_job(LLAMA70B_ONE_NODE.format(parallel=parallel, recompute=recompute, offload=extra))


def test_llama70b_on_one_dgx_with_zero0_is_rejected(write_job: WriteJob) -> None:
    [diag] = memory_diags(llama70b(write_job, "dp: auto, zero: 0"))
    assert diag.severity is Severity.ERROR
    # the breakdown names the components with their sizes, the capacity and the accelerator
    for word in ("optimizer", "gradients", "parameters", "GB", "80.0 GB", "H100"):
        assert word in diag.message
    assert diag.details["peak_bytes"] > 1e12  # 16+ bytes per parameter of 70B on one GPU
    assert diag.location.line == 4  # the `parallel:` line (zero is written there)
    # ranked fixes, each with its saving, largest first, and a combination that fits
    savings = [f["saving_bytes"] for f in diag.details["fixes"][:-1]]
    assert savings == sorted(savings, reverse=True) and savings[0] > 0
    assert "parallel.zero: 3" in diag.fix and "saves" in diag.fix
    assert diag.details["fixes"][-1]["fits"] and "together" in diag.fix


def test_the_proposed_combination_really_fits(write_job: WriteJob) -> None:
    [diag] = memory_diags(llama70b(write_job, "dp: auto, zero: 0"))
    combined = diag.details["fixes"][-1]
    assert combined["peak_bytes"] <= diag.details["capacity_bytes"]


def test_llama70b_layout_that_fits_is_accepted(write_job: WriteJob) -> None:
    path = llama70b(write_job, "dp: auto, zero: 3", recompute="full", offload="cpu")
    assert memory_diags(path) == []
    assert not [d for d in validate_file(path).diagnostics if d.severity is Severity.ERROR]


def test_fixes_are_legal_with_pipeline(write_job: WriteJob) -> None:
    # pp > 1: DeepSpeed refuses ZeRO-2/3 (DSF501), so the rule must not propose them
    [diag] = memory_diags(llama70b(write_job, "tp: 4, pp: 2, dp: auto, zero: 1", recompute="none"))
    changes = [f["change"] for f in diag.details["fixes"]]
    assert changes and not any("zero: 2" in c or "zero: 3" in c for c in changes)
    assert any("recompute" in c for c in changes)


def test_fix_savings_are_re_estimates(write_job: WriteJob) -> None:
    path = llama70b(write_job, "tp: 8, dp: auto, zero: 1", recompute="none")
    [diag] = memory_diags(path) or [None]
    if diag is None:  # fits already: nothing to check here
        return
    result = validate_file(path)
    assert result.plan is not None
    before = estimate_memory(result.plan).peak.device_bytes
    for fix in diag.details["fixes"]:
        assert fix["saving_bytes"] == before - fix["peak_bytes"]


def test_above_90_percent_warns(write_job: WriteJob) -> None:
    body = """\
version: 1
model: {{preset: llama3-8b}}
hardware: {{preset: dgx-h100, accelerator: {{name: H100-test, memory_gb: {memory_gb}, bf16_tflops: 989,
           hbm_gbs: 3350}}}}
parallel: {{tp: 2, dp: auto, zero: 1, sequence_parallel: true}}
training: {{global_batch: 64, micro_batch: 1, recompute: selective}}
"""
    result = validate_file(write_job(body.format(memory_gb=80)))
    assert result.plan is not None
    peak = estimate_memory(result.plan).peak.device_bytes
    [diag] = memory_diags(write_job(body.format(memory_gb=round(peak / 0.95 / 1e9, 1))))
    assert diag.severity is Severity.WARNING and "95%" in diag.message
    assert memory_diags(write_job(body.format(memory_gb=round(peak / 0.85 / 1e9, 1)))) == []


def test_invalid_layout_is_left_to_other_rules(write_job: WriteJob) -> None:
    # 3 x 2 ranks on an 8-GPU node: DSF101 reports it; the memory rule stays silent
    path = llama70b(write_job, "tp: 3, dp: 2, zero: 0")
    rules = {d.rule for d in validate_file(path).diagnostics}
    assert "DSF301" not in rules and "DSF900" not in rules and "DSF101" in rules


# --- robustness: any well-typed layout is estimated without crashing, with sane numbers -------------

LAYOUT = st.fixed_dictionaries({
    "model": st.sampled_from(["tiny-llama", "tiny-mixtral", "tiny-gpt2", "llama3-8b", "mixtral-8x7b",
                              "gpt2-small"]),
    "nodes": st.sampled_from([1, 2]),
    "tp": st.sampled_from([1, 2, 4]), "pp": st.sampled_from([1, 2]), "cp": st.sampled_from([1, 2]),
    "ep": st.sampled_from([1, 2]), "zero": st.integers(0, 3), "sp": st.booleans(),
    "schedule": st.sampled_from(["1f1b", "gpipe", "interleaved"]), "vs": st.sampled_from([1, 2]),
    "recompute": st.sampled_from(["none", "selective", "full"]),
    "precision": st.sampled_from(["bf16", "fp16", "fp32"]), "offload": st.sampled_from(["none", "cpu"]),
    "micro": st.sampled_from([1, 2]),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=LAYOUT)
def test_any_layout_is_estimated_or_skipped(write_job: WriteJob, layout: dict) -> None:
    body = (f"version: 1\nmodel: {{preset: {layout['model']}}}\n"
            f"hardware: {{preset: dgx-h100, nodes: {layout['nodes']}}}\n"
            f"parallel: {{tp: {layout['tp']}, pp: {layout['pp']}, cp: {layout['cp']}, ep: {layout['ep']}, "
            f"zero: {layout['zero']}, sequence_parallel: {str(layout['sp']).lower()}, "
            f"pipeline: {{schedule: {layout['schedule']}, virtual_stages: {layout['vs']}}}}}\n"
            f"training: {{global_batch: 64, micro_batch: {layout['micro']}, precision: "
            f"{layout['precision']}, recompute: {layout['recompute']}, "
            f"optimizer: {{offload: {layout['offload']}}}}}\n")
    path = write_job(body)
    diags = validate_file(path).diagnostics
    assert not [d for d in diags if d.rule == "DSF900"], [d.message for d in diags if d.rule == "DSF900"]
    job, _ = load_job(path)
    assert job is not None
    plan = build_plan(job.spec)
    if plan.layout_ok and plan.placement is not None and plan.stage_layers:
        est = estimate_memory(plan)
        for stage in est.stages:
            assert all(v >= 0 for v in (*stage.components.values(), *stage.host.values()))
            assert stage.components["activations"] > 0 or stage.phase == "update"
