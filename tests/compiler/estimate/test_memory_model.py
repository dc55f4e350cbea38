"""The memory estimate's formulas: Korthikanti's activation equations, parameter shares, schedules, ZeRO."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsforge.compiler.estimate import MemoryEstimate, estimate_memory
from dsforge.compiler.estimate import activations as act
from dsforge.compiler.estimate.model_states import model_states
from dsforge.compiler.estimate.shares import stage_share
from dsforge.compiler.estimate.zero_config import zero_settings
from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.frontend.presets import presets
from dsforge.compiler.model.params import total_params
from dsforge.compiler.model.resolved import resolve_model
from dsforge.compiler.plan.plan import Plan, build_plan
from dsforge.compiler.spec.schema import ModelSpec

GPT3 = resolve_model(ModelSpec(arch="gpt2", layers=96, hidden=12288, heads=96, ffn_hidden=4 * 12288,
                               vocab=50257, seq_len=2048, activation="gelu", position="learned",
                               tied_embeddings=True))


def shape(tp: int = 1, sp: bool = False, cp: int = 1, b: int = 1) -> act.ActivationShape:
    """Korthikanti's setting: 16-bit activations, unfused attention, 1-byte dropout masks."""
    return act.ActivationShape(b, GPT3.seq_len, tp, cp, sp, 2, kernels=act.MEGATRON)


def korthikanti(tp: int, sp: bool, recompute: str) -> float:
    """Korthikanti et al. 2022 eqs. 1-4 and sec. 5 for one layer, in bytes."""
    s, b, h, a, t = GPT3.seq_len, 1, GPT3.hidden, GPT3.heads, tp
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    scores = 0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h / t * (34 + scores)
    return s * b * h * (10 + 24 / t + scores / t)


@pytest.mark.parametrize("tp,sp", [(1, False), (8, False), (8, True)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_layer_activations_reproduce_korthikanti(tp: int, sp: bool, recompute: str) -> None:
    # the per-tensor count adds what the paper leaves out, fp32 norm statistics (8 bytes per token
    # per norm): 0.03 % at GPT-3's width
    got = act.layer_bytes(GPT3, shape(tp, sp), False, recompute)
    assert got == pytest.approx(korthikanti(tp, sp, recompute), rel=0.01)


def test_fused_attention_saves_no_scores() -> None:
    fused = act.ActivationShape(1, 2048, 1, 1, False, 2, kernels=act.HF_SDPA)
    assert "attn.scores" not in act.layer_terms(GPT3, fused, False)
    assert act.layer_bytes(GPT3, fused, False, "none") == act.layer_bytes(GPT3, fused, False, "selective")


def test_context_parallel_splits_tokens_not_keys() -> None:
    one, two = shape(), shape(cp=2)
    assert act.attention_terms(GPT3, two)["q_k_v"] == act.attention_terms(GPT3, one)["q_k_v"] / 2
    # each local query still attends to all s keys: the score matrix halves with the queries
    assert act.attention_terms(GPT3,
                               two)["scores"] == pytest.approx(act.attention_terms(GPT3, one)["scores"] / 2)


def test_in_flight_micro_batches_by_schedule() -> None:
    assert [act.in_flight("1f1b", 4, s, 16, 1) for s in range(4)] == [4, 3, 2, 1]
    assert act.in_flight("1f1b", 4, 0, 2, 1) == 2  # fewer micro-batches than stages
    assert act.in_flight("gpipe", 4, 3, 16, 1) == 16
    assert act.in_flight("1f1b", 1, 0, 16, 1) == 1
    # Megatron interleaved, p=4, v=2, rank 0: warm-up (4-0-1)*2 + (2-1)*4 = 10, plus one in steady state
    assert act.in_flight("interleaved", 4, 0, 16, 2) == 11
    assert act.in_flight("interleaved", 4, 3, 16, 2) == 5


@pytest.mark.parametrize("name", ["gpt2-small", "llama3-8b", "mixtral-8x7b", "tiny-llama"])
def test_stage_shares_add_up_to_the_model(tmp_path: Path, name: str) -> None:
    model = resolve_model(ModelSpec(**presets("models")[name].spec))
    for pp in (1, 2, 4):
        plan = job(tmp_path, f"model: {{preset: {name}}}\nhardware: {{preset: dgx-h100}}\n"
                             f"parallel: {{pp: {pp}, pipeline: {{partition: uniform}}}}\n")
        shares = sum(stage_share(plan, s, 0).total for s in range(pp))
        tied_copy = model.hidden * model.vocab if model.tied_embeddings and pp > 1 else 0
        assert shares == total_params(model) + tied_copy


def test_tensor_parallel_shares(tmp_path: Path) -> None:
    plan1 = job(tmp_path, "model: {preset: llama3-8b}\nhardware: {preset: dgx-h100}\nparallel: {tp: 1}\n")
    plan8 = job(tmp_path, "model: {preset: llama3-8b}\nhardware: {preset: dgx-h100}\nparallel: {tp: 8}\n")
    one, eight = stage_share(plan1, 0, 0).total, stage_share(plan8, 0, 0).total
    # norms (2 per layer + the final one) are replicated, everything else divides by 8
    norms = (2 * 32 + 1) * 4096
    assert eight == pytest.approx((one - norms) / 8 + norms)


def job(tmp_path: Path, body: str) -> Plan:
    path = tmp_path / "job.yaml"
    path.write_text("version: 1\n" + body)
    loaded, diags = load_job(path)
    assert loaded is not None, diags
    return build_plan(loaded.spec)


LLAMA8B = "model: {preset: llama3-8b}\nhardware: {preset: dgx-h100}\n"


def states_peak(tmp_path: Path, zero: int, precision: str = "bf16") -> float:
    plan = job(tmp_path, LLAMA8B + f"parallel: {{zero: {zero}}}\ntraining: {{precision: {precision}}}\n")
    z = zero_settings(plan)
    return model_states(stage_share(plan, 0, z.persistence_threshold), z, 8, 1, 2).peak


def test_zero_stages_shrink_model_states(tmp_path: Path) -> None:
    peaks = [states_peak(tmp_path, z) for z in range(4)]
    assert peaks == sorted(peaks, reverse=True)
    p = total_params(resolve_model(ModelSpec(**presets("models")["llama3-8b"].spec)))
    # Rajbhandari et al. count 16 bytes/param; DeepSpeed's step also holds fp32 gradients next to the
    # 16-bit ones (20 bytes), without ZeRO over the whole model, with ZeRO-3 over the 1/N partition,
    # plus one bf16 reduce bucket of hidden^2 elements (the emitted reduce_bucket_size)
    assert peaks[0] == pytest.approx(20 * p, rel=0.01)
    assert peaks[3] == pytest.approx(20 * p / 8 + 2 * 4096**2, rel=0.01)


def test_offload_moves_optimizer_state_to_host(tmp_path: Path) -> None:
    plan = job(tmp_path, LLAMA8B + "parallel: {zero: 2}\ntraining: {optimizer: {offload: cpu}}\n")
    est = estimate_memory(plan)
    assert est.peak.components["optimizer"] == 0
    assert est.peak.host["optimizer"] == pytest.approx(12 * stage_share(plan, 0, 0).total / 8)


def test_estimate_shape_and_contract(tmp_path: Path) -> None:
    plan = job(tmp_path, "model: {preset: llama3-70b}\nhardware: {preset: dgx-h100, nodes: 8}\n"
                         "parallel: {tp: 8, pp: 4, zero: 1}\ntraining: {global_batch: 128}\n")
    est = estimate_memory(plan)
    assert isinstance(est, MemoryEstimate) and len(est.stages) == 4
    assert [s.rank for s in est.stages] == [0, 16, 32, 48]
    assert est.capacity_bytes == 80e9
    assert est.peak.device_bytes == max(s.device_bytes for s in est.stages)
    assert est.utilization == est.peak.device_bytes / 80e9
    # 1F1B: the first stage holds 4 micro-batches, the last 1 plus the logits
    acts = [s.components["activations"] for s in est.stages]
    assert acts[0] > acts[1] > acts[2] > acts[3]
    assert est.stages[3].components["logits"] > 0 == est.stages[0].components["logits"]
    assert list(est.peak.components) == ["parameters", "gradients", "optimizer", "buffers", "activations",
                                         "logits", "reserve"]
    # every moment is exposed; the components are the larger of backward and update
    for stage in est.stages:
        assert set(stage.moments) == {"backward", "update", "step"}
        assert stage.components == stage.moments[stage.phase]
        assert stage.device_bytes == max(sum(stage.moments[m].values()) for m in ("backward", "update"))
        assert stage.moments["step"]["activations"] == 0


def test_invalid_layout_raises(tmp_path: Path) -> None:
    plan = job(tmp_path, LLAMA8B + "parallel: {tp: 3, dp: 2}\n")
    with pytest.raises(ValueError):
        estimate_memory(plan)
