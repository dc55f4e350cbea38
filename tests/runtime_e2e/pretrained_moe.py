"""Pretrained MoE checkpoints (save_pretrained: one tensor per expert) and Qwen3, fine-tuned and exported.

A part of test_shard_build's 2-rank world (``finetune_and_export`` runs there: a launch of its own
costs ~20 s more). Tiny random HF models are saved with ``save_pretrained``: a Mixtral with a sliding
window equal to the training sequence (32 tokens, so it covers it and validate accepts it), a Qwen2-MoE
(a gated shared expert, q/k/v biases, a router that does not renormalise its top-k), a Qwen3-MoE
(per-head q/k norms, a renormalising router) and a Qwen3 (per-head q/k norms, head_dim 32 on hidden 64
over 4 heads, tied head), and two types no hand-written family covers, placed by their HF plans: an OLMo 2
and an OLMoE (q/k norms over the whole projection; OLMoE's experts one tensor each). Each job is compiled
from `model.pretrained` (the three hand-written MoE models under ep2, Qwen3, OLMo 2 and OLMoE under tp2,
OLMoE under dp2 too: its router has no expert-parallel twin, DSF607) and trained 2 steps:

* the parameters the compiler counts from config.json (dsforge.compiler.model.hf_params, and for the
  hand-written families the model keys' formula, dsforge.compiler.model.params) are the model's;
* the first step's loss equals the single-process ``from_pretrained`` model's on the same global batch
  (fp32, 1e-5 relative); Mixtral's also equals that model's with the window removed (full causal);
* the reads each rank made (``DSFORGE_READ_LOG``) are its own: under ep2 each rank read exactly the
  experts its expert-parallel index owns (whole, every projection, nothing of the other rank's), every
  expert was read by its owner, and the router, the shared expert and attention whole; under tp2 the
  tensor-parallel group's cuts are disjoint and cover each tensor (test_shard_build.check_reads);
* the checkpoint of step 2 exported with ``dsforge export`` holds the experts as save_pretrained writes
  them (the key set of the save_pretrained directory it started from), and ``from_pretrained`` of it gives the
  trained parallel model's logits (1e-5 of their scale): two TP ranks whose copies of Qwen3's q/k norms had
  trained apart would be refused there.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
import yaml
from click.testing import CliRunner

from tests.runtime.launcher import report
from tests.runtime_e2e.harness import SGD_DEEPSPEED, training

LOSS_RTOL = 1e-5
LOGITS_RTOL = 1e-5
SEQ_LEN = 32
STEPS = 2
#: job name -> (the saved model it fine-tunes, its layout). Mixtral under tp2 (experts whole on both ranks,
#: attention cut as Llama's) adds ~10 s and nothing the other cases and tests/runtime do not cover.
LAYOUTS = {"mixtral-ep2": ("mixtral", {"ep": 2, "zero": 1}),
           "qwen2_moe-ep2": ("qwen2_moe", {"ep": 2, "zero": 1}),
           "qwen3_moe-ep2": ("qwen3_moe", {"ep": 2, "zero": 1}), "qwen3-tp2": ("qwen3", {"tp": 2, "zero": 1}),
           "olmo2-tp2": ("olmo2", {"tp": 2, "zero": 1}), "olmoe-dp2": ("olmoe", {"zero": 1}),
           "olmoe-tp2": ("olmoe", {"tp": 2, "zero": 1}),
           "granitemoe-tp2": ("granitemoe", {"tp": 2, "zero": 1}),
           "llama4_text-tp2": ("llama4_text", {"tp": 2, "zero": 1})}
EXPERT_READ = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$")
PROJECTIONS = {"mixtral": ("w1", "w2", "w3"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
               "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
               "olmoe": ("gate_proj", "up_proj", "down_proj")}


def save_tiny(kind: str, out: Path) -> Path:
    """A tiny random HF model of ``kind`` saved with save_pretrained (Mixtral's window covers SEQ_LEN)."""
    from transformers import (
        AutoModelForCausalLM,
        GraniteMoeConfig,
        Llama4TextConfig,
        MixtralConfig,
        Olmo2Config,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common: dict[str, Any] = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}
    torch.manual_seed(7)
    if kind == "mixtral":
        cfg: Any = MixtralConfig(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                 sliding_window=SEQ_LEN, **common)
    elif kind == "qwen2_moe":
        cfg = Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                             **common)
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                             num_experts_per_tok=2, norm_topk_prob=True, **common)
    elif kind == "olmoe":  # a MoE type without a hand-written family (q/k norms over the whole projection)
        cfg = OlmoeConfig(intermediate_size=32, num_experts=4, num_experts_per_tok=2, **common)
    elif kind == "granitemoe":  # experts stacked on disk as input_linear / output_linear; multipliers and
                                # scales
        cfg = GraniteMoeConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                               embedding_multiplier=2.0, logits_scaling=3.0, residual_multiplier=0.5,
                               attention_multiplier=0.2, **common)
    elif kind == "llama4_text":  # experts stacked on disk, gate_up_proj [E, hidden, 2F]; a shared expert,
                                 # NoPE layers
        cfg = Llama4TextConfig(intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4,
                               num_experts_per_tok=1, head_dim=16, no_rope_layers=[1, 0], **common)
    elif kind == "olmo2":  # no hand-written family: placed by its HF tp plan (q/k norms over the whole
                           # projection)
        cfg = Olmo2Config(intermediate_size=96, **common)
    else:
        cfg = Qwen3Config(intermediate_size=128, head_dim=32, tie_word_embeddings=True, **common)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # HF initialises biases and norms to constants: make every tensor tell
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(out)
    return out


def compile_pretrained(tmp: Path, name: str, directory: Path, parallel: dict[str, Any]) -> Path:
    """A job directory fine-tuning ``directory`` under ``parallel`` on 2 ranks (checkpoint at step STEPS)."""
    from dsforge.cli import cli

    doc = {"version": 1, "name": name, "model": {"pretrained": str(directory), "seq_len": SEQ_LEN},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 2}, "parallel": {"dp": "auto", **parallel},
           "training": {**training(steps=STEPS), "checkpoint": {"every": STEPS}}, "deepspeed": SGD_DEEPSPEED}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    result = CliRunner().invoke(cli, ["compile", str(path), "-o", str(tmp / name)])
    assert result.exit_code == 0, result.output
    return tmp / name


def check_expert_reads(spec: Any, reads: list[list[dict[str, Any]]], coords: list[tuple[int, int]]) -> None:
    """Experts read whole by the ranks whose ep index owns them only; the rest as check_reads wants it."""
    from dsforge.compiler.plan.plan import build_plan
    from tests.runtime_e2e.test_shard_build import check_reads

    plan = build_plan(spec)
    assert plan.degrees is not None
    if plan.model.moe is None:
        assert not [r for rank in reads for r in rank if EXPERT_READ.match(r["key"])]
        check_reads(spec, reads, [(tp, 0) for tp, _ in coords])
        return
    experts, ep, layers = plan.model.moe.experts, plan.degrees.ep, plan.model.layers
    per_rank = experts // ep
    readers: dict[tuple[int, int, str], set[int]] = {}
    others: list[list[dict[str, Any]]] = []
    for rank, ((_, ep_index), mine) in enumerate(zip(coords, reads, strict=True)):
        rest = []
        for r in mine:
            m = EXPERT_READ.match(r["key"])
            if m is None:
                rest.append({**r, "key": _model_name(r["key"], _kind(plan))})
                continue
            layer, e = int(m[1]), int(m[2])
            assert e // per_rank == ep_index, f"rank {rank} (ep index {ep_index}) read expert {e}: {r['key']}"
            assert r["dim"] is None, f"rank {rank} read a slice of {r['key']}, an expert it owns whole"
            readers.setdefault((layer, e, m[3]), set()).add(rank)
        others.append(rest)
    # experts stored as stacks (granitemoe's input_linear, llama4_text's gate_up_proj) are checked as tp cuts
    # above
    want = {(layer, e,
             w) for layer in range(layers) for e in range(experts) for w in PROJECTIONS.get(_kind(plan), ())}
    assert set(readers) == want, f"experts never read: {sorted(want - set(readers))[:6]}"
    for (layer, e, w), ranks in readers.items():  # each rank once per tensor; every rank of the owner's ep
                                                  # index
        owners = {r for r, (_, i) in enumerate(coords) if i == e // per_rank}
        assert ranks == owners, ((layer, e, w), ranks, owners)
    for rank, mine in enumerate(reads):
        keys = [r["key"] for r in mine]
        assert len(keys) == len(set(keys)), f"rank {rank} read a tensor twice"
    check_reads(spec, others, [(tp, 0) for tp, _ in coords])


def _model_name(key: str, kind: str) -> str:
    """The model's name of a checkpoint tensor the reader renamed (Mixtral's block_sparse_moe is the model's
    mlp, GraniteMoE's router.layer and input_linear / output_linear its router and expert stacks)."""
    from dsforge.runtime.pretrained import RENAMES

    for old, new in RENAMES if kind == "mixtral" else RENAMES[1:]:
        key = key.replace(old, new)
    return key


def _kind(plan: Any) -> str:
    """The checkpoint's family: its arch, or for `arch: auto` config.json's model_type."""
    if plan.model.arch != "auto":
        return str(plan.model.arch)
    return str(
        json.loads((Path(plan.model.pretrained) / "config.json").read_text(encoding="utf-8"))["model_type"]
    )


def prepare(tmp: Path) -> tuple[dict[str, str], dict[str, list[tuple[str, float]]]]:
    """Save the tiny models, compile every job, and compute each job's single-process first losses."""
    from dsforge.runtime.main import JobDir
    from tests.runtime_e2e.test_shard_build import reference_first_loss

    tmp.mkdir(parents=True, exist_ok=True)
    saved = {kind: save_tiny(kind,
                             tmp / f"tiny-{kind}") for kind in sorted({kind for kind, _ in LAYOUTS.values()})}
    jobs = {name: str(compile_pretrained(tmp, name, saved[kind], par)) for name,
            (kind, par) in LAYOUTS.items()}
    from transformers import AutoConfig, AutoModelForCausalLM

    from dsforge.compiler.model.hf_params import hf_param_count
    from dsforge.compiler.model.params import total_params

    refs: dict[str, list[tuple[str, float]]] = {}
    for name, job_dir in jobs.items():
        spec = JobDir.load(job_dir).plan.spec
        with torch.device("meta"):  # what explain and the memory checks count is the checkpoint's model
            hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec.model.pretrained))
        counted = sum(p.numel() for p in hf.parameters())
        config = json.loads((Path(spec.model.pretrained) / "config.json").read_text(encoding="utf-8"))
        count = hf_param_count(config)  # config.json's own structure, no torch: exact for the types it claims
        assert count.exact == (count.total == counted), (name, count.total, counted)
        if spec.model.arch != "auto":  # the model keys state every weight of a hand-written family
            assert total_params(spec.model) == counted, name
        refs[name] = [("from_pretrained", reference_first_loss(spec))]
        if spec.model.arch == "mixtral":  # its window (= seq_len) is exactly full causal attention
            refs[name].append(("full causal", reference_first_loss(spec, sliding_window=None)))
    return jobs, refs


def finetune_and_export(rank: int, world: int, jobs: dict[str, str], refs: dict[str, list[tuple[str, float]]],
                        tmp: str) -> None:
    """On each rank of the world: every job of ``prepare`` trained, its reads checked, exported and
    compared."""
    import time

    began = time.perf_counter()
    import torch.distributed as dist
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from dsforge.runtime import checkpoint as ckpt
    from dsforge.runtime.data import batches_for
    from dsforge.runtime.engine import build_engine
    from dsforge.runtime.export import export_checkpoint
    from dsforge.runtime.groups import create_groups
    from dsforge.runtime.main import JobDir
    from dsforge.runtime.train_loop import train
    from tests.runtime_e2e.test_export import parallel_logits

    torch.use_deterministic_algorithms(True)
    for name, job_dir in jobs.items():
        job = JobDir.load(job_dir)
        plan = job.plan
        groups = create_groups(plan)
        log = Path(tmp) / f"{name}.rank{rank}.jsonl"
        os.environ["DSFORGE_READ_LOG"] = str(log)
        try:
            engine = build_engine(plan, job.ds_config, groups)
        finally:
            del os.environ["DSFORGE_READ_LOG"]
        results = train(engine, batches_for(plan, groups, job.path), groups, steps=STEPS, start=0,
                        pipeline=False)
        first = results[0].loss
        for label, want in refs[name]:
            rel = abs(first - want) / abs(want)
            print(f"PRETRAINED rank={rank} {name}: first loss {first:.7f}, {label} {want:.7f}, rel {rel:.1e}",
                  flush=True)
            assert rel <= LOSS_RTOL, f"{name}: first-step loss {first} != {label} {want}"
        reads = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, (reads, (groups.index("tp"), groups.index("ep"))))
        if rank == 0:
            check_expert_reads(plan.spec, [e[0] for e in everyone], [e[1] for e in everyone])
        policy = ckpt.CheckpointPolicy.from_spec(plan.spec.training.checkpoint, job.path)
        ckpt.save(engine, policy, STEPS, job_dir=job.path)
        ids = torch.randint(0, plan.model.vocab, (1, SEQ_LEN), generator=torch.Generator().manual_seed(9))
        logits = parallel_logits(engine, groups, ids, 1)
        dist.barrier()
        if rank == 0:
            out = Path(tmp) / f"{name}-hf"
            done = export_checkpoint(job_dir, out)
            assert done.step == STEPS
            with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
                keys = set(fh.keys())
            if _kind(plan) in PROJECTIONS:  # experts one tensor each on disk, not the model's stacks
                block = "block_sparse_moe" if plan.model.arch == "mixtral" else "mlp"
                assert f"model.layers.1.{block}.experts.3.{PROJECTIONS[_kind(plan)][1]}.weight" in keys
                assert not [k for k in keys if k.endswith(("gate_up_proj", "down_proj"))], sorted(keys)[:8]
            with safe_open(str(Path(plan.spec.model.pretrained) / "model.safetensors"), framework="pt") as fh:
                assert keys == set(fh.keys()), name  # what save_pretrained wrote, key for key
            model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
            with torch.no_grad():
                want_logits = model(input_ids=ids).logits
            report(f"export {name}", want_logits, logits, LOGITS_RTOL)
        dist.barrier()
        del engine
    print(f"PRETRAINED-MOE rank={rank}: {len(jobs)} jobs in {time.perf_counter() - began:.1f} s", flush=True)
