"""Shared pieces of the end-to-end tests: job specs from a few keys, the single-process reference, parity
checks.

The reference is the dense HF model built from the job's seed on one process, trained with
torch.optim.AdamW and torch's gradient clipping on the whole global batch of every step (the
samples dsforge.runtime.data assigns to that step), in fp32. The parallel run must print the same
global-batch mean loss at every step; step 4's loss is the loss after 3 optimizer steps.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.plan.plan import Plan, build_plan
from dsforge.compiler.spec.schema import JobSpec

STEPS = 4
# The bound. fp32 re-association of the sharded sums (TP all-reduces, DP/ZeRO averaging,
# ring softmax merges, expert all-to-alls) moves the loss by ~1e-6 relative over 3 Adam steps;
# a wrong shard, a lost gradient or a mis-scaled reduction moves it by 1e-3 or more.
RTOL = 1e-4


def training(**overrides: Any) -> dict[str, Any]:
    """Training keys of the test jobs: fp32, 4 steps of SGD with momentum at a constant rate.

    SGD, not Adam: Adam's update g / sqrt(v) hides a gradient scaled by a constant (a reduction
    that sums where it should average, expert gradients divided by the wrong group size), SGD moves
    the loss in proportion to it. The clip threshold is far above any norm, so DeepSpeed computes the
    global gradient norm (compared with the reference's at every step) without changing the update.
    """
    base: dict[str, Any] = {"global_batch": 4, "micro_batch": 1, "precision": "fp32", "steps": STEPS,
                            "optimizer": {"name": "sgd", "lr": 0.5, "weight_decay": 0.01},
                            "scheduler": {"name": "constant"}, "grad_clip": 1.0e9, "seed": 11}
    base.update(overrides)
    return base


SGD_DEEPSPEED = {"zero_allow_untested_optimizer": True, "optimizer": {"params": {"momentum": 0.9}}}
ADAMW = {"optimizer": {"name": "adamw", "lr": 3.0e-3, "weight_decay": 0.01}, "grad_clip": 1.0}
# Clipping active at every step (the tiny models' norms are 0.4-1.2): with SGD the update is then
# lr * 0.1 * g / |g|, so a norm DeepSpeed computes wrongly (TP shards counted twice, a replicated
# weight missed) changes the loss; used where the engine does not report its norm (ZeRO-0).
CLIPPED = {"grad_clip": 0.1}


def job_spec(tmp: Path, name: str, preset: str, parallel: dict[str, Any], world: int, nodes: int = 1,
             **train: Any) -> JobSpec:
    """A parsed job on cpu-local hardware with ``world`` ranks (over ``nodes`` nodes)."""
    doc: dict[str, Any] = {"version": 1, "name": name, "model": {"preset": preset},
                           "hardware": {"preset": "cpu-local", "nodes": nodes,
                                        "gpus_per_node": world // nodes},
                           "parallel": {"dp": "auto", **parallel}, "training": training(**train)}
    if doc["training"]["optimizer"]["name"] == "sgd":
        doc["deepspeed"] = SGD_DEEPSPEED
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    job, diags = load_job(path)
    if job is None:
        raise AssertionError(f"test job {name} does not parse: {[d.message for d in diags]}")
    return job.spec


def reference_optimizer(spec: JobSpec, params: Any) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed builds from the job's ds_config (SGD, or AdamW for torch_adam)."""
    o = spec.training.optimizer
    if o.name == "sgd":
        momentum = spec.deepspeed.get("optimizer", {}).get("params", {}).get("momentum", 0.0)
        return torch.optim.SGD(params, lr=o.lr, momentum=momentum, weight_decay=o.weight_decay)
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


def reference_run(spec: JobSpec, steps: int = STEPS) -> tuple[list[float], list[float]]:
    """Global-batch mean losses and pre-clipping gradient norms of the dense model trained on one process."""
    from dsforge.runtime.data import Batches, Sharding, SyntheticTokens
    from dsforge.runtime.models import build_model

    plan = build_plan(spec)
    t, m = spec.training, spec.model
    model = build_model(m, "cpu", plan.degrees.tp if plan.degrees else 1, seed=t.seed).train()
    opt = reference_optimizer(spec, model.parameters())
    data = Batches(SyntheticTokens(m.vocab, m.seq_len, t.seed), t.global_batch, t.micro_batch, Sharding(1, 0))
    losses, norms = [], []
    for step in range(steps):
        tokens = data.global_batch_tokens(step)
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, norms


def compare(name: str, what: str, got: list[float], want: list[float], rtol: float = RTOL) -> None:
    """Every step's value within ``rtol`` of the reference's; prints both so a failure shows the drift."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    rel = [abs(g - w) / abs(w) for g, w in zip(got, want)] or [math.inf]
    print(f"PARITY rank={rank} {name} {what}: {[f'{g:.6f}' for g in got]} reference "
          f"{[f'{w:.6f}' for w in want]} max rel {max(rel):.1e}", flush=True)
    if len(got) != len(want) or max(rel) > rtol:
        raise AssertionError(f"{name}: rank {rank} {what} {got} differ from the single-process reference "
                             f"{want} by up to {max(rel):.2e} relative (allowed {rtol:.0e})")


def check_parity(name: str, spec: JobSpec, losses: list[float], norms: list[float]) -> None:
    """Losses (and, when DeepSpeed reports them, gradient norms) equal the single-process run's."""
    want_losses, want_norms = reference_run(spec, len(losses))
    compare(name, "losses", losses, want_losses)
    if all(math.isfinite(n) for n in norms):  # ZeRO-0 engines clip without recording the norm
        compare(name, "grad norms", norms, want_norms)


def param_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Shapes this rank holds, by name (ZeRO-3 partitions report the shape before partitioning)."""
    return {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}


def expect_shapes(name: str, module: torch.nn.Module, expected: dict[str, tuple[int, ...]]) -> None:
    """Each named parameter (by name suffix) has exactly the expected shape on this rank."""
    shapes = param_shapes(module)
    for suffix, want in expected.items():
        hits = [n for n in shapes if n.endswith(suffix)]
        if not hits:
            raise AssertionError(f"{name}: no parameter named *{suffix}; this rank holds "
                                 f"{sorted(shapes)[:12]}...")
        for n in hits:
            if shapes[n] != want:
                raise AssertionError(f"{name}: {n} is {shapes[n]} on this rank, expected {want}")


def run_parallel(spec: JobSpec, steps: int = STEPS,
                 resume: Any = None) -> tuple[Any, Any, list[float], list[float]]:
    """Train ``spec`` on the already-initialised world with dsforge's runtime; (engine, groups, losses,
    norms).

    ``resume``: a CheckpointPolicy to resume from first (the losses then start after its step).
    """
    from dsforge.compiler.emit.ds_config import build_ds_config
    from dsforge.runtime.data import batches_for
    from dsforge.runtime.engine import build_engine
    from dsforge.runtime.groups import create_groups
    from dsforge.runtime.train_loop import train

    plan: Plan = build_plan(spec)
    groups = create_groups(plan)
    engine = build_engine(plan, build_ds_config(plan), groups)
    norms: list[float] = []
    start = 0
    if resume is not None:
        from dsforge.runtime.checkpoint import resume as load

        start = load(engine, resume)
        assert start > 0, f"nothing to resume in {resume.directory}"
    results = train(engine, batches_for(plan, groups), groups, steps=steps, start=start,
                    pipeline=plan.degrees.pp > 1,
                    on_step=lambda n: norms.append(float(engine.get_global_grad_norm() or math.nan)))
    return engine, groups, [r.loss for r in results], norms
