"""A LightningModule trained by a dsforge job file: the documented dsforge lines and nothing else of dsforge.

    torchrun --nproc_per_node 2 examples/trainers/lightning/train_lightning.py
    examples/trainers/lightning/job.yaml [OUT] [--resume CKPT]

`prepare_model(job)` gives this rank's model by the job's plan (the rewrite `dsforge run` applies);
`trainer_kwargs(job)` gives the dsforge strategy (Lightning's DeepSpeedStrategy with dsforge's groups, on GPUs
or CPU processes), devices, nodes, precision, accumulation and steps. The strategy compares the Trainer and
the DataLoader with the plan before the first step, shards the data over the data-parallel ranks, writes a
plain HF directory into each checkpoint (``<ckpt>/hf``) and leaves the process group cleanly at the end.
DeepSpeed builds the optimizer and schedule from the job, so configure_optimizers returns None. With OUT,
Lightning saves a checkpoint there at the end of each epoch (``OUT/epoch=0-step=2.ckpt``, with ``hf/`` inside
for ``from_pretrained``). ``--resume OUT/epoch=0-step=2.ckpt`` resumes from such a checkpoint through
Lightning's own ``fit(ckpt_path=...)``: the uninterrupted run's losses and weights (docs/trainers.md).
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import dsforge.plugins.lightning as dsl


class CausalLM(pl.LightningModule):
    """Wraps an HF causal LM: the loss of next-token prediction on a batch of token ids."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=True)
        if os.environ.get("LOSS_LOG"):  # the test's per-step record
            # one write
            print(f"step {self.global_step} micro {batch_idx} loss {loss.item():.8f}\n", end="", flush=True)
        return loss

    def configure_optimizers(self) -> None:
        return None  # the job's optimizer and scheduler: DeepSpeed builds them, Lightning steps them


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cli.add_argument("job")
    cli.add_argument("out", nargs="?")
    cli.add_argument("--resume", metavar="CKPT", help="a Lightning checkpoint saved at an epoch's end")
    args = cli.parse_args()
    job, out = args.job, args.out
    model = CausalLM(dsl.prepare_model(job))                                   # dsforge line 1
    saves = [ModelCheckpoint(dirpath=out, every_n_epochs=1, save_top_k=-1,
                             save_on_train_epoch_end=True)] if out else []
    # dsforge line 2
    trainer = pl.Trainer(**dsl.trainer_kwargs(job), callbacks=saves, enable_checkpointing=bool(out),
                         logger=False, enable_progress_bar=False)
    tokens = torch.randint(0, model.model.config.vocab_size, (16, 32),
                           generator=torch.Generator().manual_seed(0))
    trainer.fit(model, torch.utils.data.DataLoader(tokens, batch_size=2), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
