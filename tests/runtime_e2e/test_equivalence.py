"""Training through dsforge's runtime equals training the dense model on one process, layout by layout.

Each layout builds its DeepSpeed engine from the compiled ds_config and the rewritten model, trains
4 optimizer steps on the job's synthetic data and compares the global-batch loss of every step with
the single-process reference (harness.py: same seed, same global batches, torch AdamW, fp32). The
shard checks make sure the rewrite really happened on each rank: a layout that silently ran
replicated would also match the reference. A loss mismatch means a wrong shard, a collective whose
backward loses or double-counts a gradient, a reduction over the wrong group (ZeRO over TP ranks,
say) or data that is not the plan's share for this rank.

One process group per world size runs all of its layouts, since starting ranks (importing torch,
transformers and DeepSpeed) dominates the cost on two cores.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.runtime.launcher import run
from tests.runtime_e2e.harness import (
    ADAMW,
    CLIPPED,
    STEPS,
    check_parity,
    expect_shapes,
    job_spec,
    run_parallel,
)

# tiny-gpt2 whole on every rank (HF Conv1D: in x out)
GPT2 = {"c_attn.weight": (64, 192), "wte.weight": (256, 64)}
GPT2_TP2 = {"c_attn.weight": (96, 64), "attn.c_proj.weight": (64, 32), "c_fc.weight": (128, 64),
            "wte.weight": (128, 64)}
LLAMA_TP2 = {"q_proj.weight": (32, 64), "k_proj.weight": (16, 64), "v_proj.weight": (16, 64),
             "o_proj.weight": (64, 32), "gate_proj.weight": (64, 64), "down_proj.weight": (64, 64),
             "embed_tokens.weight": (128, 64), "lm_head.weight": (128, 64), "input_layernorm.weight": (64,)}
LLAMA_TP2_LAYERS = {k: v for k, v in LLAMA_TP2.items() if not k.startswith(("embed", "lm_head"))}
LLAMA_FULL = {"q_proj.weight": (64, 64), "k_proj.weight": (32, 64), "embed_tokens.weight": (256, 64)}


def check_zero(engine: Any, stage: int, dp: int) -> None:
    """ZeRO partitions over the plan's dp ranks: fp32 master partitions (1, 2) or parameter partitions (3)."""
    params = [p for p in engine.module.parameters()]
    if stage == 3:
        split = [p for p in params if p.ds_numel > 640]  # stage3_param_persistence_threshold = 10 x hidden
        assert split, "ZeRO-3 partitioned no parameter"
        for p in split:
            assert p.ds_tensor.numel() == math.ceil(p.ds_numel / dp), (p.ds_shape, p.ds_tensor.numel())
        return
    total = sum(p.numel() for p in params)
    mine = sum(t.numel() for t in engine.optimizer.single_partition_of_fp32_groups)
    assert total / dp <= mine <= total / dp + 2 * dp * 64, (f"fp32 partition {mine} of "
                                                            f"{total} params over dp={dp}")


def check_sequence_parallel(engine: Any) -> None:
    """Norm weights are tagged sequence-parallel (their gradients are summed over the TP group)."""
    tagged = [n for n, p in engine.module.named_parameters() if getattr(p, "sequence_parallel", False)]
    assert any(n.endswith("input_layernorm.weight") for n in tagged), tagged


def check_context_parallel(engine: Any, groups: Any, spec: Any) -> None:
    """Attention runs through dsforge's CP hook, and this rank's micro-batches hold half of each sequence."""
    from dsforge.compiler.plan.plan import build_plan
    from dsforge.runtime.data import batches_for
    from dsforge.runtime.hf_attention import NAME

    assert engine.module.model.config._attn_implementation == NAME
    batch = batches_for(build_plan(spec), groups).get(0, 0)
    assert batch.ids.shape[1] == spec.model.seq_len // 2 == batch.positions.shape[1]


def check_experts(engine: Any, groups: Any) -> None:
    """Each rank holds 2 of the 4 experts of every MoE layer, the ones its ep index owns."""
    from dsforge.runtime.moe import ExpertParallelMoE

    layers = [m for m in engine.module.modules() if isinstance(m, ExpertParallelMoE)]
    assert len(layers) == 2, f"{len(layers)} expert-parallel layers, the tiny Mixtral has 2"
    for layer in layers:
        assert len(layer.local_experts) == 2 and layer.first_expert == 2 * groups.index("ep")
        assert tuple(layer.local_experts[0].gate_up.weight.shape) == (256, 64)


def check_pipeline(engine: Any, groups: Any) -> None:
    """This rank holds only its stage: 2 of the 4 decoder layers, the embedding on the first stage, the head
    on the last."""
    names = [n for n, _ in engine.module.named_parameters()]
    layers = {n.split(".")[0] for n in names if ".layer.self_attn." in n}
    assert len(layers) == 2, f"stage {groups.index('pp')} holds decoder layers {sorted(layers)}"
    first, last = groups.index("pp") == 0, groups.index("pp") == groups.size("pp") - 1
    assert any("embed" in n for n in names) == first and any("head" in n for n in names) == last, names


def check_gpipe(engine: Any) -> None:
    """The engine ran dsforge's GPipe schedule: every micro-batch's activations in a buffer of its own
    (DeepSpeed's 1F1B would have reserved min(stages - stage, m) = 2 of them)."""
    from dsforge.runtime.gpipe import GPipeSchedule

    assert isinstance(engine._train_schedule(), GPipeSchedule)
    assert engine.num_pipe_buffers == engine.micro_batches == 4, (engine.num_pipe_buffers,
                                                                  engine.micro_batches)


def check_recompute(engine: Any, groups: Any, spec: Any) -> None:
    """Every decoder layer is checkpointed (pp = 1: through HF's hook, its input split over TP under
    partition_activations unless SP already split it; pp > 1: the pipeline checkpoints decoder stages
    only)."""
    from dsforge.runtime.recompute import checkpoint, decoder_layers

    if groups.size("pp") > 1:
        assert engine.module.activation_checkpoint_interval == 1
        assert engine.module.checkpointable_layers == ["DecoderStage"]
        return
    layers = decoder_layers(engine.module)
    assert len(layers) == spec.model.layers and all(layer.gradient_checkpointing for layer in layers), layers
    func = layers[0]._gradient_checkpointing_func
    split = groups.size("tp") > 1 and not spec.parallel.sequence_parallel  # SP inputs are already this rank's
    assert func.func is checkpoint and (func.keywords["group"] is not None) == split


def _check(name: str, engine: Any, groups: Any, spec: Any, check: str) -> None:
    """Dispatch the shard checks of one layout (``kind[:arg]``, several joined by ``+``)."""
    for part in check.split("+"):
        kind, _, arg = part.partition(":")
        if kind == "zero":
            check_zero(engine, int(arg), groups.size("dp"))
        elif kind == "gpt2":
            expect_shapes(name, engine.module, GPT2 if groups.size("tp") == 1 else GPT2_TP2)
        elif kind == "llama":
            tp2 = LLAMA_TP2 if groups.size("pp") == 1 else LLAMA_TP2_LAYERS  # stages hold their own layers
            expect_shapes(name, engine.module, tp2 if groups.size("tp") == 2 else LLAMA_FULL)
        elif kind == "sp":
            check_sequence_parallel(engine)
        elif kind == "cp":
            check_context_parallel(engine, groups, spec)
        elif kind == "ep":
            check_experts(engine, groups)
        elif kind == "pp":
            check_pipeline(engine, groups)
        elif kind == "gpipe":
            check_gpipe(engine)
        elif kind == "recompute":
            check_recompute(engine, groups, spec)


def hand_written_loop(spec: Any) -> tuple[Any, Any, list[float], list[float]]:
    """The user's own loop around ``dsforge.initialize``: dense HF model in, DeepSpeed engine out, HF
    logits."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import dsforge
    from dsforge.runtime.data import Batches, Sharding, SyntheticTokens
    from dsforge.runtime.models import build_model

    t, m = spec.training, spec.model
    engine = dsforge.initialize(build_model(m, "cpu", 2, seed=t.seed), spec)
    g = engine.dsforge_groups
    data = Batches(SyntheticTokens(m.vocab, m.seq_len, t.seed), t.global_batch, t.micro_batch,
                   Sharding(g.size("dp"), g.index("dp")))
    losses, norms = [], []
    for step in range(STEPS):
        total = torch.zeros(())
        for mb in data.step(step):
            logits = engine(input_ids=mb.ids).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb.targets.reshape(-1))
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total, group=g.dp)
        losses.append(float(total) / (g.size("dp") * data.grad_accum))
        norms.append(float(engine.get_global_grad_norm()))
    return engine, g, losses, norms


def resumed_run(spec: Any, directory: str) -> tuple[Any, Any, list[float], list[float]]:
    """Two steps, a checkpoint, a fresh engine resumed from it (`resume: auto`), two more steps."""
    from dsforge.runtime import checkpoint as ckpt

    policy = ckpt.CheckpointPolicy(Path(directory), every=2, resume=True)
    engine, _, first, norms = run_parallel(spec, steps=2)
    ckpt.save(engine, policy, 2)
    del engine
    engine, groups, rest, more = run_parallel(spec, steps=STEPS, resume=policy)
    return engine, groups, first + rest, norms + more


def _layouts(rank: int, world: int, cases: list[tuple[str, Any, str]]) -> None:
    torch.use_deterministic_algorithms(True)
    for name, spec, check in cases:
        if check.startswith("resume:"):
            engine, groups, losses, norms = resumed_run(spec, check.partition(":")[2])
        else:
            engine, groups, losses, norms = (hand_written_loop if name.startswith("api") else run_parallel)(
                spec
            )
        check_parity(name, spec, losses, norms)
        _check(name, engine, groups, spec, check)
        del engine


@pytest.mark.slow
def test_two_rank_layouts_match_one_process(tmp_path: Path) -> None:
    def spec(name: str, preset: str, parallel: dict[str, Any], **train: Any) -> Any:
        return job_spec(tmp_path, name, preset, parallel, 2, **train)

    cases = [(f"dp2-zero{z}", spec(f"dp2z{z}", "tiny-gpt2", {"zero": z}),
              f"gpt2+zero:{z}") for z in (1, 2, 3)]
    cases += [
        ("dp2-zero1-adamw", spec("dp2adam", "tiny-gpt2", {"zero": 1}, **ADAMW), "gpt2+zero:1"),
        ("tp2-zero0-clipped", spec("tp2", "tiny-llama", {"tp": 2}, **CLIPPED), "llama"),
        ("tp2-sp", spec("tp2sp", "tiny-llama", {"tp": 2, "zero": 1, "sequence_parallel": True}), "llama+sp"),
        ("pp2", spec("pp2", "tiny-llama", {"pp": 2, "zero": 1}), "pp"),
        # GPipe: all 4 forwards, then all 4 backwards; the same losses and gradient norms as 1F1B's
        ("pp2-gpipe", spec("pp2gpipe", "tiny-llama", {"pp": 2, "zero": 1, "pipeline": {"schedule": "gpipe"}}),
         "pp+gpipe"),
        ("cp2-ring", spec("cpring", "tiny-llama", {"cp": 2, "zero": 1, "context_parallel": {"kind": "ring"}}),
         "llama+cp"),
        ("cp2-ulysses",
         spec("cpuly", "tiny-llama", {"cp": 2, "zero": 1, "context_parallel": {"kind": "ulysses"}}),
         "llama+cp"),
        ("ep2", spec("ep2", "tiny-mixtral", {"ep": 2, "zero": 1}), "ep"),
        # recompute: full (each decoder layer run again in backward) changes no loss and no gradient norm
        ("tp2-recompute-full", spec("tp2full", "tiny-llama", {"tp": 2}, recompute="full", **CLIPPED),
         "llama+recompute"),
        ("pp2-recompute-full", spec("pp2full", "tiny-llama", {"pp": 2, "zero": 1}, recompute="full"),
         "pp+recompute"),
        ("cp2-ring-recompute-full", spec("cpfull", "tiny-llama", {"cp": 2, "zero": 1}, recompute="full"),
         "llama+cp+recompute"),
        ("tp2-sp-recompute-full",
         spec("tp2spfull", "tiny-llama", {"tp": 2, "zero": 1, "sequence_parallel": True},
                                        recompute="full"), "llama+sp+recompute"),
        ("ep2-recompute-full", spec("ep2full", "tiny-mixtral", {"ep": 2, "zero": 1}, recompute="full"),
         "ep+recompute"),
        # Resuming restores weights, ZeRO-partitioned optimizer state (momentum) and the data position.
        ("dp2-zero2-resumed", spec("resume", "tiny-gpt2", {"zero": 2}), f"resume:{tmp_path / 'ckpt'}"),
    ]
    run(_layouts, 2, cases)


@pytest.mark.slow
def test_four_rank_layouts_match_one_process(tmp_path: Path) -> None:
    def spec(name: str, preset: str, parallel: dict[str, Any], **train: Any) -> Any:
        return job_spec(tmp_path, name, preset, parallel, 4, **train)

    cases = [
        ("tp2xdp2", spec("tp2dp2", "tiny-gpt2", {"tp": 2, "zero": 1}), "gpt2+zero:1"),
        ("tp2xpp2", spec("tp2pp2", "tiny-llama", {"tp": 2, "pp": 2, "zero": 1}), "llama+pp"),
        ("tp2xpp2-adamw", spec("tp2pp2adam", "tiny-llama", {"tp": 2, "pp": 2, "zero": 1}, **ADAMW),
         "llama+pp"),
        ("api-tp2xdp2-zero2", spec("api", "tiny-gpt2", {"tp": 2, "zero": 2}), "gpt2+zero:2"),
    ]
    run(_layouts, 4, cases)
