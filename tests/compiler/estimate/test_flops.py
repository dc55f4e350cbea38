"""FLOPs: Narayanan et al. 2021 eq. 3 for GPT shapes, GQA, SwiGLU, MoE, recompute and capacity padding."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import pytest

from dsforge.compiler.estimate import flops
from dsforge.compiler.model.params import embedding_params, padded_vocab, total_params
from dsforge.compiler.model.resolved import ResolvedModel, resolve_model
from dsforge.compiler.spec.schema import AcceleratorSpec, ModelSpec
from tests.test_explain_helpers import GPT3_2021, SMALL, make_plan, with_changes


def gpt(layers: int = 4, hidden: int = 256, seq: int = 128, vocab: int = 1000) -> ResolvedModel:
    return resolve_model(ModelSpec(arch="gpt2", layers=layers, hidden=hidden, heads=8, vocab=vocab,
                                   seq_len=seq, activation="gelu", position="learned", tied_embeddings=True))


@pytest.mark.parametrize("layers,hidden,seq,vocab", [(4, 256, 128, 1000), (96, 12288, 2048, 50304)])
def test_gpt_shape_matches_narayanan_eq3_without_recompute(layers: int, hidden: int, seq: int,
                                                           vocab: int) -> None:
    # eq. 3 counts 96 B s l h^2 (1 + s/6h + V/16lh) with the recomputed forward; without it the layer
    # term is 3/4 of that (72) and the logits term 6 B s h V is unchanged.
    model = gpt(layers, hidden, seq, vocab)
    expected = 72 * layers * hidden**2 * (1 + seq / (6 * hidden)) + 6 * hidden * vocab
    assert flops.model_flops_per_token(model) == pytest.approx(expected, rel=1e-12)


def test_full_recompute_gives_eq3_hardware_flops(tmp_path: Path) -> None:
    plan = make_plan(GPT3_2021, tmp_path)
    m = plan.model
    b, s, l, h, v = 1536, m.seq_len, m.layers, m.hidden, padded_vocab(m, 8)
    assert v == 51200  # Megatron pads 50,257 to a multiple of 128 x tp
    eq3 = 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    assert flops.hardware_flops_per_step(plan) == pytest.approx(eq3, rel=1e-12)
    assert flops.model_flops_per_step(plan) < flops.hardware_flops_per_step(plan)


def test_selective_recompute_adds_only_the_attention_core(tmp_path: Path) -> None:
    plan = make_plan(with_changes(GPT3_2021, training={"recompute": "selective"}), tmp_path)
    m = plan.model
    core = 4 * m.seq_len * m.hidden * m.layers * 1536 * m.seq_len
    assert flops.hardware_flops_per_step(plan) - flops.model_flops_per_step(plan) == pytest.approx(
        core, rel=1e-9
    )


def test_gqa_shrinks_only_the_kv_projections() -> None:
    mha = resolve_model(ModelSpec(arch="llama", layers=1, hidden=8192, heads=64, kv_heads=64, vocab=100,
                                  seq_len=8, activation="swiglu", ffn_hidden=28672))
    gqa = replace(mha, kv_heads=8)
    h, kv = 8192, 8 * 128
    assert flops.layer_forward_flops(mha).attention_proj == 2 * 4 * h * h
    assert flops.layer_forward_flops(gqa).attention_proj == 2 * (2 * h * h + 2 * h * kv)
    assert flops.layer_forward_flops(gqa).attention_core == flops.layer_forward_flops(mha).attention_core
    assert flops.layer_forward_flops(gqa).mlp == 2 * 3 * h * 28672  # SwiGLU: gate, up and down


def test_dense_matmul_flops_are_six_per_parameter() -> None:
    # Independent check against the parameter counter: every weight outside the embedding table is one
    # multiply-add per token forward, so matmul FLOPs = 6 x those weights (norms make the small gap).
    model = resolve_model(ModelSpec(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8,
                                    ffn_hidden=14336, vocab=128256, seq_len=8192, activation="swiglu",
                                    position="rope"))
    core = 3 * model.layers * flops.layer_forward_flops(model).attention_core
    weights = total_params(model) - embedding_params(model)  # the untied LM head stays in
    assert flops.model_flops_per_token(model) - core == pytest.approx(6 * weights, rel=1e-4)


def test_moe_counts_top_k_experts_and_padding_only_in_hardware_flops(tmp_path: Path) -> None:
    job = with_changes(SMALL, model={"preset": "tiny-mixtral"}, parallel={"tp": 1, "pp": 1, "ep": 2})
    job["hardware"] = {"preset": "cpu-local", "gpus_per_node": 2}
    job["training"].update(global_batch=4, precision="fp32")
    plan = make_plan(job, tmp_path)
    m = plan.model
    assert m.moe is not None
    dense = replace(m, moe=None)
    expert = 2 * 3 * m.hidden * m.moe.ffn_hidden
    router = 2 * m.hidden * m.moe.experts
    extra = (m.moe.top_k * expert - expert + router) * m.layers * 3
    assert flops.model_flops_per_token(m) - flops.model_flops_per_token(dense) == pytest.approx(extra)
    padded = make_plan(with_changes(job, model={"moe": {**asdict(m.moe), "capacity_factor": 2.0}}), tmp_path)
    assert flops.model_flops_per_step(padded) == flops.model_flops_per_step(plan)
    assert flops.hardware_flops_per_step(padded) > flops.hardware_flops_per_step(plan)


def test_chunk_flops_split_over_tp_and_cp_and_add_logits_on_the_last_chunk(tmp_path: Path) -> None:
    plan = make_plan(SMALL, tmp_path)
    first = flops.chunk_flops(plan, 0, 16, True, False)
    last = flops.chunk_flops(plan, 16, 16, False, True)
    m = plan.model
    tokens = m.seq_len / 2  # tp = 2
    assert last.forward - first.forward == pytest.approx(flops.logits_forward_flops(m, 2) * tokens)
    assert first.backward == pytest.approx(2 * first.forward)  # no recompute in SMALL
    # tp x dp x micro-batches
    whole = (first.forward + first.backward + last.forward + last.backward) * 2 * 2 * 16
    assert whole == pytest.approx(flops.hardware_flops_per_step(plan), rel=1e-9)


def test_dense_peak_follows_precision() -> None:
    acc = AcceleratorSpec(name="x", memory_gb=80, bf16_tflops=989, fp16_tflops=900, fp32_tflops=494,
                          hbm_gbs=3350)
    assert flops.dense_peak_flops(acc, "bf16") == 989e12
    assert flops.dense_peak_flops(acc, "fp16") == 900e12
    assert flops.dense_peak_flops(acc, "fp32") == 494e12
    assert flops.utilization(989e12, 1.0, 1, 989e12) == 1.0
    assert flops.utilization(1.0, 0.0, 1, 1.0) == 0.0
