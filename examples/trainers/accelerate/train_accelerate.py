"""An Accelerate training loop under DeepSpeed, every setting taken from a dsforge job file.

    dsforge compile examples/trainers/accelerate/job.yaml -o acc-job
    acc-job/launch.sh examples/trainers/accelerate/train_accelerate.py examples/trainers/accelerate/job.yaml
    dsforge compile examples/trainers/accelerate/job_tp.yaml -o acc-tp
    acc-tp/launch.sh examples/trainers/accelerate/train_accelerate.py \
        examples/trainers/accelerate/job_tp.yaml --save out/acc-tp

(`torchrun --nproc_per_node 2 ...train_accelerate.py job.yaml` works as well.) The Accelerator
carries the job's compiled ds_config and is checked against the plan; DeepSpeed builds the
optimizer and the schedule from that config. `prepare_model(job)` gives this rank its model by the plan
(`prepare_model(job, model)` with `--from-pretrained DIR`: your own HF model, split by the plan); job_tp.yaml
runs it at tp=2 with sequence parallelism and ZeRO-1 (the loader passed to `acc.prepare` is sharded over the
dp ranks). accelerate's own save of a transformers model, `unwrap_model(model).save_pretrained(DIR,
state_dict=acc.get_state_dict(model))`, writes a plain HF directory (gathered from the slices at tp > 1) that
`from_pretrained` loads. `--save-state DIR` and `--resume DIR` are accelerate's own `save_state` and
`load_state` (then `skip_first_batches` for the micro-batches already trained on).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from transformers import AutoModelForCausalLM

from dsforge.plugins.accelerate import (
    accelerator,
    check_dataloader,
    check_model,
    optimizer_and_scheduler,
    prepare_model,
)
from dsforge.plugins.job import PluginError, load_job


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("job", help="the dsforge job file")
    p.add_argument("--summary", help="write the losses and the DeepSpeed config in use here (JSON, rank 0)")
    p.add_argument("--from-pretrained", help="start from this HF model directory (prepare_model(job, model))")
    p.add_argument("--save", help="after training, write the model here as a plain HF directory")
    p.add_argument("--save-state", help="write the whole training state here (accelerator.save_state)")
    p.add_argument("--save-state-steps", type=int, default=2, help="... after this many optimizer steps")
    p.add_argument("--resume", help="continue from a state --save-state wrote (accelerator.load_state)")
    a = p.parse_args()
    try:
        job = load_job(a.job)
        acc = accelerator(job)
        spec = job.plan.spec
        if a.from_pretrained:  # your own HF model, rewritten by the job's plan (the job's model section)
            model = prepare_model(job, AutoModelForCausalLM.from_pretrained(a.from_pretrained))
        else:  # this rank's model by the plan (from model.pretrained when the job names one)
            model = prepare_model(job)
        tokens = torch.randint(
            0,
            spec.model.vocab,
            (spec.training.global_batch * spec.training.steps, spec.model.seq_len),
            generator=torch.Generator().manual_seed(0),
        )
        loader = torch.utils.data.DataLoader(tokens, batch_size=job.micro_batch)
        optimizer, scheduler = optimizer_and_scheduler(job, model)
        model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
        check_model(job, model)
        check_dataloader(job, loader)  # batch size, and at tp > 1 this rank's dp shard
        batches = loader
        if a.resume:  # engine, optimizer, schedule and RNG states; then the micro-batches not yet trained on
            acc.load_state(a.resume)
            batches = acc.skip_first_batches(loader, model.global_steps * job.grad_accum)
    except PluginError as exc:  # a job that cannot drive this run: a message, not a traceback
        print(f"dsforge: {exc}", file=sys.stderr)
        return 2
    losses, step_losses, grad_norms, pending = [], [], [], []
    for batch in batches:
        with acc.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            acc.backward(loss)  # DeepSpeed steps the optimizer and the schedule every grad_accum
                                # micro-batches
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
        pending.append(losses[-1])
        if acc.sync_gradients:  # an optimizer step ran: its mean loss and DeepSpeed's gradient norm
            step_losses.append(sum(pending) / len(pending))
            grad_norms.append(float(model.get_global_grad_norm()))
            pending = []
            if a.save_state and model.global_steps == a.save_state_steps:
                acc.save_state(a.save_state)  # every rank: DeepSpeed writes its own shards
    if a.save:
        state = acc.get_state_dict(model)  # every rank: gathered from the slices at tp > 1
        acc.unwrap_model(model).save_pretrained(a.save, is_main_process=acc.is_main_process,
                                                save_function=acc.save, state_dict=state)
    if a.summary and acc.is_main_process:
        with open(a.summary, "w", encoding="utf-8") as fh:
            json.dump({"losses": losses, "step_losses": step_losses, "grad_norms": grad_norms,
                       "optimizer_steps": model.global_steps, "world": acc.num_processes,
                       "ds_config": acc.deepspeed_config}, fh)
    acc.print(f"dsforge: {model.global_steps} optimizer steps, last loss {losses[-1]:.4f}")
    acc.end_training()  # the plugin releases the engine and the groups at exit: no rank aborts there
    return 0


if __name__ == "__main__":
    sys.exit(main())
