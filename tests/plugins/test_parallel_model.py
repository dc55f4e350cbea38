"""The shared core of the trainer plugins (dsforge.plugins.parallel_model) on real gloo DeepSpeed: the user's
dense HF model rewritten by the plan, trained by a `deepspeed.initialize` given the core's mpu, equals one
process.

One 2-rank world (tp=2, sequence parallelism, ZeRO-1) asserts: the rewrite happened (shard shapes), every
step's loss and gradient norm equal the single-process reference's, check_batch refuses different data inside
the TP group, and the saved HF directory loads with from_pretrained and gives the trained reference's logits.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.runtime.launcher import run
from tests.runtime_e2e.harness import compare, expect_shapes, job_spec, reference_optimizer
from tests.runtime_e2e.test_equivalence import LLAMA_TP2


def _train(rank: int, world: int, path: str, tmp: str) -> None:
    import deepspeed

    from dsforge.plugins.job import PlanMismatchError, load_job
    from dsforge.plugins.parallel_model import check_batch, data_shard, mpu, prepare_model, save_hf
    from dsforge.runtime.models import build_model

    job = load_job(path)
    spec, plan = job.plan.spec, job.plan
    t = spec.training
    dense = build_model(spec.model, "cpu", 1, seed=t.seed).train()
    reference = copy.deepcopy(dense)
    model = prepare_model(job, dense)
    expect_shapes("core", model, LLAMA_TP2)  # half of the heads and of the vocabulary: the rewrite happened
    assert data_shard(job) == (0, 1)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                      config=job.ds_config(), mpu=mpu(job))
    assert engine.zero_optimization_stage() == 1
    opt = reference_optimizer(spec, reference.parameters())
    g = torch.Generator().manual_seed(5)
    accum = plan.grad_accum
    losses, norms, want_losses, want_norms = [], [], [], []
    for step in range(3):
        batch = torch.randint(0, spec.model.vocab, (t.global_batch, spec.model.seq_len), generator=g)
        if step == 0:
            check_batch(job, batch)
            with pytest.raises(PlanMismatchError, match="parallel.tp"):
                check_batch(job, batch + rank)
        total = want = 0.0
        for m in range(accum):
            ids = batch[m * t.micro_batch:(m + 1) * t.micro_batch]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            total += float(loss.detach()) / accum
            ref = reference(input_ids=ids, labels=ids).loss / accum
            ref.backward()
            want += float(ref)
        want_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), t.grad_clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
        want_losses.append(want)
        norms.append(float(engine.get_global_grad_norm()))
    compare("core tp2 sp zero1", "losses", losses, want_losses)
    compare("core tp2 sp zero1", "grad norms", norms, want_norms)
    save_hf(engine.module, tmp)
    if rank == 0:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(tmp).eval()
        ids = batch[:2]
        with torch.no_grad():
            got, exp = loaded(input_ids=ids).logits, reference.eval()(input_ids=ids).logits
        err = float((got - exp).abs().max() / exp.abs().max())
        print(f"PARITY saved logits rel {err:.2e}", flush=True)
        assert err < 1e-5, err


@pytest.mark.slow
def test_core_tp2_sequence_parallel_zero1(tmp_path: Path) -> None:
    job_spec(tmp_path, "core", "tiny-llama", {"tp": 2, "sequence_parallel": True, "zero": 1}, 2)
    run(_train, 2, str(tmp_path / "core.yaml"), str(tmp_path / "saved"))


def _job(tmp: Path, parallel: str, preset: str = "tiny-llama", ranks: int = 2) -> Path:
    path = tmp / "job.yaml"
    path.write_text(f"version: 1\nname: t\nmodel: {{preset: {preset}}}\nhardware: {{preset: cpu-local, "
                    f"gpus_per_node: {ranks}}}\nparallel: {{{parallel}}}\ntraining: {{global_batch: 8, "
                    f"micro_batch: 1, precision: fp32, steps: 2}}\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(("parallel", "preset", "rule", "key"), [
    ("pp: 2", "tiny-llama", "DSF702", "parallel.pp=2"),
    ("cp: 2", "tiny-llama", "DSF703", "parallel.cp=2"),
    ("ep: 2", "tiny-mixtral", "DSF704", "parallel.ep=2"),
])
def test_layouts_a_trainer_cannot_feed_are_refused_before_start(tmp_path: Path, parallel: str, preset: str,
                                                                rule: str,
                                                                 key: str) -> None:
    from dsforge.plugins.hf import prepare_model, training_args_kwargs
    from dsforge.plugins.job import PluginError

    job = _job(tmp_path, parallel, preset)
    for call in (training_args_kwargs, prepare_model):
        with pytest.raises(PluginError, match=rf"^{rule}: .*job.yaml: {key} at "
                                              rf".*job.yaml:\d+:\d+.*dsforge compile"):
            call(job)


def test_tensor_parallel_without_an_mpu_hook_is_refused_with_its_reason(tmp_path: Path) -> None:
    # No built-in plugin needs DSF705 now: the HF Trainer and Accelerate run tp > 1 through DeepSpeed's
    # tensor_parallel section (tests/plugins/test_hf.py, test_accelerate.py); the core keeps the refusal for a
    # trainer whose deepspeed.initialize gets no mpu by any documented way.
    from dsforge.plugins.job import PluginError
    from dsforge.plugins.parallel_model import refuse_without_mpu

    job = _job(tmp_path, "tp: 2")
    with pytest.raises(PluginError, match=r"^DSF705: .*tp=2: MyTrainer .* without an mpu "
                                          r"\(its loop calls deepspeed.initialize\).*parallel_model.mpu"):
        refuse_without_mpu(job, "MyTrainer", "its loop calls deepspeed.initialize")
    (tmp_path / "tp1").mkdir()
    assert refuse_without_mpu(_job(tmp_path / "tp1", "tp: 1"), "MyTrainer", "").plan.degrees.tp == 1


def _train_dp(rank: int, world: int, path: str, ckpt: str) -> None:
    """tp=2 x dp=2: each dp rank reads its half of the global batch; the step's loss (mean over dp) equals one
    process's; a run resumed from DeepSpeed's checkpoint of step 2 gives the uninterrupted step 3 loss
    exactly."""
    import deepspeed
    import torch.distributed as dist

    from dsforge.plugins.job import load_job
    from dsforge.plugins.parallel_model import data_shard, mpu, prepare_model, start
    from dsforge.runtime.models import build_model

    job = load_job(path)
    spec, plan = job.plan.spec, job.plan
    t = spec.training
    dp_rank, dp = data_shard(job)
    assert dp == 2
    group = start(job).groups.dp
    dense = build_model(spec.model, "cpu", 1, seed=t.seed).train()
    reference = copy.deepcopy(dense)
    opt = reference_optimizer(spec, reference.parameters())
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, spec.model.vocab, (t.global_batch, spec.model.seq_len),
                             generator=g) for _ in range(3)]

    def engine_of(model: torch.nn.Module) -> object:
        engine, *_ = deepspeed.initialize(model=prepare_model(job, model), config=job.ds_config(),
                                          mpu=mpu(job), model_parameters=None)
        return engine

    def step(engine: object, batch: torch.Tensor) -> float:
        mine = batch[dp_rank::dp]  # this dp rank's share; the TP ranks of one group take the same
        total = torch.zeros(())
        for m in range(plan.grad_accum):
            ids = mine[m * t.micro_batch:(m + 1) * t.micro_batch]
            loss = engine(input_ids=ids, labels=ids).loss  # type: ignore[operator]
            engine.backward(loss)  # type: ignore[attr-defined]
            engine.step()  # type: ignore[attr-defined]
            total += loss.detach() / plan.grad_accum
        dist.all_reduce(total, group=group)
        return float(total) / dp

    engine = engine_of(copy.deepcopy(dense))
    losses, want = [], []
    for i, batch in enumerate(batches):
        losses.append(step(engine, batch))
        if i == 1:
            engine.save_checkpoint(ckpt, tag="step2")  # type: ignore[attr-defined]
        ref = reference(input_ids=batch, labels=batch).loss  # HF's mean over the whole global batch
        ref.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(ref))
    compare("core tp2 x dp2", "losses", losses, want)
    resumed = engine_of(copy.deepcopy(dense))
    resumed.load_checkpoint(ckpt, tag="step2")  # type: ignore[attr-defined]
    again = step(resumed, batches[2])
    print(f"PARITY rank={rank} resumed step 3 {again!r} uninterrupted {losses[2]!r}", flush=True)
    assert again == losses[2], (again, losses[2])


@pytest.mark.slow
def test_core_tp2_dp2_matches_one_process_and_resumes_exactly(tmp_path: Path) -> None:
    job_spec(tmp_path, "core4", "tiny-llama", {"tp": 2, "dp": 2, "sequence_parallel": True, "zero": 1}, 4)
    run(_train_dp, 4, str(tmp_path / "core4.yaml"), str(tmp_path / "ckpt"))


def test_skeleton_is_built_outside_hf_zero3_init(tmp_path: Path) -> None:
    """Once an HF DeepSpeed config with ZeRO-3 exists (TrainingArguments does this), transformers builds every
    model under zero.Init, which cannot copy a meta skeleton ("Cannot copy out of meta tensor"): the rank's
    skeleton is built without it (dsforge partitions each parameter as it fills it), and HF's config is back
    afterwards."""
    from transformers.integrations.deepspeed import (
        HfDeepSpeedConfig,
        is_deepspeed_zero3_enabled,
        unset_hf_deepspeed_config,
    )

    from dsforge.plugins.job import load_job
    from dsforge.runtime.models import build_skeleton

    job = load_job(_job(tmp_path, "zero: 3"))
    hf = HfDeepSpeedConfig(job.ds_config())
    try:
        assert is_deepspeed_zero3_enabled()
        skeleton = build_skeleton(job.plan.model)
        assert is_deepspeed_zero3_enabled()  # restored
    finally:
        unset_hf_deepspeed_config()
    params = list(skeleton.parameters())
    assert params and all(p.device.type == "meta" and not hasattr(p, "ds_id") for p in params)
    assert sum(p.numel() for p in params) > 0
    del hf
