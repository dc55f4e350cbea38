"""Real runs on the user's data (2 gloo CPU ranks, DeepSpeed): a tiny pretrained Llama with its own BPE
tokenizer fine-tunes on a JSONL corpus and on an HF datasets directory under tp=2 and dp=2 with the
single-process losses; chat records train with the masked token mean (dp=2, cp=2, pp=2), packed text under
cp=2; one repeated sentence is learned; a run resumed mid-epoch trains on the same next batches; `dsforge run`
writes the validation loss and TensorBoard scalars.

The single-process reference is the HF model from_pretrained trained with torch's SGD on each step's whole
global batch (the samples dsforge.runtime.data assigns to that step), with the batch's positions (reset per
document) and the token mean over the targets that carry loss.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml

from tests.runtime_e2e.harness import SGD_DEEPSPEED, compare, run_parallel, training
from tests.runtime_e2e.text_data import SENTENCES, corpus, pretrained_with_tokenizer, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def text_spec(tmp: Path, name: str, model_dir: Path, parallel: dict[str, Any], data: dict[str, Any],
              **train: Any) -> Any:
    from dsforge.compiler.frontend.parse import load_job

    doc = {"version": 1, "name": name, "model": {"pretrained": str(model_dir), "seq_len": 32},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 2}, "parallel": {"dp": "auto", **parallel},
           "training": {**training(**train), "data": data}, "deepspeed": SGD_DEEPSPEED}
    if train.get("optimizer", {}).get("name", "sgd") != "sgd":
        doc.pop("deepspeed")
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    job, diags = load_job(path)
    assert job is not None, [d.message for d in diags]
    return job.spec


def reference_losses(spec: Any, steps: int) -> list[float]:
    """Global-batch token-mean losses of the from_pretrained model trained on one process."""
    from transformers import AutoModelForCausalLM

    from dsforge.runtime.data import IGNORE_INDEX, Batches, Sharding
    from dsforge.runtime.datasets import source_for

    t, m = spec.training, spec.model
    model = AutoModelForCausalLM.from_pretrained(m.pretrained, dtype=torch.float32,
                                                 attn_implementation="sdpa").train()
    momentum = spec.deepspeed.get("optimizer", {}).get("params", {}).get("momentum", 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=t.optimizer.lr, momentum=momentum,
                          weight_decay=t.optimizer.weight_decay)
    whole = Batches(source_for(t.data, m, t.seed), t.global_batch, t.global_batch, Sharding(1, 0))
    losses = []
    for step in range(steps):
        mb = whole.get(step, 0)
        logits = model(input_ids=mb.ids, position_ids=mb.positions, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), mb.targets.reshape(-1),
                               ignore_index=IGNORE_INDEX)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def reference_valid_loss(spec: Any, steps: int) -> float:
    """The validation loss one process computes after ``steps`` steps: the mean of the fixed batches' token
    means."""
    from transformers import AutoModelForCausalLM

    from dsforge.runtime.data import IGNORE_INDEX, Batches, Sharding
    from dsforge.runtime.datasets import source_for

    t, m = spec.training, spec.model
    model = AutoModelForCausalLM.from_pretrained(m.pretrained, dtype=torch.float32,
                                                 attn_implementation="sdpa").train()
    momentum = spec.deepspeed.get("optimizer", {}).get("params", {}).get("momentum", 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=t.optimizer.lr, momentum=momentum,
                          weight_decay=t.optimizer.weight_decay)
    train = Batches(source_for(t.data, m, t.seed), t.global_batch, t.global_batch, Sharding(1, 0))
    valid = Batches(source_for(t.data, m, t.seed, valid=True), t.global_batch, t.global_batch, Sharding(1, 0))

    def loss_of(mb: Any) -> torch.Tensor:
        logits = model(input_ids=mb.ids, position_ids=mb.positions, use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), mb.targets.reshape(-1),
                               ignore_index=IGNORE_INDEX)

    for step in range(steps):
        loss_of(train.get(step, 0)).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        values = [float(loss_of(valid.get(b, 0))) for b in range(t.data.valid.batches)]
    return sum(values) / len(values)


def _world(rank: int, world: int, tmp: str, model_dir: str, corpora: dict[str, str]) -> None:
    from dsforge.runtime import checkpoint as ckpt

    jobs, model = Path(tmp) / f"jobs{rank}", Path(model_dir)
    jobs.mkdir(exist_ok=True)
    # tp=2 and dp=2 on a JSONL corpus and on an HF datasets directory: the single-process losses.
    for kind, path in corpora.items():
        if kind == "chat":
            continue
        for layout, par in {"tp2": {"tp": 2}, "dp2": {}}.items():
            name = f"{kind}-{layout}"
            spec = text_spec(jobs, name, model, par, {"kind": "text", "path": path})
            engine, _, losses, _ = run_parallel(spec, steps=3)
            compare(name, "losses", losses, reference_losses(spec, 3))
            del engine
    # Chat records, one conversation per sequence, dp=2: the masked token mean of one process.
    spec = text_spec(jobs, "chat-dp2", model, {}, {"kind": "text", "path": corpora["chat"], "format": "chat",
                                                   "packing": False})
    engine, _, losses, _ = run_parallel(spec, steps=3)
    compare("chat-dp2", "losses", losses, reference_losses(spec, 3))
    del engine
    # Masked chat targets through the pipeline engine (pp=2): the global token mean too.
    spec = text_spec(jobs, "chat-pp2", model, {"pp": 2},
                     {"kind": "text", "path": corpora["chat"], "format": "chat",
                                                         "packing": False})
    engine, _, losses, _ = run_parallel(spec, steps=3)
    compare("chat-pp2", "losses", losses, reference_losses(spec, 3))
    del engine
    # Context parallelism (ring): attention across documents (packing: concat), and masked chat targets.
    for name, data in {"concat-cp2": {"kind": "text", "path": corpora["jsonl"], "packing": "concat"},
                       "chat-cp2": {"kind": "text", "path": corpora["chat"], "format": "chat",
                                    "packing": False}}.items():
        spec = text_spec(jobs, name, model, {"cp": 2}, data)
        engine, _, losses, _ = run_parallel(spec, steps=3)
        compare(name, "losses", losses, reference_losses(spec, 3))
        del engine
    # The validation loss of a plain engine (dp=2) and of a pipeline engine (pp=2): one process's after 2
    # steps.
    from dsforge.compiler.plan.plan import build_plan
    from dsforge.runtime.datasets.validation import Validation

    for name, par in {"valid-dp2": {}, "valid-pp2": {"pp": 2}}.items():
        spec = text_spec(jobs, name, model, par,
                         {"kind": "text", "path": corpora["jsonl"], "packing": "concat",
                                                  "valid": {"fraction": 0.25, "every": 1,
                                                            "batches": 2}}, steps=2)
        engine, groups, losses, _ = run_parallel(spec, steps=2)
        compare(name, "losses", losses, reference_losses(spec, 2))
        got = Validation(build_plan(spec), groups).loss(engine, 2)
        compare(name, "validation loss", [got], [reference_valid_loss(spec, 2)])
        del engine
    # Resumed mid-epoch (step 2 of a 4-step epoch and more): the same next batches, so the same losses.
    spec = text_spec(jobs, "resume", model, {}, {"kind": "text", "path": corpora["jsonl"]}, steps=4)
    engine, _, straight, _ = run_parallel(spec, steps=4)
    del engine
    policy = ckpt.CheckpointPolicy(Path(tmp) / "resume-ckpt", every=2, resume=True)
    engine, _, first, _ = run_parallel(spec, steps=2)
    ckpt.save(engine, policy, 2)
    del engine
    engine, _, rest, _ = run_parallel(spec, steps=4, resume=policy)
    compare("resume", "losses", first + rest, straight, rtol=1e-6)
    del engine
    # One repeated sentence is learned: the loss falls far below its first value.
    spec = text_spec(jobs, "repeated", model, {"tp": 2}, {"kind": "text", "path": corpora["repeated"]},
                     steps=25, optimizer={"name": "adamw", "lr": 1e-2}, grad_clip=1.0)
    engine, _, losses, _ = run_parallel(spec, steps=25)
    print(f"REPEATED rank={rank}: loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    assert losses[-1] < 0.1 * losses[0], f"the repeated sentence was not learned: {losses}"
    del engine


@pytest.mark.slow
def test_finetune_on_user_data_matches_one_process(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from tests.runtime.launcher import run

    model = pretrained_with_tokenizer(tmp_path)
    records = corpus(40)
    corpora = {"jsonl": str(write_jsonl(tmp_path / "data" / "train.jsonl", records)),
               "hf": str(tmp_path / "hf")}
    datasets.Dataset.from_list(records).save_to_disk(corpora["hf"])
    chats = [{"messages": [{"role": "user", "content": SENTENCES[i % 8]},
                           {"role": "assistant", "content": SENTENCES[(i + 1) % 8]}]} for i in range(16)]
    corpora["chat"] = str(write_jsonl(tmp_path / "chat" / "chat.jsonl", chats))
    corpora["repeated"] = str(write_jsonl(tmp_path / "rep" / "rep.jsonl", [{"text": SENTENCES[0]}] * 64))
    run(_world, 2, str(tmp_path), str(model), corpora)


@pytest.mark.slow
def test_dsforge_run_writes_validation_loss_and_tensorboard_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pretrained_with_tokenizer(tmp_path)  # tmp_path/model: the job's model.pretrained
    write_jsonl(tmp_path / "data" / "train.jsonl", corpus(40))
    write_jsonl(tmp_path / "data" / "valid.jsonl", corpus(12)[::-1])
    job = {"version": 1, "name": "finetune", "model": {"pretrained": "model", "seq_len": 32},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 2}, "parallel": {"tp": 2},
           "training": {"global_batch": 4, "micro_batch": 1, "precision": "fp32", "steps": 6,
                        "optimizer": {"name": "adamw", "lr": 3.0e-3},
                        "data": {"kind": "text", "path": "data/train.jsonl",
                                 "valid": {"path": "data/valid.jsonl", "every": 2, "batches": 2}},
                        "monitor": {"tensorboard": True}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job), encoding="utf-8")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "dsforge", "run", "job.yaml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "finetune"
    lines = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    valid = [(line["step"], line["valid_loss"]) for line in lines if "valid_loss" in line]
    assert [s for s, _ in valid] == [2, 4, 6] and all(math.isfinite(v) for _, v in valid)
    assert "step 4: valid loss" in proc.stdout
    report = json.loads((run_dir / "memory_report.json").read_text())
    assert report["final_valid_loss"] == valid[-1][1]
    events = list((run_dir / "monitor" / "finetune").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"Train/loss", "Train/lr", "Train/tokens_per_s", "Valid/loss"} <= tags
    assert [e.step for e in acc.Scalars("Valid/loss")] == [2, 4, 6]
    train = {e.step: e.value for e in acc.Scalars("Train/loss")}
    logged = {line["step"]: line["loss"] for line in lines if "loss" in line}
    assert train.keys() == logged.keys() and all(
        abs(train[s] - logged[s]) < 1e-5 * abs(logged[s]) for s in train
    )
