"""`dsforge export` and resuming under another layout, on the same trained checkpoints.

Export: one 2-rank world trains each compiled job 4 steps (tp2 Llama, pp2 GPT-2 with the tied head
on both stages, ZeRO-3 dp2 Llama, ep2 Mixtral; a 4-rank world tp2 x pp2 Llama), saves the checkpoint
through dsforge's commit, computes the trained parallel model's logits on a fixed batch, and rank 0
exports the checkpoint and compares ``AutoModelForCausalLM.from_pretrained(export)``'s logits with
them (fp32, 1e-5 of their scale); under tp x pp the logits come from the pipeline's eval_batch.

Resume (issue 12 item 4): those checkpoints then resume under other layouts for 4 more steps, read
through their layout-free state (dsforge.runtime.train_state): the tp2 x pp2 ZeRO-1 one under
tp1 x dp2 with ZeRO-1 and with ZeRO-3 (a third, 2-rank world; there also the ep2 dp2 Mixtral under ep1
dp2 and an ep1 dp2 one, trained in the first world, under ep2 dp2), and in the 4-rank world, after its
own training, a dp2 ZeRO-1 AdamW run (trained in the first world) and the ZeRO-3 dp2 one under
tp2 x pp2. Every step's loss, before and after the change, must equal the uninterrupted
single-process run's (harness.reference_run, 8 steps) to the e2e tolerance: a lost momentum, Adam's
step count restarted (its bias correction), a slice put in another rank's place or a learning rate
read back wrong would not. Three launches in all (the export alone needs two).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner

from tests.runtime.launcher import report, run
from tests.runtime_e2e.harness import ADAMW, RTOL, SGD_DEEPSPEED, compare, reference_run, training

LOGITS_RTOL = 1e-5
TP2_PP2 = {"llama-tp2xpp2": ("tiny-llama", {"tp": 2, "pp": 2, "zero": 1})}
LAYOUTS = {"llama-tp2": ("tiny-llama", {"tp": 2, "zero": 1}), "gpt2-pp2": ("tiny-gpt2", {"pp": 2, "zero": 1}),
           "llama-zero3-dp2": ("tiny-llama", {"zero": 3}),
           "mixtral-ep2": ("tiny-mixtral", {"ep": 2, "zero": 1})}


#: A 2-rank job the first world only trains: the checkpoint the 4-rank world resumes under tp2 x pp2 with
#: Adam.
ADAM_SOURCE = {"llama-dp2-adamw": ("tiny-llama", {"zero": 1})}
#: Trained only, too: the ep1 dp2 Mixtral checkpoint the third world resumes under ep2 (and mixtral-ep2's
#: under ep1).
MOE_SOURCE = {"mixtral-dp2": ("tiny-mixtral", {"zero": 1})}
#: The third world's resumed jobs: name -> (preset, layout, the job whose step-4 checkpoint it resumes).
INTO_TWO = {"tp2xpp2-as-dp2": ("tiny-llama", {"zero": 1}, "llama-tp2xpp2"),
            "tp2xpp2-as-zero3-dp2": ("tiny-llama", {"zero": 3}, "llama-tp2xpp2"),
            "ep2-as-ep1-dp2": ("tiny-mixtral", {"zero": 1}, "mixtral-ep2"),
            "ep1-as-ep2-dp2": ("tiny-mixtral", {"ep": 2, "zero": 1}, "mixtral-dp2")}


def compile_job(tmp: Path, name: str, preset: str, parallel: dict[str, Any], ranks: int = 2,
                train: dict[str, Any] | None = None, steps: int = 4, resume_from: Path | None = None) -> Path:
    """Compile a test job; ``resume_from``: a job directory whose checkpoints this one resumes (and never
    writes)."""
    from dsforge.cli import cli

    checkpoint: dict[str, Any] = {"every": 4}
    if resume_from is not None:
        checkpoint = {"dir": str(resume_from / "checkpoints"), "every": 0}
    doc: dict[str, Any] = {"version": 1, "name": name, "model": {"preset": preset},
                           "hardware": {"preset": "cpu-local", "gpus_per_node": ranks},
                           "parallel": {"dp": "auto", **parallel},
                           "training": {**training(steps=steps, **(train or {})), "checkpoint": checkpoint}}
    if doc["training"]["optimizer"]["name"] == "sgd":
        doc["deepspeed"] = SGD_DEEPSPEED
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    out = tmp / name
    result = CliRunner().invoke(cli, ["compile", str(path), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def parallel_logits(engine: Any, groups: Any, ids: torch.Tensor, pp: int) -> torch.Tensor | None:
    """The trained parallel model's full-vocabulary logits on ``ids`` (None on ranks that do not hold
    them)."""
    import torch.distributed as dist

    if pp > 1:
        targets = torch.zeros_like(ids)
        _, logits = engine.eval_batch(iter([(ids, targets)]), return_logits=True, num_micro_batches=1)
        return logits if groups.index("pp") == pp - 1 else None
    with torch.no_grad():
        logits = engine.module.model(input_ids=ids).logits
    if groups.size("tp") > 1:
        parts = [torch.empty_like(logits) for _ in range(groups.size("tp"))]
        dist.all_gather(parts, logits.contiguous(), group=groups.tp)
        logits = torch.cat(parts, dim=-1)
    return logits


def _losses(tmp: str, name: str, rank: int, results: list[Any]) -> None:
    """Rank 0 leaves a job's losses for the test process, which compares them with the reference."""
    if rank == 0:
        (Path(tmp) / f"{name}.losses.json").write_text(json.dumps([r.loss for r in results]),
                                                       encoding="utf-8")


def _world(rank: int, world: int, jobs: dict[str, str], tmp: str, train_only: tuple[str, ...] = (),
           resumed: dict[str, str] | None = None) -> None:
    """Train, save and export each of ``jobs`` (only train and save those in ``train_only``), then
    ``resumed``."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from dsforge.runtime import checkpoint as ckpt
    from dsforge.runtime.data import batches_for
    from dsforge.runtime.engine import build_engine
    from dsforge.runtime.export import export_checkpoint
    from dsforge.runtime.groups import create_groups
    from dsforge.runtime.main import JobDir
    from dsforge.runtime.train_loop import train

    for name, job_dir in jobs.items():
        job = JobDir.load(job_dir)
        plan = job.plan
        groups = create_groups(plan)
        engine = build_engine(plan, job.ds_config, groups)
        results = train(engine, batches_for(plan, groups, job.path), groups, steps=4, start=0,
                        pipeline=plan.degrees.pp > 1)
        _losses(tmp, name, rank, results)
        policy = ckpt.CheckpointPolicy.from_spec(plan.spec.training.checkpoint, job.path)
        ckpt.save(engine, policy, 4, job_dir=job.path)
        if name in train_only:
            del engine
            continue
        # the training micro-batch shape: the pipeline keeps the stage buffers it sized in training
        ids = torch.randint(0, plan.model.vocab, (1, plan.model.seq_len),
                            generator=torch.Generator().manual_seed(9))
        logits = parallel_logits(engine, groups, ids, plan.degrees.pp)
        holder = torch.tensor([rank if logits is not None else world])
        dist.all_reduce(holder, op=dist.ReduceOp.MIN)
        src = int(holder)
        if logits is None:
            logits = torch.empty(1, plan.model.seq_len, plan.model.vocab)
        # Gathered vocab-parallel logits are a movedim view (layers/mappings.py _all_gather): gloo broadcasts
        # a tensor's storage in memory order and receivers read it as contiguous, which scrambled tp x pp's
        # logits ("1.6x their scale off") while the holders' own copies, and their loss, were right.
        logits = logits.contiguous()
        dist.broadcast(logits, src)
        dist.barrier()
        if rank == 0:
            out = Path(tmp) / f"{name}-hf"
            done = export_checkpoint(job_dir, out)
            assert (
                done.step == 4 and (out / "config.json").is_file() and (out / "model.safetensors").is_file()
            )
            note = json.loads((out / "dsforge-export.json").read_text(encoding="utf-8"))
            assert note["step"] == 4 and note["tensors"] == done.tensors
            model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
            with torch.no_grad():
                want = model(input_ids=ids).logits
            report(f"export {name}", want, logits, LOGITS_RTOL)
        dist.barrier()
        del engine
    _resume_world(rank, world, resumed or {}, tmp)


def _resume_world(rank: int, world: int, jobs: dict[str, str], tmp: str) -> None:
    """Each job resumes the 4-step checkpoint it names (another layout's) and trains steps 5-8."""
    from dsforge.runtime import checkpoint as ckpt
    from dsforge.runtime.data import batches_for
    from dsforge.runtime.engine import build_engine
    from dsforge.runtime.groups import create_groups
    from dsforge.runtime.main import JobDir
    from dsforge.runtime.train_loop import train

    for name, job_dir in jobs.items():
        job = JobDir.load(job_dir)
        plan = job.plan
        groups = create_groups(plan)
        engine = build_engine(plan, job.ds_config, groups)
        policy = ckpt.CheckpointPolicy.from_spec(plan.spec.training.checkpoint, job.path)
        start = ckpt.resume(engine, policy, job.doc, job.ds_config)
        assert start == 4, f"{name}: resumed after step {start}"
        results = train(engine, batches_for(plan, groups, job.path), groups, steps=8, start=start,
                        pipeline=plan.degrees.pp > 1)
        _losses(tmp, name, rank, results)
        del engine


def _logged(tmp: Path, name: str) -> list[float]:
    return [float(x) for x in json.loads((tmp / f"{name}.losses.json").read_text(encoding="utf-8"))]


@pytest.mark.slow
def test_exported_checkpoints_give_the_parallel_logits_and_resume_under_other_layouts(tmp_path: Path) -> None:
    from dsforge.runtime.main import JobDir

    tmp = str(tmp_path)
    two = {name: compile_job(tmp_path, name, preset, par) for name, (preset, par) in LAYOUTS.items()}
    two |= {name: compile_job(tmp_path, name, preset, par, train=ADAMW) for name,
            (preset, par) in ADAM_SOURCE.items()}
    two |= {name: compile_job(tmp_path, name, preset, par) for name, (preset, par) in MOE_SOURCE.items()}
    run(_world, 2, {k: str(v) for k, v in two.items()}, tmp, (*ADAM_SOURCE, *MOE_SOURCE))

    four = {name: compile_job(tmp_path, name, preset, par, 4) for name, (preset, par) in TP2_PP2.items()}
    tp2pp2 = {"tp": 2, "pp": 2, "zero": 1}
    # resumed job -> the job whose checkpoint it resumes
    into_four = {"adamw-dp2-as-tp2xpp2": ("llama-dp2-adamw", ADAMW),
                 "zero3-dp2-as-tp2xpp2": ("llama-zero3-dp2", {})}
    resumed4 = {name: compile_job(tmp_path, name, "tiny-llama", tp2pp2, 4, train, 8, two[source])
                for name, (source, train) in into_four.items()}
    run(_world, 4, {k: str(v) for k, v in four.items()}, tmp, (), {k: str(v) for k, v in resumed4.items()})

    trained = two | four
    resumed2 = {name: compile_job(tmp_path, name, preset, par, 2, None, 8, trained[source])
                for name, (preset, par, source) in INTO_TWO.items()}
    run(_resume_world, 2, {k: str(v) for k, v in resumed2.items()}, tmp)

    adam = reference_run(JobDir.load(resumed4["adamw-dp2-as-tp2xpp2"]).plan.spec, 8)[0]
    sgd = reference_run(JobDir.load(resumed4["zero3-dp2-as-tp2xpp2"]).plan.spec, 8)[0]
    moe = reference_run(JobDir.load(resumed2["ep2-as-ep1-dp2"]).plan.spec, 8)[0]
    pairs = {"adamw-dp2-as-tp2xpp2": "llama-dp2-adamw", "zero3-dp2-as-tp2xpp2": "llama-zero3-dp2"}
    pairs |= {name: source for name, (_, _, source) in INTO_TWO.items()}
    for resumed, source in pairs.items():
        want = adam if "adamw" in source else moe if "mixtral" in source else sgd
        compare(f"{source} then {resumed}", "losses", _logged(tmp_path, source) + _logged(tmp_path, resumed),
                want, RTOL)
    _refusals(tmp_path, four["llama-tp2xpp2"])


def _refusals(tmp: Path, source: Path) -> None:
    """A run that cannot resume the checkpoint says why and how, before its engine is touched (engine
    None)."""
    from dsforge.runtime import checkpoint as ckpt
    from dsforge.runtime.main import JobDir
    from dsforge.runtime.train_state import STATE_DIR

    other_lr = JobDir.load(compile_job(tmp, "lr-changed", "tiny-llama", {"zero": 1}, 2, {"optimizer": {
        "name": "sgd", "lr": 0.1, "weight_decay": 0.01}}, 8, source))
    policy = ckpt.CheckpointPolicy.from_spec(other_lr.plan.spec.training.checkpoint, other_lr.path)
    with pytest.raises(ckpt.CheckpointError, match=r"error\[DSF164\].*training.optimizer.lr 0.5 -> 0.1"):
        ckpt.resume(None, policy, other_lr.doc, other_lr.ds_config)
    old = tmp / "old-dsforge"
    import shutil

    shutil.copytree(source / "checkpoints", old / "checkpoints")
    # as a dsforge without layout-free state saved it
    shutil.rmtree(old / "checkpoints" / "step4" / STATE_DIR)
    from dsforge.runtime.checkpoint_manifest import MANIFEST

    (old / "checkpoints" / "step4" / MANIFEST).unlink()  # nor integrity manifests: its files are not checked
    relaid = JobDir.load(compile_job(tmp, "no-state", "tiny-llama", {"zero": 1}, 2, None, 8, old))
    policy = ckpt.CheckpointPolicy.from_spec(relaid.plan.spec.training.checkpoint, relaid.path)
    with pytest.raises(ckpt.CheckpointError, match=r"DSF641: .* holds no layout-free state"):
        ckpt.resume(None, policy, relaid.doc, relaid.ds_config)


def test_export_refuses_what_it_cannot_export(tmp_path: Path) -> None:
    """No checkpoint yet; an occupied output directory: one sentence each, nothing written."""
    from dsforge.runtime.export import ExportError, export_checkpoint

    job_dir = compile_job(tmp_path, "fresh", "tiny-llama", {"tp": 1})
    with pytest.raises(ExportError, match="no complete checkpoint"):
        export_checkpoint(job_dir, tmp_path / "out")
    with pytest.raises(ExportError, match="does not exist"):
        export_checkpoint(job_dir, tmp_path / "out", step=3)
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    policy_dir = job_dir / "checkpoints" / "step1"
    policy_dir.mkdir(parents=True)
    (job_dir / "checkpoints" / "latest").write_text("step1")
    with pytest.raises(ExportError, match="no dsforge-weights"):
        export_checkpoint(job_dir, tmp_path / "new")
    from dsforge.compiler.emit.writer import TargetError
    from dsforge.runtime.export import write_export

    with pytest.raises(TargetError, match="not empty; give a new directory"):
        write_export(tmp_path / "out", lambda tmp: None)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
