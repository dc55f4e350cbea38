"""Issue 24: Megatron-Core's memory options (gradient dtype, the distributed optimizer over dp x cp,
Megatron-FSDP, the embedding/loss-counting pipeline split), FP8 under Transformer Engine and the
megatron-deepspeed stack."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.estimate.memory import estimate_memory
from dsforge.compiler.estimate.steptime import estimate_step
from dsforge.compiler.plan.megatron_split import accounted_partition
from dsforge.compiler.validate import validate_file

LLAMA3_8B = {"arch": "llama", "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn_hidden": 14336,
             "vocab": 128256, "seq_len": 8192}
GB = 1e9


def _job(tmp_path: Path, name: str = "job", stack: str = "megatron-te", model: dict[str, Any] | None = None,
         parallel: dict[str, Any] | None = None, training: dict[str, Any] | None = None,
         nodes: int = 1) -> Any:
    job = {"version": 1, "stack": stack, "model": model or dict(LLAMA3_8B),
           "hardware": {"preset": "dgx-h100", "nodes": nodes},
           "parallel": {"tp": 1, "pp": 1, "cp": 2, "zero": 1, **(parallel or {})},
           "training": {"global_batch": 128, "micro_batch": 1, "precision": "bf16", **(training or {})}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return validate_file(path)


def _errors(result: Any) -> list[str]:
    return [d.rule for d in result.diagnostics if d.severity.name == "ERROR"]


def _stage0(result: Any) -> dict[str, float]:
    return estimate_memory(result.plan).stages[0].moments["backward"]


def test_grad_reduce_bf16_halves_megatrons_main_grad_buffer(tmp_path: Path) -> None:
    fp32 = _stage0(_job(tmp_path, "fp32"))
    bf16_result = _job(tmp_path, "bf16", training={"grad_reduce": "bf16"})
    bf16 = _stage0(bf16_result)
    assert fp32["gradients"] == 2 * bf16["gradients"]
    assert bf16["parameters"] == fp32["parameters"]
    # Llama 3 8B on 8 H100 (TP 1, CP 2, distributed optimizer) fits with the bf16 buffer, as it ran
    assert "DSF301" not in _errors(bf16_result)
    assert _errors(_job(tmp_path, "explicit",
                        training={"grad_reduce": "fp32"})) == _errors(_job(tmp_path, "auto"))


def test_distributed_optimizer_shards_over_dp_times_cp(tmp_path: Path) -> None:
    cp2 = _stage0(_job(tmp_path, "cp2"))
    cp1 = _stage0(_job(tmp_path, "cp1", parallel={"cp": 1}))
    no_dist = _stage0(_job(tmp_path, "z0", parallel={"zero": 0}))
    assert cp2["optimizer"] == cp1["optimizer"]  # both shard over the 8 ranks (dp 4 x cp 2, dp 8 x cp 1)
    assert no_dist["optimizer"] == 8 * cp2["optimizer"]


def test_megatron_fsdp_shards_gradients_then_weights(tmp_path: Path) -> None:
    z1, z2, z3 = (_stage0(_job(tmp_path, f"z{z}", parallel={"zero": z})) for z in (1, 2, 3))
    assert z2["gradients"] == z1["gradients"] / 8
    assert z2["parameters"] == z1["parameters"]
    assert z3["parameters"] < z1["parameters"] / 7 and z3["buffers"] > 0
    assert "DSF311" in _errors(_job(tmp_path, "pp", parallel={"zero": 3, "pp": 2, "cp": 1}))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 200), st.integers(2, 32), st.integers(1, 4), st.booleans(), st.booleans())
def test_accounted_partition_is_megatrons_rule(layers: int, pp: int, vp: int, emb: bool, loss: bool) -> None:
    split = accounted_partition(layers, pp, vp, emb, loss)
    total = layers + emb + loss
    if total % pp or (total // pp) % vp:
        assert split == []  # Megatron-Core raises for this split
        return
    per = total // (pp * vp)
    if per - emb < 0 or per - loss < 0:
        assert split == []  # "Not enough layers in the first (last) virtual pipeline stage"
        return
    assert len(split) == pp * vp and sum(split) == layers and min(split) >= 0
    assert split[0] == per - emb and split[-1] == per - loss
    assert all(n == per for n in split[1:-1])


def test_llama3_405b_split_with_embedding_and_loss_counted(tmp_path: Path) -> None:
    model = {"arch": "llama", "layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8,
             "ffn_hidden": 53248, "vocab": 128256, "seq_len": 8192}
    pipe = {"account_for_embedding": True, "account_for_loss": True}
    result = _job(tmp_path, "405b", model=model, nodes=256,
                  parallel={"tp": 8, "pp": 16, "cp": 1, "pipeline": pipe}, training={"global_batch": 2048})
    assert result.plan.stage_layers == [7] + [8] * 14 + [7]
    assert not {"DSF109", "DSF306"} & set(_errors(result))
    uneven = _job(tmp_path, "405b-plain", model=model, nodes=256, parallel={"tp": 8, "pp": 16, "cp": 1},
                  training={"global_batch": 2048})
    assert "DSF109" in _errors(uneven)  # 126 layers do not divide over 16 stages without the two counted
    other = _job(tmp_path, "405b-mds", stack="megatron-deepspeed", model=model, nodes=256,
                 parallel={"tp": 8, "pp": 16, "cp": 1, "pipeline": pipe}, training={"global_batch": 2048})
    assert "DSF306" in _errors(other)


def test_fp8_runs_linear_gemms_at_the_fp8_peak_and_only_under_te(tmp_path: Path) -> None:
    bf16 = _job(tmp_path, "bf16", parallel={"tp": 2, "cp": 1}, training={"grad_reduce": "bf16"})
    fp8 = _job(tmp_path, "fp8", parallel={"tp": 2, "cp": 1},
               training={"grad_reduce": "bf16", "precision": "fp8", "fp8_recipe": "delayed"})
    assert estimate_step(fp8.plan).step_s < estimate_step(bf16.plan).step_s
    # TE caches each linear weight's FP8 copy and its transpose: 2 bytes a parameter more than bf16
    extra = _stage0(fp8)["buffers"] - _stage0(bf16)["buffers"]
    assert extra > 0 and abs(extra - _stage0(bf16)["parameters"]) / extra < 0.01
    assert "DSF308" in _errors(_job(tmp_path, "ds", stack="dsforge", training={"precision": "fp8"}))
    assert "DSF308" in _errors(_job(tmp_path, "mds", stack="megatron-deepspeed",
                                    training={"precision": "fp8"}))


def test_megatron_deepspeed_prices_deepspeeds_zero_and_its_partition(tmp_path: Path) -> None:
    bloom = {"arch": "gpt2", "layers": 70, "hidden": 14336, "heads": 112, "vocab": 250880, "seq_len": 2048}
    result = _job(tmp_path, "bloom", stack="megatron-deepspeed", model=bloom, nodes=48,
                  parallel={"tp": 4, "pp": 12, "cp": 1, "zero": 0,
                            "pipeline": {"partition": "type:transformer"}},
                  training={"global_batch": 2048, "micro_batch": 2, "recompute": "full"})
    assert max(result.plan.stage_layers) == 6 and sum(result.plan.stage_layers) == 70
    assert "DSF109" not in _errors(result) and "DSF145" not in _errors(result)
    z3 = _job(tmp_path, "z3", stack="megatron-deepspeed", parallel={"cp": 1, "zero": 3})
    z1 = _job(tmp_path, "z1", stack="megatron-deepspeed", parallel={"cp": 1, "zero": 1})
    # DeepSpeed's ZeRO-3 partitions the weights
    assert _stage0(z3)["parameters"] < _stage0(z1)["parameters"] / 4


def test_megatron_keeps_fp16_gradients_in_fp16(tmp_path: Path) -> None:
    # Megatron-LM's arguments.py forces accumulate_allreduce_grads_in_fp32 only inside `if args.bf16:`; under
    # fp16 the store_true flag stays off, so the main-grad buffer and its all-reduce are fp16
    fp16 = _stage0(_job(tmp_path, "fp16", training={"precision": "fp16"}))
    bf16 = _stage0(_job(tmp_path, "bf16"))
    assert bf16["gradients"] == 2 * fp16["gradients"]
    explicit = _stage0(_job(tmp_path, "fp16-fp32", training={"precision": "fp16", "grad_reduce": "fp32"}))
    assert explicit["gradients"] == bf16["gradients"]
