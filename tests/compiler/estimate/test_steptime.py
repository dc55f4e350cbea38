"""Step time: the breakdown adds up, the physics points the right way, and published runs land in their
bands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from dsforge.compiler.estimate import comm
from dsforge.compiler.estimate.compute import DEFAULT_GEMM_EFFICIENCY
from dsforge.compiler.estimate.steptime import StepTime, blocking_send_s, estimate_step
from dsforge.compiler.validate import validate_file
from tests.conftest import ROOT
from tests.test_explain_helpers import GPT3_2021, LLAMA3_405B_8K, SMALL, make_plan, with_changes


def test_breakdown_adds_up_to_the_step(tmp_path: Path) -> None:
    step = estimate_step(make_plan(with_changes(SMALL, parallel={"sequence_parallel": True}), tmp_path))
    parts = step.compute_s + step.bubble_s + sum(step.comm_s.values()) + step.optimizer_s
    assert parts == pytest.approx(step.step_s, rel=1e-9)
    assert step.tokens_per_s == pytest.approx(32 * 4096 / step.step_s)
    assert step.time_to_train(1e9) == pytest.approx(1e9 / step.tokens_per_s)
    assert 0 < step.mfu <= step.hfu < 1


def test_gpt3_example_mfu_lands_in_the_published_band(tmp_path: Path) -> None:
    # examples/gpt3-175b-cluster.yaml is Narayanan et al. 2021's layout (TP 8, PP 16, DP 8, batch 1,536 on
    # 1,024 A100s) with selective recompute and sequence parallelism (Korthikanti et al. 2022). Published
    # bounds:
    #  - below: 2021's 138-140 TFLOP/s per GPU with full recompute is 44-45 % hardware / 33-34 % model FLOPs;
    #    dropping the recomputed forward is worth ~1.3x (Korthikanti et al.: 530B went 42.1 % -> 54.2 % MFU);
    #  - above: Megatron-LM reports 51.4 % MFU for 175B with selective recompute and SP at DP 1, i.e. without
    #    this layout's DP all-reduce over InfiniBand and with a shallower pipeline.
    # So the example's layout, run as those papers ran it (Megatron-LM, unfused attention), must sit between
    # ~38 % and ~51 %. As written (stack dsforge: HF modules with SDPA flash attention) it drops the score
    # traffic but moves more bytes per layer than Megatron-Core's TE kernels.
    job = yaml.safe_load((ROOT / "examples" / "gpt3-175b-cluster.yaml").read_text())
    megatron = estimate_step(make_plan(with_changes({**job, "stack": "megatron-te"},
                                                    training={"attention": "unfused"}), tmp_path))
    assert 0.38 <= megatron.mfu <= 0.51, megatron.mfu
    assert 130 <= megatron.tflops_per_gpu <= 160
    step = estimate_step(validate_file(ROOT / "examples" / "gpt3-175b-cluster.yaml").plan)
    te = estimate_step(make_plan({**job, "stack": "megatron-te"}, tmp_path))
    assert megatron.mfu < te.mfu and step.mfu < te.mfu, (megatron.mfu, step.mfu, te.mfu)


def test_narayanan_2021_run_is_reproduced(tmp_path: Path) -> None:
    # Narayanan et al. 2021 sec. 5.1 quote 140 TFLOP/s per GPU (counted with the recomputed forward) for
    # GPT-3 175B on 1,024 GPUs at batch 1,536, Megatron-LM's unfused attention. The A100's gemm_efficiency is
    # fitted on Table 1 instead; this run is held out and lands +8.4 % high (the 175B PTD-P rows +3.6 to
    # +4.9 %, benchmarks/published/). Guard it within 10 %.
    step = estimate_step(make_plan(GPT3_2021, tmp_path))
    assert step.hardware_flops / step.step_s / step.gpus / 1e12 == pytest.approx(140, rel=0.10)


def test_unfused_attention_costs_what_its_score_traffic_does(tmp_path: Path) -> None:
    # Materialised s x s scores are memory-bound (dsforge/compiler/estimate/compute.py _unfused_core): at 1.7B
    # (24 heads over hidden 2,304, s 2,048) they add about half the GEMM time, at 175B over TP 8 a few percent
    gpt = {**GPT3_2021, "model": {"arch": "gpt2", "layers": 24, "hidden": 2304, "heads": 24,
                                  "ffn_hidden": 9216, "vocab": 51200, "seq_len": 2048},
           "hardware": {"preset": "dgx-a100-80gb", "nodes": 4},
           "parallel": {"tp": 1, "pp": 1, "dp": "auto", "zero": 0, "sequence_parallel": False}}
    def slowdown(job: dict[str, Any]) -> float:
        flash = estimate_step(make_plan(with_changes(job, training={"attention": "flash"}), tmp_path))
        unfused = estimate_step(make_plan(job, tmp_path))
        return unfused.compute_s / flash.compute_s
    small, large = slowdown(gpt), slowdown(GPT3_2021)
    assert 1.25 < small < 1.6, small
    assert 1.0 < large < 1.06, large


def test_llama3_405b_rows_are_reproduced(tmp_path: Path) -> None:
    # Dubey et al. 2024, Table 4: 8,192 GPUs (DP 64) 430 TFLOP/s per GPU, 16,384 GPUs (DP 128, so 16
    # instead of 32 micro-batches per step and a larger bubble) 400. The H100's gemm_efficiency is the fit
    # with the least largest error over the set's three Llama 3 rows (10.2 %, the 16,384-GPU one), so each
    # lies within it, and the model must predict the drop. Meta's own schedule changes (sec. 3.3.2) are not
    # modelled.
    eight = estimate_step(make_plan(LLAMA3_405B_8K, tmp_path))
    sixteen = estimate_step(make_plan(with_changes(LLAMA3_405B_8K, hardware={"nodes": 2048}), tmp_path))
    assert eight.tflops_per_gpu == pytest.approx(430, rel=0.105)
    assert sixteen.tflops_per_gpu == pytest.approx(400, rel=0.105)
    assert sixteen.mfu < eight.mfu
    assert sixteen.bubble_s / sixteen.step_s > eight.bubble_s / eight.step_s


def test_more_micro_batches_shrink_the_bubble(tmp_path: Path) -> None:
    job = with_changes(SMALL, parallel={"tp": 1, "pp": 8})
    mfus = [estimate_step(make_plan(with_changes(job, training={"global_batch": g}), tmp_path)).mfu
            for g in (8, 32, 128)]
    assert mfus[0] < mfus[1] < mfus[2]


def test_tensor_parallelism_across_nodes_costs_more(tmp_path: Path) -> None:
    job = with_changes(SMALL, hardware={"nodes": 2}, parallel={"tp": 8, "pp": 2},
                       launch={"launcher": "slurm"}, training={"global_batch": 16})
    inside = estimate_step(make_plan(job, tmp_path))
    across = estimate_step(make_plan(with_changes(job, parallel={"order": "pp-tp-cp-ep-dp"}), tmp_path))
    assert across.comm_s["tp"] > 5 * inside.comm_s["tp"]
    assert across.step_s > inside.step_s


def test_recompute_costs_time_but_not_model_flops(tmp_path: Path) -> None:
    none = estimate_step(make_plan(SMALL, tmp_path))
    full = estimate_step(make_plan(with_changes(SMALL, training={"recompute": "full"}), tmp_path))
    assert full.model_flops == none.model_flops
    assert full.hardware_flops > none.hardware_flops
    assert full.step_s > none.step_s and full.mfu < none.mfu


def test_compute_rates_come_from_the_preset_the_job_or_a_stated_default(tmp_path: Path) -> None:
    preset = estimate_step(make_plan(SMALL, tmp_path))
    assert preset.achievable_fraction == 0.80 and "gemm_efficiency" in preset.fraction_source
    acc = {"name": "custom", "memory_gb": 80, "bf16_tflops": 989, "hbm_gbs": 3350}
    links = {"intra_node": {"bandwidth_gbs": 450, "latency_us": 3},
             "inter_node": {"bandwidth_gbs": 50, "latency_us": 10}}
    job = {**SMALL, "hardware": {"gpus_per_node": 8, "accelerator": acc, **links}}
    inline = estimate_step(make_plan(job, tmp_path))
    # an accelerator given inline gets a stated GEMM efficiency, named with how to replace it
    assert inline.achievable_fraction == DEFAULT_GEMM_EFFICIENCY
    assert "dsforge default" in inline.fraction_source and "dsforge calibrate" in inline.fraction_source
    # achievable_fraction is an explicit override: every FLOP at that share of peak, nothing else
    def at(fraction: float) -> StepTime:
        return estimate_step(
            make_plan(
                with_changes(job, hardware={"accelerator": {**acc, "achievable_fraction": fraction}}),
                tmp_path,
            )
        )

    full, half = at(1.0), at(0.5)
    assert "override" in full.fraction_source
    assert half.compute_s == pytest.approx(2 * full.compute_s, rel=1e-9)
    assert full.compute_s < inline.compute_s  # the physics model never beats peak


def test_mfu_rises_with_model_width(tmp_path: Path) -> None:
    # Narayanan et al. 2021 Table 1: the same codebase's TFLOP/s per GPU rise with the model (137 at 1.7B
    # to 163 at 1T); at one layout the roofline and the memory-bound share make a wider model reach more
    job = with_changes(SMALL, parallel={"tp": 8, "pp": 1}, training={"global_batch": 8})
    def shaped(h: int) -> dict[str, Any]:
        return {**job,
                "model": {"arch": "llama", "layers": 8, "hidden": h, "heads": h // 128, "ffn_hidden": 4 * h,
                                 "vocab": 32000, "seq_len": 2048}}

    mfus = [estimate_step(make_plan(shaped(h), tmp_path, allow=("DSF301",))).mfu for h in (1024, 4096, 16384)]
    assert mfus[0] < mfus[1] < mfus[2], mfus


def test_every_example_estimates() -> None:
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        step = estimate_step(validate_file(path).plan)
        assert step.step_s > 0 and 0 < step.mfu < 1, path.name


@pytest.mark.parametrize("stack", ["dsforge", "megatron-deepspeed", "megatron-te"])
def test_deepspeed_pipeline_sends_hold_the_sender(tmp_path: Path, stack: str) -> None:
    # DeepSpeed's PipelineEngine sends with a synchronous dist.send (deepspeed/runtime/pipe/p2p.py), so every
    # stage but the last pays its activation send in the forward and every stage but the first its gradient
    # send in the backward; Megatron-Core's transfers only delay the receiver
    job = with_changes({**SMALL, "stack": stack}, hardware={"nodes": 4}, launch={"launcher": "slurm"},
                       parallel={"tp": 8, "pp": 4, "zero": 0}, training={"global_batch": 64})
    if stack != "megatron-te":
        job = with_changes(job, parallel={"pipeline": {"partition": "uniform"}})
    plan = make_plan(job, tmp_path)
    step = estimate_step(plan)
    send = blocking_send_s(plan)
    forward = [row[0].comm_s.get("pp", 0.0) for row in step.forward]
    backward = [row[0].comm_s.get("pp", 0.0) for row in step.backward]
    if stack == "megatron-te":
        assert send == 0 and forward == backward == [0.0] * 4
        return
    transfer = next(o for o in comm.pipeline_parallel(plan) if o.overlap == "dependency").seconds
    assert send == transfer > 0
    assert forward == [send, send, send, 0.0] and backward == [0.0, send, send, send]
