"""An Accelerate training loop under DeepSpeed, every setting taken from a dsforge job file.

    dsforge compile examples/trainers/accelerate/job.yaml -o acc-job
    acc-job/launch.sh examples/trainers/accelerate/train_accelerate.py examples/trainers/accelerate/job.yaml

(`torchrun --nproc_per_node 2 ...train_accelerate.py job.yaml` works as well.) The Accelerator
carries the job's compiled ds_config and is checked against the plan; DeepSpeed builds the
optimizer and the schedule from that config.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dsforge.plugins.accelerate import accelerator, check_dataloader, optimizer_and_scheduler, prepare_model
from dsforge.plugins.job import PluginError, load_job


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("job", help="the dsforge job file")
    p.add_argument("--summary", help="write the losses and the DeepSpeed config in use here (JSON, rank 0)")
    a = p.parse_args()
    try:
        job = load_job(a.job)
        acc = accelerator(job)
        spec = job.plan.spec
        model = prepare_model(job)  # this rank's model by the plan (from model.pretrained when the job names
                                    # one)
        tokens = torch.randint(
            0,
            spec.model.vocab,
            (spec.training.global_batch * spec.training.steps, spec.model.seq_len),
            generator=torch.Generator().manual_seed(0),
        )
        loader = torch.utils.data.DataLoader(tokens, batch_size=job.micro_batch)
        optimizer, scheduler = optimizer_and_scheduler(job, model)
        model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
        check_dataloader(job, loader)
    except PluginError as exc:  # a job that cannot drive this run: a message, not a traceback
        print(f"dsforge: {exc}", file=sys.stderr)
        return 2
    losses = []
    for batch in loader:
        with acc.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            acc.backward(loss)  # DeepSpeed steps the optimizer and the schedule every grad_accum
                                # micro-batches
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    if a.summary and acc.is_main_process:
        with open(a.summary, "w", encoding="utf-8") as fh:
            json.dump({"losses": losses, "optimizer_steps": model.global_steps, "world": acc.num_processes,
                       "ds_config": acc.deepspeed_config}, fh)
    acc.print(f"dsforge: {model.global_steps} optimizer steps, last loss {losses[-1]:.4f}")
    acc.end_training()  # the plugin releases the engine and the groups at exit: no rank aborts there
    return 0


if __name__ == "__main__":
    sys.exit(main())
