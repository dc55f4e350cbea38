"""Pipeline stages from the plan: boundaries (pure), and a TP2 x PP2 DeepSpeed pipeline against the dense
model.

The 4-process test builds the dense HF model on every rank (same seed), rewrites each rank's stage,
runs it in DeepSpeed's PipelineEngine, and compares the loss before and after one SGD step with the
dense model's (GPT-2 with sequence parallelism on top). The step covers the backward through both stages, the
TP collectives and, for the tied GPT-2 head, DeepSpeed's all-reduce of the tied embedding gradient between
first and last stage. Each rank's parameter count must equal the plan's exact per-rank count for its stage.

Tolerance 1e-5 relative (see test_apply_tp.py): fp32 re-association only; a missing gradient
all-reduce or a wrong stage boundary changes the loss at O(lr * grad) = O(1e-2) or more.
"""

from __future__ import annotations

import copy
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

from dsforge.compiler.plan.plan import build_plan
from dsforge.compiler.spec.schema import JobSpec
from dsforge.runtime.pipeline_stages import boundaries
from dsforge.runtime.rewrite import RewriteError

RTOL = 1e-5
LR = 0.5


def test_boundaries_follow_the_plan_partition(job):
    _, plan = job({"preset": "tiny-llama"}, {"pp": 2, "pipeline": {"partition": [1, 3]}})
    assert boundaries(plan, 4, lead=1, tail=1) == [0, 2, 6]
    _, plan = job({"preset": "tiny-llama", "layers": 6}, {"pp": 3, "pipeline": {"partition": [1, 3, 2]}})
    assert boundaries(plan, 6, lead=2, tail=2) == [0, 3, 6, 10]
    _, plan = job({"preset": "tiny-llama"})
    assert boundaries(plan, 4, lead=1, tail=1) == [0, 6]
    _, plan = job({"preset": "tiny-llama"},
                  {"pp": 2, "pipeline": {"virtual_stages": 2, "schedule": "interleaved"}})
    with pytest.raises(RewriteError, match="no interleaved schedule"):
        boundaries(plan, 4, lead=1, tail=1)


class _SGD(torch.optim.SGD):
    """SGD that first sums the partial gradients of sequence-parallel parameters (Megatron's finalize
    step)."""

    def __init__(self, module: torch.nn.Module, tp_group: object) -> None:
        super().__init__(module.parameters(), lr=LR)
        self._params, self._tp = list(module.parameters()), tp_group

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        from dsforge.runtime.layers import allreduce_sequence_parallel_grads

        allreduce_sequence_parallel_grads(self._params, self._tp)
        return super().step(closure)


def _pipeline_parity(rank: int, spec: JobSpec) -> None:
    import deepspeed

    from dsforge.runtime.groups import create_groups
    from dsforge.runtime.models import build_model
    from dsforge.runtime.pipeline_stages import build_pipeline, ds_pipeline_config
    from dsforge.runtime.rewrite import plan_rewrite
    from tests.runtime.launcher import report

    plan = build_plan(spec)
    groups = create_groups(plan)
    dense = build_model(spec.model, "cpu", groups.size("tp"), seed=11)
    model = copy.deepcopy(dense)
    ids = torch.randint(0, spec.model.vocab, (2, 12), generator=torch.Generator().manual_seed(5))
    ref = dense(input_ids=ids, labels=ids).loss
    ref.backward()
    with torch.no_grad():
        for p in dense.parameters():
            p -= LR * p.grad
        ref_after = dense(input_ids=ids, labels=ids).loss
    if abs(ref_after.item() - ref.item()) < 1e-2:
        raise AssertionError("the SGD step hardly moves the loss; the "
                             "after-step comparison would prove nothing")

    rp = plan_rewrite(model, plan)
    pipe = build_pipeline(model, rp, plan, groups)
    stage = groups.index("pp")
    held = sum(p.numel() for p in pipe.parameters())
    if held != rp.stage_params()[stage]:
        raise AssertionError(f"rank {rank} (stage {stage}) holds {held} parameters, the plan says "
                             f"{rp.stage_params()[stage]}")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "gradient_clipping": 0.0, "pipeline": ds_pipeline_config(rp)}
    engine, *_ = deepspeed.initialize(model=pipe, config=config, optimizer=_SGD(pipe, groups.tp))
    name = spec.model.preset
    report(f"{name} pipeline loss", engine.eval_batch(iter([(ids, ids)])).reshape(()), ref.detach(), RTOL)
    engine.train_batch(iter([(ids, ids)]))
    report(f"{name} pipeline loss after a step", engine.eval_batch(iter([(ids, ids)])).reshape(()), ref_after,
           RTOL)


def _worker(rank: int, world: int, specs: list[JobSpec]) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    for spec in specs:
        _pipeline_parity(rank, spec)


@pytest.mark.slow
def test_tp2_pp2_pipeline_matches_the_dense_model(job):
    from tests.runtime.launcher import run

    llama, _ = job({"preset": "tiny-llama"}, {"tp": 2, "pp": 2, "pipeline": {"partition": [1, 3]}})
    gpt2, _ = job({"preset": "tiny-gpt2"}, {"tp": 2, "pp": 2, "sequence_parallel": True})
    run(_worker, 4, [llama, gpt2])
