"""Lightning integration, as far as Lightning runs DeepSpeed without a GPU: the strategy and the Trainer are
built from the plan, the config Lightning formats for deepspeed.initialize is the compiled one, and fit()
stops exactly at Lightning's CUDA-only check (DeepSpeedStrategy.setup_environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
import lightning.pytorch as pl
import torch

from dsforge.commands.compile import compile_file
from dsforge.plugins.job import PlanMismatchError
from dsforge.plugins.lightning import check_trainer, strategy_config, trainer_kwargs
from tests.plugins.conftest import ROOT

EXAMPLE = ROOT / "examples" / "trainers" / "lightning"
JOB = EXAMPLE / "job.yaml"


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).sum()


@pytest.fixture(scope="module")
def compiled_config(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("lightning") / "job-dir"
    assert compile_file(JOB, out).written
    return json.loads((out / "ds_config.json").read_text())


def test_strategy_config_is_compiled_config_less_the_key_lightning_owns(compiled_config: dict) -> None:
    assert strategy_config(JOB) == {k: v for k, v in compiled_config.items() if k != "gradient_accumulation_steps"}


def test_trainer_from_the_plan_formats_the_compiled_config_for_deepspeed(compiled_config: dict) -> None:
    kwargs = trainer_kwargs(JOB)
    assert {k: v for k, v in kwargs.items() if k != "strategy"} == {
        "accelerator": "cpu", "devices": 2, "num_nodes": 1, "precision": "32-true", "accumulate_grad_batches": 2,
        "max_steps": 4}
    trainer = pl.Trainer(**kwargs, logger=False, enable_checkpointing=False)
    assert (trainer.world_size, trainer.accumulate_grad_batches) == (2, 2)
    check_trainer(JOB, trainer)
    # The step fit() cannot reach on a CPU: Lightning formats the config it hands deepspeed.initialize
    # (accumulation from the Trainer, precision sections); it comes out as the compiled ds_config again.
    model = Tiny()
    trainer.strategy.connect(model)
    model.trainer = trainer
    trainer.strategy._format_config()
    assert trainer.strategy.config == compiled_config


def test_a_trainer_that_differs_from_the_plan_is_named(compiled_config: dict) -> None:
    kwargs = {**trainer_kwargs(JOB), "accumulate_grad_batches": 4, "precision": "bf16-mixed", "devices": 1}
    trainer = pl.Trainer(**kwargs, logger=False, enable_checkpointing=False)
    with pytest.raises(PlanMismatchError) as err:
        check_trainer(JOB, trainer)
    text = str(err.value)
    assert "world size: the Lightning Trainer has 1, the job file plans 2" in text
    assert "gradient accumulation steps: the Lightning Trainer has 4, the job file plans 2" in text
    assert "precision: the Lightning Trainer has bf16, the job file plans fp32" in text


@pytest.mark.slow
def test_fit_on_cpu_stops_at_lightnings_cuda_check(tmp_path: Path) -> None:
    """Where the CPU limit lies: the example gets through the plugin, the Trainer and check_trainer on both
    ranks, then fit() calls Lightning's DeepSpeedStrategy.setup_environment, which refuses the CPUAccelerator. If a Lightning release lifts
    that check, this test fails and the limit moves (to setup_distributed's device-index check)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29645",
           str(EXAMPLE / "train_lightning.py"), str(JOB)]
    proc = subprocess.run(cmd, check=False, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert ("dsforge: Lightning cannot run DeepSpeed on this machine: The DeepSpeed strategy is only supported on "
            "CUDA GPUs but `CPUAccelerator` is used.") in proc.stderr, proc.stderr[-3000:]
    assert "exitcode  : 3" in proc.stderr
