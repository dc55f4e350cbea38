"""Train with the HF Transformers Trainer under DeepSpeed, every setting taken from a dsforge job file.

    torchrun --nproc_per_node 2 examples/trainers/hf/train_hf.py examples/trainers/hf/job.yaml
    torchrun --nproc_per_node 2 examples/trainers/hf/train_hf.py examples/trainers/hf/job_tp.yaml \
        --save out/hf

The job file gives the DeepSpeed config, batch split, precision, clipping and schedule
(`training_arguments`) and the model (`prepare_model(job)`: this rank's model built from the job's model
section, from `model.pretrained` when it names one; `prepare_model(job, model)` with `--from-pretrained DIR`:
your own HF model, split by the job's plan); job_tp.yaml runs it at tp=2 with sequence parallelism and
ZeRO-1. The plugin owns the process group and the clean exit (no dsforge teardown call here);
`DsforgeCallback` stops the run before the first step when the script disagrees with the job (try
`--batch-size 4`), and prints predicted vs measured memory at the end. The Trainer's own
`trainer.save_model(DIR)` writes a plain HF directory (gathered from the slices at tp > 1) that
`from_pretrained` loads.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from transformers import AutoModelForCausalLM, Trainer

from dsforge.plugins.hf import DsforgeCallback, prepare_model, training_arguments
from dsforge.plugins.job import PluginError, load_job


class RandomTokens(torch.utils.data.Dataset):
    """Fixed pseudo-random token sequences (next-token targets are the inputs; HF shifts them)."""

    def __init__(self, count: int, seq_len: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (count, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("job", help="the dsforge job file")
    p.add_argument("--output-dir", default="hf-output")
    p.add_argument("--batch-size", type=int, help="override per_device_train_batch_size (shows the check)")
    p.add_argument("--summary", help="write the losses and the memory report here (JSON, rank 0)")
    p.add_argument("--from-pretrained", help="start from this HF model directory (prepare_model(job, model))")
    p.add_argument("--save", help="after training, write the model here as a plain HF directory")
    p.add_argument("--save-steps", type=int, help="the Trainer's own checkpoint every N steps")
    p.add_argument("--resume", help="resume from this Trainer checkpoint (resume_from_checkpoint)")
    a = p.parse_args()
    try:
        job = load_job(a.job)
        extra: dict = {"per_device_train_batch_size": a.batch_size} if a.batch_size else {}
        extra.update({"save_strategy": "steps", "save_steps": a.save_steps} if a.save_steps else
                     {"save_strategy": "no"})
        # TrainingArguments first: with ZeRO-3 it must exist before the model is built (HfDeepSpeedConfig).
        args = training_arguments(job, a.output_dir, report_to=[], logging_steps=1, **extra)
        spec = job.plan.spec
        if a.from_pretrained:  # your own HF model, rewritten by the job's plan (the job's model section)
            model = prepare_model(job, AutoModelForCausalLM.from_pretrained(a.from_pretrained))
        else:
            model = prepare_model(job)
        data = RandomTokens(spec.training.global_batch * spec.training.steps, spec.model.seq_len,
                            spec.model.vocab)
        callback = DsforgeCallback(job)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        trainer.train(resume_from_checkpoint=a.resume)
        if a.save:
            trainer.save_model(a.save)  # every rank calls it; rank 0 writes
    except PluginError as exc:  # a job that cannot drive this run: a message, not a traceback
        print(f"dsforge: {exc}", file=sys.stderr)
        return 2
    if a.summary and trainer.is_world_process_zero():
        rows = [row for row in trainer.state.log_history if "loss" in row]
        with open(a.summary, "w", encoding="utf-8") as fh:
            json.dump({"losses": [r["loss"] for r in rows], "grad_norms": [r.get("grad_norm") for r in rows],
                       "steps": trainer.state.global_step, "memory": callback.report}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
