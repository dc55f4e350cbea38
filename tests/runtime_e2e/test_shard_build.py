"""Each rank builds only its shard, and a pretrained checkpoint loads slice by slice into any layout.

One 2-rank world runs every case (starting ranks dominates the cost on two cores):

* the rank's parameters, built on the meta device and filled from the seed, equal the slices
  ``from_dense`` cuts out of the dense single-process model, bit for bit (tp2 Llama, with and without
  sequence parallelism, tp2 GPT-2 with
  its fused Conv1D QKV and tied head, ep2 Mixtral, pp2 Llama, pp2 GPT-2 with the tie across stages);
* a tiny random HF Llama (one safetensors file) and a Qwen2 (q/k/v biases, tied head, an index of 8
  shards), saved with ``save_pretrained``, fine-tuned under tp=2, pp=2 and ZeRO-3 dp=2: the first
  step's loss equals the single-process ``from_pretrained`` model's loss on the same global batch
  (fp32, 1e-5 relative), and the reads each rank made (``DSFORGE_READ_LOG``) are exactly its own
  slices: within the tensor-parallel group the ranges of every tensor are disjoint and cover it,
  and no rank reads a tensor of another pipeline stage;
* under ZeRO-3 dp=2 (the pretrained Llama and Qwen2, and a seeded tiny Llama trained 2 steps against
  the single-process reference) each parameter is partitioned as soon as it is filled: watched after
  every fill (``watch_fill``), every parameter made so far holds only its 1/dp partition and none is
  whole, so no rank ever held more than its partition plus the parameter being filled, and the engine
  trains exactly those partitions (DeepSpeed converted nothing more);
* pretrained MoE checkpoints stored one tensor per expert (Mixtral, Qwen2-MoE, Qwen3-MoE under ep2) and a
  Qwen3 under tp2, fine-tuned, their reads checked and their exports compared
  (tests/runtime_e2e/pretrained_moe.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.runtime.launcher import run
from tests.runtime_e2e import pretrained_moe
from tests.runtime_e2e.harness import SGD_DEEPSPEED, check_parity, job_spec, run_parallel, training

LOSS_RTOL = 1e-5
SHARD_CASES = [("tiny-llama", {"tp": 2}), ("tiny-llama", {"tp": 2, "sequence_parallel": True}),
               ("tiny-gpt2", {"tp": 2}), ("tiny-mixtral", {"dp": 2, "ep": 2}), ("tiny-llama", {"pp": 2}),
               ("tiny-gpt2", {"pp": 2})]
PRETRAINED_LAYOUTS = {"tp2": {"tp": 2, "zero": 1}, "pp2": {"pp": 2, "zero": 1}, "zero3-dp2": {"zero": 3}}


def save_tiny(kind: str, out: Path) -> Path:
    """A tiny random HF model written with save_pretrained (Qwen2: tied head, biases, 8 safetensors
    shards)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}
    torch.manual_seed(5)
    if kind == "llama":
        model = AutoModelForCausalLM.from_config(LlamaConfig(**common, tie_word_embeddings=False))
        model.save_pretrained(out)
    else:
        model = AutoModelForCausalLM.from_config(Qwen2Config(**common, tie_word_embeddings=True))
        with torch.no_grad():  # Qwen2 initialises its biases to zero: make them count
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.02)
        model.save_pretrained(out, max_shard_size="60KB")
    return out


def pretrained_spec(tmp: Path, name: str, directory: Path, parallel: dict[str, Any]) -> Any:
    from dsforge.compiler.frontend.parse import load_job

    doc = {"version": 1, "name": name, "model": {"pretrained": str(directory), "seq_len": 32},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 2}, "parallel": {"dp": "auto", **parallel},
           "training": training(), "deepspeed": SGD_DEEPSPEED}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    job, diags = load_job(path)
    assert job is not None, [d.message for d in diags]
    return job.spec


def reference_first_loss(spec: Any, **config: Any) -> float:
    """The loss of the first global batch under the single-process from_pretrained model (fp32; ``config``:
    overrides of its config.json)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from dsforge.runtime.data import Batches, Sharding, SyntheticTokens

    m, t = spec.model, spec.training
    model = AutoModelForCausalLM.from_pretrained(m.pretrained, dtype=torch.float32,
                                                 attn_implementation="sdpa", **config)
    tokens = Batches(SyntheticTokens(m.vocab, m.seq_len, t.seed), t.global_batch, t.micro_batch,
                     Sharding(1, 0)).global_batch_tokens(0)
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
    return float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)))


def check_reads(spec: Any, reads: list[list[dict[str, Any]]], coords: list[tuple[int, int]]) -> None:
    """Every read is of the reader's own stage; a TP group's ranges of each tensor are disjoint and cover
    it."""
    from dsforge.compiler.plan.plan import build_plan
    from dsforge.runtime.models import build_model
    from dsforge.runtime.pipeline_stages import stage_modules
    from dsforge.runtime.rewrite import plan_rewrite

    plan = build_plan(spec)
    rp = plan_rewrite(build_model(plan.model, "meta"), plan)
    module_of = {}
    for entry in rp.modules:
        for p in entry.params:
            # tied: its owner
            module_of.setdefault(entry.owners.get(p.name, f"{entry.name}.{p.name}"), (entry.name, p))
    groups: dict[tuple[int, str], list[tuple[int, dict[str, Any]]]] = {}
    for rank, (tp_index, stage) in enumerate(coords):
        allowed = stage_modules(rp, stage)
        assert reads[rank], f"rank {rank} read nothing"
        for r in reads[rank]:
            module, p = module_of[r["key"]]
            assert module in allowed, f"rank {rank} (stage {stage}) read {r['key']} of another stage"
            assert r["shape"] == list(p.shape)
            if p.dim is None:
                assert r["dim"] is None, f"rank {rank} read a slice of {r['key']}, which it holds whole"
            else:
                assert r["dim"] == p.dim and sum(n for _, n in r["ranges"]) == p.shard[p.dim], (rank, r, p)
                groups.setdefault((stage, r["key"]), []).append((tp_index, r))
    for (stage, key), hits in groups.items():
        assert sorted(i for i, _ in hits) == list(range(plan.degrees.tp)), (key, hits)
        covered = sorted(j for _, r in hits for s, n in r["ranges"] for j in range(s, s + n))
        assert covered == list(range(hits[0][1]["shape"][hits[0][1]["dim"]])), (
            f"{key}: ranges overlap or leave gaps"
        )


class PartitionWatch:
    """Checks, after each parameter the build fills, that every parameter made so far holds only its
    partition."""

    def __init__(self, dp: int) -> None:
        self.dp = dp
        self.made: list[Any] = []
        self.largest = 0  # elements of the largest parameter: the most the build held whole at once

    def __call__(self, root: Any, target: Any, param: Any) -> None:
        assert hasattr(param, "ds_id"), f"{target.dense} was filled but not handed to ZeRO-3"
        self.made.append(param)
        self.largest = max(self.largest, param.ds_numel)
        for p in self.made:
            assert p.data.numel() == 0 and p.ds_tensor.numel() == math.ceil(p.ds_numel / self.dp), \
                (target.dense, p.ds_shape, p.data.numel(), p.ds_tensor.numel())
        whole = [n for n, p in root.named_parameters() if p.device.type != "meta" and not hasattr(p, "ds_id")]
        assert not whole, f"whole parameters beside the partitions while filling {target.dense}: {whole[:4]}"

    def check_engine(self, name: str, engine: Any) -> None:
        """The engine trains the partitions the build made: the same parameters, none converted again."""
        mine = {id(p) for p in engine.module.parameters()}
        assert mine == {id(p) for p in self.made}, (f"{name}: the engine's parameters are not the ones the "
                                                    f"build partitioned")
        held = sum(p.ds_tensor.numel() for p in self.made)
        total = sum(p.ds_numel for p in self.made)
        assert held <= total / self.dp + len(self.made), (held, total)
        print(f"ZERO3-BUILD {name}: {len(self.made)} parameters, {held} of {total} elements held, largest "
              f"whole parameter {self.largest}", flush=True)


def _world(rank: int, world: int, tmp: str, dirs: dict[str, str], moe: tuple[Any, Any]) -> None:
    import torch.distributed as dist

    from dsforge.compiler.emit.ds_config import build_ds_config
    from dsforge.compiler.plan.plan import build_plan
    from dsforge.runtime.engine import build_parallel_model, build_pipeline_module, parallelize, pipeline_loss
    from dsforge.runtime.groups import create_groups
    from dsforge.runtime.models import build_model
    from dsforge.runtime.pipeline_stages import build_pipeline
    from dsforge.runtime.rewrite import plan_rewrite
    from tests.runtime_rewrite.conftest import make_job

    torch.use_deterministic_algorithms(True)
    jobs = Path(tmp) / f"jobs{rank}"
    jobs.mkdir(exist_ok=True)
    for preset, par in SHARD_CASES:
        spec = make_job(jobs, {"preset": preset}, par)
        plan, seed = build_plan(spec), spec.training.seed
        groups = create_groups(plan)
        dense = build_model(plan.model, "cpu", plan.degrees.tp, seed=seed)
        if plan.degrees.pp > 1:
            built = build_pipeline_module(plan, groups, build_ds_config(plan))
            sliced = build_pipeline(dense, plan_rewrite(dense, plan), plan, groups, loss_fn=pipeline_loss)
        else:
            built, sliced = build_parallel_model(plan, groups), parallelize(dense, plan, groups)
        mine, want = dict(built.named_parameters()), dict(sliced.named_parameters())
        assert mine.keys() == want.keys()
        wrong = [n for n in mine if not torch.equal(mine[n], want[n].to(mine[n].dtype))]
        assert not wrong, (f"{preset} {par}: rank {rank}'s shards differ "
                           f"from the dense model's slices: {wrong[:4]}")
    from dsforge.runtime.materialize import watch_fill

    spec = job_spec(jobs, "llama-zero3-build", "tiny-llama", {"zero": 3}, world)
    watch = PartitionWatch(world)
    with watch_fill(watch):
        engine, groups, losses, norms = run_parallel(spec, steps=2)  # test_equivalence trains ZeRO-3 4 steps
    watch.check_engine("llama-zero3-build", engine)
    check_parity("llama-zero3-build", spec, losses, norms)
    del engine
    for kind, directory in dirs.items():
        for layout, par in PRETRAINED_LAYOUTS.items():
            name = f"{kind}-{layout}"
            spec = pretrained_spec(jobs, name, Path(directory), par)
            log = Path(tmp) / f"{name}.rank{rank}.jsonl"
            os.environ["DSFORGE_READ_LOG"] = str(log)
            watch = PartitionWatch(world) if par.get("zero") == 3 else None
            try:
                with watch_fill(watch) if watch is not None else contextlib.nullcontext():
                    engine, groups, losses, _ = run_parallel(spec, steps=1)
            finally:
                del os.environ["DSFORGE_READ_LOG"]
            if watch is not None:
                watch.check_engine(name, engine)
            want_loss = reference_first_loss(spec)
            rel = abs(losses[0] - want_loss) / abs(want_loss)
            print(f"PRETRAINED rank={rank} {name}: first loss {losses[0]:.7f}, from_pretrained "
                  f"{want_loss:.7f}, rel {rel:.1e}", flush=True)
            assert rel <= LOSS_RTOL, f"{name}: first-step loss {losses[0]} != from_pretrained {want_loss}"
            reads = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, (reads, (groups.index("tp"), groups.index("pp"))))
            if rank == 0:
                check_reads(spec, [e[0] for e in everyone], [e[1] for e in everyone])
            del engine
    pretrained_moe.finetune_and_export(rank, world, *moe, tmp)


@pytest.mark.slow
def test_shard_build_and_pretrained_loads(tmp_path: Path) -> None:
    dirs = {kind: str(save_tiny(kind, tmp_path / kind)) for kind in ("llama", "qwen2")}
    assert len(list(Path(dirs["qwen2"]).glob("*.safetensors"))) > 1  # the index path is exercised
    moe = pretrained_moe.prepare(tmp_path / "moe")
    run(_world, 2, str(tmp_path), dirs, moe)
