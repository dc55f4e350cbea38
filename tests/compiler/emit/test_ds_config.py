"""ds_config.json from the plan, without DeepSpeed: batch identity, ZeRO knobs, precision, optimizer,
schedule."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsforge.compiler.emit.ds_config import build_ds_config
from dsforge.compiler.emit.optim import scheduler_section
from dsforge.compiler.spec.schema import SchedulerSpec
from tests.conftest import EXAMPLES
from tests.test_compile_support import example_plan, variant_plan


@pytest.mark.parametrize("name", [p.stem for p in EXAMPLES])
def test_batch_keys_satisfy_deepspeeds_identity_with_the_plans_dp(name: str) -> None:
    plan = example_plan(name)
    cfg = build_ds_config(plan)
    assert plan.degrees is not None
    assert cfg["train_batch_size"] == plan.spec.training.global_batch
    assert cfg["train_batch_size"] == (
        cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * plan.degrees.dp
    )
    assert cfg["zero_optimization"]["stage"] == plan.zero
    assert ("pipeline" in cfg) == (plan.degrees.pp > 1)


def test_zero_stage_0_has_no_knobs(tmp_path: Path) -> None:
    cfg = build_ds_config(variant_plan(tmp_path, "tiny-tp2-dp2", {"parallel": {"zero": 0}}))
    assert cfg["zero_optimization"] == {"stage": 0}


def test_zero_1_and_2_buckets_scale_with_the_model_width(tmp_path: Path) -> None:
    plan = example_plan("llama3-8b-dgx-h100")  # hidden 4096, ZeRO-1, GPUs
    z = build_ds_config(plan)["zero_optimization"]
    assert z["reduce_bucket_size"] == z["allgather_bucket_size"] == 4096 * 4096
    assert z["overlap_comm"] is True
    assert "contiguous_gradients" not in z and "stage3_prefetch_bucket_size" not in z
    z2 = build_ds_config(variant_plan(tmp_path, "llama3-8b-dgx-h100",
                                      {"parallel": {"zero": 2}}))["zero_optimization"]
    assert z2["contiguous_gradients"] is True and z2["stage"] == 2


def test_zero_3_prefetch_and_persistence_follow_hidden(tmp_path: Path) -> None:
    z = build_ds_config(variant_plan(tmp_path, "tiny-tp2-dp2",
                                     {"parallel": {"zero": 3}}))["zero_optimization"]
    h = 64
    assert z["stage3_prefetch_bucket_size"] == int(0.9 * h * h)
    assert z["stage3_param_persistence_threshold"] == 10 * h
    assert z["reduce_bucket_size"] == h * h
    assert z["overlap_comm"] is False  # CPU ranks: no second stream to overlap with
    assert "allgather_bucket_size" not in z


def test_offload_targets(tmp_path: Path) -> None:
    cpu = variant_plan(tmp_path, "llama3-8b-dgx-h100", {"parallel": {"zero": 2},
                                                        "training": {"optimizer": {"offload": "cpu"}}})
    cfg = build_ds_config(cpu)
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    nvme = variant_plan(tmp_path, "llama3-8b-dgx-h100", {
        "parallel": {"zero": 3}, "training": {"optimizer": {"offload": "nvme"}},
        "deepspeed": {"zero_optimization": {"offload_optimizer": {"nvme_path": "/local_nvme"}}}})
    assert build_ds_config(nvme)["zero_optimization"]["offload_optimizer"] == {
        "device": "nvme", "pin_memory": True, "nvme_path": "/local_nvme"}


@pytest.mark.parametrize(("precision", "present", "absent"),
                         [("bf16", "bf16", "fp16"), ("fp16", "fp16", "bf16"), ("fp32", None, None)])
def test_precision_sections(tmp_path: Path, precision: str, present: str | None, absent: str | None) -> None:
    # a tiny model on 4 H100s: fp16 needs a GPU, and any precision fits its memory
    cfg = build_ds_config(variant_plan(tmp_path, "tiny-tp2-dp2", {"hardware": {"preset": "dgx-h100"},
                                                                  "training": {"precision": precision}}))
    if present is None:
        assert "bf16" not in cfg and "fp16" not in cfg
        return
    assert cfg[present]["enabled"] is True and absent not in cfg
    if present == "fp16":
        assert cfg["fp16"]["loss_scale"] == 0  # dynamic loss scaling


def test_optimizer_names_and_parameters(tmp_path: Path) -> None:
    def opt(name: str, base: str = "llama3-8b-dgx-h100") -> dict:
        plan = variant_plan(tmp_path, base, {"training": {"optimizer": {"name": name}},
                                             "deepspeed": {"zero_allow_untested_optimizer": True}})
        return build_ds_config(plan)["optimizer"]

    adamw = opt("adamw")
    assert (
        adamw["type"] == "AdamW"
        and adamw["params"]["betas"] == [0.9, 0.95]
        and "torch_adam" not in adamw["params"]
    )
    assert opt("adam")["params"]["adam_w_mode"] is False
    lion = opt("lion")
    assert lion["type"] == "Lion" and "eps" not in lion["params"]
    assert opt("sgd")["type"] == "SGD"
    # CPU ranks use torch's AdamW rather than JIT-building DeepSpeed's fused kernel
    assert opt("adamw", "tiny-tp2-dp2")["params"]["torch_adam"] is True


def test_schedules() -> None:
    assert scheduler_section(SchedulerSpec(name="constant"), 1e-3, 100) is None
    warm = scheduler_section(SchedulerSpec(name="constant", warmup_steps=10), 1e-3, 100)
    assert warm == {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                  "warmup_num_steps": 10, "warmup_type": "linear"}}
    cos = scheduler_section(SchedulerSpec(name="cosine", warmup_steps=0, min_lr=1e-4), 1e-3, 100)
    assert cos is not None and cos["type"] == "WarmupCosineLR"
    assert cos["params"]["warmup_min_ratio"] == 1.0 and cos["params"]["cos_min_ratio"] == pytest.approx(0.1)
    lin = scheduler_section(SchedulerSpec(name="linear", warmup_steps=5, min_lr=1e-5), 1e-3, 100)
    assert lin is not None and lin["type"] == "WarmupDecayLR" and lin["params"]["warmup_min_lr"] == 1e-5


def test_recompute_sections(tmp_path: Path) -> None:
    none = build_ds_config(example_plan("tiny-3d"))
    assert "activation_checkpointing" not in none and none["pipeline"]["activation_checkpoint_interval"] == 0
    full = build_ds_config(variant_plan(tmp_path, "tiny-3d", {"training": {"recompute": "full"}}))
    assert full["activation_checkpointing"]["partition_activations"] is True  # tp 2
    assert full["pipeline"]["activation_checkpoint_interval"] == 1
    selective = build_ds_config(example_plan("llama3-8b-dgx-h100"))
    assert selective["activation_checkpointing"]["partition_activations"] is False


def test_context_parallel_pins_sequence_communication_to_fp32(tmp_path: Path) -> None:
    plan = variant_plan(tmp_path, "tiny-tp2-dp2", {"parallel": {"tp": 1, "cp": 2}})
    assert build_ds_config(plan)["seq_parallel_communication_data_type"] == "fp32"
    assert "seq_parallel_communication_data_type" not in build_ds_config(example_plan("tiny-tp2-dp2"))


def test_overrides_are_merged_last(tmp_path: Path) -> None:
    plan = variant_plan(tmp_path, "llama3-8b-dgx-h100", {"deepspeed": {
        "zero_optimization": {"reduce_bucket_size": 123}, "steps_per_print": 7,
        "optimizer": {"params": {"torch_adam": True}}}})  # (an lr the job states is DSF527's to refuse)
    cfg = build_ds_config(plan)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 123
    assert (
        cfg["zero_optimization"]["stage"] == 1
        and cfg["zero_optimization"]["allgather_bucket_size"] == 4096**2
    )
    assert cfg["steps_per_print"] == 7
    assert cfg["optimizer"]["params"]["torch_adam"] is True and cfg["optimizer"]["type"] == "AdamW"
    assert cfg["optimizer"]["params"]["lr"] == plan.spec.training.optimizer.lr  # merged into, not replaced


def test_sequence_parallel_pipelines_send_whole_stage_activations(tmp_path: Path) -> None:
    """SP x TP x PP: each TP rank's activation is its own sequence slice, so DeepSpeed must not split and
    all-gather it as if replicated (pipe/grad_partitioned off); without SP (or with tp 1) DeepSpeed's
    default."""
    sp = build_ds_config(example_plan("llama3-70b-multinode"))["pipeline"]  # tp 8 x pp 4, sequence_parallel
    assert (sp["pipe_partitioned"], sp["grad_partitioned"]) == (False, False)
    plain = build_ds_config(example_plan("tiny-3d"))["pipeline"]  # tp 2 x pp 2, no sequence parallelism
    assert (plain["pipe_partitioned"], plain["grad_partitioned"]) == (True, True)
    sp_3d = build_ds_config(variant_plan(tmp_path, "tiny-3d", {"parallel": {"sequence_parallel": True}}))
    assert (sp_3d["pipeline"]["pipe_partitioned"], sp_3d["pipeline"]["grad_partitioned"]) == (False, False)
    # DSF110 warns only
    tp1 = variant_plan(tmp_path, "tiny-pp2-dp2", {"parallel": {"sequence_parallel": True}})
    assert build_ds_config(tp1)["pipeline"]["pipe_partitioned"] is True
