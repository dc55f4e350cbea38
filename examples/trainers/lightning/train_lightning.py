"""A Lightning Trainer under DeepSpeed, every setting taken from a dsforge job file.

    torchrun --nproc_per_node 2 examples/trainers/lightning/train_lightning.py examples/trainers/lightning/job.yaml

`trainer_kwargs` gives the DeepSpeedStrategy (the job's compiled ds_config), devices, nodes,
precision, accumulation and steps; `PlanCheck` stops fit() before the first step when the run
differs from the job. DeepSpeed builds the optimizer and schedule from the config, so
configure_optimizers returns None. Lightning's DeepSpeedStrategy needs CUDA: on a CPU-only machine
fit() stops in the strategy's setup_environment, and this script says so (exit 3).
"""

from __future__ import annotations

import argparse
import sys

import lightning.pytorch as pl
import torch

from dsforge.plugins.job import PluginError, load_job
from dsforge.plugins.lightning import PlanCheck, check_trainer, trainer_kwargs
from dsforge.runtime.models import build_model
from dsforge.runtime.teardown import before_init, leave, release_engine


class CausalLM(pl.LightningModule):
    """Wraps an HF causal LM: the loss of next-token prediction on a batch of token ids."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> None:
        return None  # the ds_config's optimizer and scheduler: DeepSpeed builds them, Lightning steps them


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("job", help="the dsforge job file")
    a = p.parse_args()
    before_init()  # before Lightning joins the process group (see dsforge.runtime.teardown)
    try:
        job = load_job(a.job)
        spec = job.plan.spec
        trainer = pl.Trainer(**trainer_kwargs(job), callbacks=[PlanCheck(job)], logger=False,
                             enable_checkpointing=False)
        check_trainer(job, trainer)
        model = CausalLM(build_model(spec.model, device="cpu", seed=spec.training.seed))
        tokens = torch.randint(0, spec.model.vocab, (spec.training.global_batch * spec.training.steps,
                                                     spec.model.seq_len), generator=torch.Generator().manual_seed(0))
        loader = torch.utils.data.DataLoader(tokens, batch_size=job.micro_batch)
    except PluginError as exc:  # a job that cannot drive this run: a message, not a traceback
        print(f"dsforge: {exc}", file=sys.stderr)
        return 2
    try:
        trainer.fit(model, loader)
    except RuntimeError as exc:
        if torch.cuda.is_available() or "only supported on CUDA" not in str(exc):
            raise
        print(f"dsforge: Lightning cannot run DeepSpeed on this machine: {exc}", file=sys.stderr)
        return 3
    # As dsforge's runtime: free the engine ZeRO's hooks keep alive, then leave the process group, so that no
    # communication thread outlives the interpreter.
    release_engine(getattr(trainer.strategy, "deepspeed_engine", None))
    leave(synchronize=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
