"""Shared pieces of the end-to-end tests: job specs from a few keys, the single-process reference, parity checks.

The reference is the dense HF model built from the job's seed on one process, trained with
torch.optim.AdamW and torch's gradient clipping on the whole global batch of every step (the
samples dsforge.runtime.data assigns to that step), in fp32. The parallel run must print the same
global-batch mean loss at every step; step 4's loss is the loss after 3 optimizer steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

from dsforge.compiler.parse import load_job
from dsforge.compiler.plan import Plan, build_plan
from dsforge.compiler.schema import JobSpec

STEPS = 4
# The bound. fp32 re-association of the sharded sums (TP all-reduces, DP/ZeRO averaging,
# ring softmax merges, expert all-to-alls) moves the loss by ~1e-6 relative over 3 Adam steps;
# a wrong shard, a lost gradient or a mis-scaled reduction moves it by 1e-3 or more.
RTOL = 1e-4


def training(**overrides: Any) -> dict[str, Any]:
    """Training keys of the test jobs: fp32, constant lr, clipping on, 4 steps."""
    base: dict[str, Any] = {"global_batch": 4, "micro_batch": 1, "precision": "fp32", "steps": STEPS,
                            "optimizer": {"name": "adamw", "lr": 3.0e-3, "weight_decay": 0.01},
                            "scheduler": {"name": "constant"}, "grad_clip": 1.0, "seed": 11}
    base.update(overrides)
    return base


def job_spec(tmp: Path, name: str, preset: str, parallel: dict[str, Any], world: int, nodes: int = 1,
             **train: Any) -> JobSpec:
    """A parsed job on cpu-local hardware with ``world`` ranks (over ``nodes`` nodes)."""
    doc = {"version": 1, "name": name, "model": {"preset": preset},
           "hardware": {"preset": "cpu-local", "nodes": nodes, "gpus_per_node": world // nodes},
           "parallel": {"dp": "auto", **parallel}, "training": training(**train)}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    job, diags = load_job(path)
    if job is None:
        raise AssertionError(f"test job {name} does not parse: {[d.message for d in diags]}")
    return job.spec


def reference_losses(spec: JobSpec, steps: int = STEPS) -> list[float]:
    """Global-batch mean losses of the dense model trained on one process (see the module doc)."""
    from dsforge.runtime.data import Batches, Sharding, SyntheticTokens
    from dsforge.runtime.models import build_model

    plan = build_plan(spec)
    t, m = spec.training, spec.model
    model = build_model(m, "cpu", plan.degrees.tp if plan.degrees else 1, seed=t.seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=t.optimizer.lr, betas=t.optimizer.betas, eps=t.optimizer.eps,
                            weight_decay=t.optimizer.weight_decay)
    data = Batches(SyntheticTokens(m.vocab, m.seq_len, t.seed), t.global_batch, t.micro_batch, Sharding(1, 0))
    losses = []
    for step in range(steps):
        tokens = data.global_batch_tokens(step)
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        if t.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def compare_losses(name: str, got: list[float], want: list[float], rtol: float = RTOL) -> None:
    """Every step's loss within ``rtol`` of the reference's; prints both so a failure shows the drift."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    rel = [abs(g - w) / abs(w) for g, w in zip(got, want)]
    print(f"PARITY rank={rank} {name}: losses {[f'{g:.6f}' for g in got]} reference {[f'{w:.6f}' for w in want]} "
          f"max rel {max(rel):.1e}", flush=True)
    if len(got) != len(want) or max(rel) > rtol:
        raise AssertionError(f"{name}: rank {rank} losses {got} differ from the single-process reference {want} "
                             f"by up to {max(rel):.2e} relative (allowed {rtol:.0e})")


def param_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Shapes this rank holds, by name (ZeRO-3 partitions report the shape before partitioning)."""
    return {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}


def expect_shapes(name: str, module: torch.nn.Module, expected: dict[str, tuple[int, ...]]) -> None:
    """Each named parameter (by name suffix) has exactly the expected shape on this rank."""
    shapes = param_shapes(module)
    for suffix, want in expected.items():
        hits = [n for n in shapes if n.endswith(suffix)]
        if not hits:
            raise AssertionError(f"{name}: no parameter named *{suffix}; this rank holds {sorted(shapes)[:12]}...")
        for n in hits:
            if shapes[n] != want:
                raise AssertionError(f"{name}: {n} is {shapes[n]} on this rank, expected {want}")


def run_parallel(spec: JobSpec, steps: int = STEPS) -> tuple[Any, Any, list[float]]:
    """Train ``spec`` on the already-initialised world with dsforge's runtime; (engine, groups, losses)."""
    from dsforge.compiler.emit.ds_config import build_ds_config
    from dsforge.runtime.data import batches_for
    from dsforge.runtime.engine import build_engine
    from dsforge.runtime.groups import create_groups
    from dsforge.runtime.train_loop import train

    plan: Plan = build_plan(spec)
    groups = create_groups(plan)
    engine = build_engine(plan, build_ds_config(plan), groups)
    results = train(engine, batches_for(plan, groups), groups, steps=steps, pipeline=plan.degrees.pp > 1)
    return engine, groups, [r.loss for r in results]
