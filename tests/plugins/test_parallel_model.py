"""The shared core of the trainer plugins (dsforge.plugins.parallel_model) on real gloo DeepSpeed: the user's dense
HF model rewritten by the plan, trained by a `deepspeed.initialize` given the core's mpu, equals one process.

One 2-rank world (tp=2, sequence parallelism, ZeRO-1) asserts: the rewrite happened (shard shapes), every step's
loss and gradient norm equal the single-process reference's, check_batch refuses different data inside the TP
group, and the saved HF directory loads with from_pretrained and gives the trained reference's logits.
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
