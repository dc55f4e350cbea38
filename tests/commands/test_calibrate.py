"""`dsforge calibrate`'s output: the ring fit recovers alpha and beta, and the file is a usable hardware
file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.estimate.steptime import estimate_step
from dsforge.compiler.validate import validate_file
from dsforge.runtime.calibrate import render
from dsforge.runtime.calibrate.fits import fit_ring


def test_ring_fit_recovers_latency_and_bandwidth() -> None:
    alpha, beta, n = 50e-6, 2e9, 4
    rows = [(s,
             2 * (n - 1) * alpha + 2 * (n - 1) / n * s / beta) for s in (1 << 10, 1 << 14, 1 << 18, 1 << 22)]
    got_alpha, got_beta = fit_ring(rows, n)
    assert got_alpha == pytest.approx(alpha, rel=1e-6) and got_beta == pytest.approx(beta, rel=1e-6)


def _result(cores: int) -> dict[str, object]:
    link = {"bandwidth_gbs": 0.5, "latency_us": 200.0, "bus_efficiency": 1.0}
    return {"measured": {"fp32_gemm_tflops": {64: 0.01, 256: 0.05}, "bf16_gemm_tflops": {64: 0.001},
                         "copy_gbs": 5.0, "bare_op_us": 10.0, "op_overhead_us": 20.0,
                         "all_reduce_seconds": [(1024, 1e-3)], "ranks": 2, "cores": cores, "host": "test",
                         "torch": "x", "when": "now"},
            "hardware": {"nodes": 1, "gpus_per_node": 2, "host_cores": cores, "host_ram_gb": 16.0,
                         "accelerator": {"name": "cpu", "memory_gb": 8.0, "fp32_tflops": 0.05,
                                         "bf16_tflops": 0.001, "fp16_tflops": 0, "hbm_gbs": 5.0,
                                         "gemm_efficiency": 1.0, "memory_efficiency": 1.0,
                                         "op_overhead_us": 20.0},
                         "intra_node": link, "inter_node": dict(link)}}


def _compute_s(tmp_path: Path, cores: int, ranks: int) -> float:
    hw = tmp_path / f"hw-{cores}.yaml"
    hw.write_text(render(_result(cores)), encoding="utf-8")
    job = {"version": 1, "extends": hw.name, "model": {"preset": "tiny-llama"},
           "hardware": {"gpus_per_node": ranks}, "parallel": {"dp": ranks, "zero": 1},
           "training": {"global_batch": 8, "precision": "fp32"}}
    path = tmp_path / f"job-{cores}-{ranks}.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    result = validate_file(path)
    assert result.plan is not None and not [d for d in result.diagnostics if d.severity.name == "ERROR"]
    step = estimate_step(result.plan)
    assert "gemm_efficiency 1.00" in step.fraction_source and "20.0 us per operation" in step.fraction_source
    return step.compute_s


def test_the_calibrated_file_is_a_hardware_file_a_job_extends(tmp_path: Path) -> None:
    # four ranks on two cores time-share them: their compute takes twice as long as on four cores
    shared, own = _compute_s(tmp_path, 2, 4), _compute_s(tmp_path, 4, 4)
    assert shared == pytest.approx(2 * own)


def test_launched_reads_the_launchers_world(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsforge.runtime.calibrate.links import Launch, launched

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert launched() is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert launched() is None  # one rank is no world to measure links in
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert launched() == Launch(5, 8, 1, 4, 1)  # node from rank // local world without GROUP_RANK
    monkeypatch.setenv("GROUP_RANK", "0")
    assert launched() == Launch(5, 8, 1, 4, 0)


def test_a_links_only_file_states_both_links(tmp_path: Path) -> None:
    fit = {"bandwidth_gbs": 0.3, "latency_us": 90.0, "bus_efficiency": 1.0, "ranks": 2,
           "rows": [(1024, 1e-3)]}
    result = {"links_only": True, "measured": {"host": "h", "when": "now", "torch": "x", "intra_node": fit,
                                               "inter_node": {**fit, "latency_us": 400.0}},
              "hardware": {"nodes": 2, "gpus_per_node": 2,
                           "intra_node": {k: fit[k] for k in ("bandwidth_gbs", "latency_us",
                                                              "bus_efficiency")},
                           "inter_node": {"bandwidth_gbs": 0.3, "latency_us": 400.0, "bus_efficiency": 1.0}}}
    text = render(result)
    assert "# intra_node: 2 ranks per group" in text and "# inter_node: 2 ranks per group" in text
    assert yaml.safe_load(text)["hardware"]["inter_node"]["latency_us"] == 400.0


@settings(max_examples=50, deadline=None)
@given(st.floats(1e-6, 1e-1), st.floats(1e6, 1e11), st.integers(2, 16))
def test_in_situ_alpha_prices_the_small_all_reduce_at_its_in_situ_seconds(
    situ: float, beta: float, n: int
) -> None:
    from dsforge.runtime.calibrate.links import IN_SITU_BYTES, in_situ_alpha

    alpha = in_situ_alpha(situ, beta, n)
    ring = 2 * (n - 1) * alpha + 2 * (n - 1) / n * IN_SITU_BYTES / beta
    assert alpha >= 0
    assert ring == pytest.approx(situ, rel=1e-9) if alpha > 0 else ring >= situ


def test_the_file_states_the_in_situ_latency_its_noise_and_the_load(tmp_path: Path) -> None:
    result = _result(2)
    result["measured"].update({"in_situ_all_reduce_s": 2.5e-3, "in_situ_spread": 0.4,
                               "fitted_latency_us": 150.0, "load": [1.5, 2.25], "op_overhead_spread": 0.5})
    text = render(result)
    assert "noise of the per-operation figure: spread 50% of its median" in text
    assert "a 16 KiB all-reduce adds 2.500 ms (noise: spread 40% of the median" in text
    assert "back-to-back fit's 150.00 us" in text and "load average 1.50 before, 2.25 after (2 cores)" in text
    assert yaml.safe_load(text)["hardware"]["intra_node"]["latency_us"] == 200.0
