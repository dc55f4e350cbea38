"""What a run does beside training at each step: the validation loss (`training.data.valid`) and the monitor's
scalars (`training.monitor`), into train_log.jsonl, the console, DeepSpeed's monitor and the run report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dsforge.runtime.monitor import write_step, write_valid


class StepExtras:
    """The run's validation and monitor hooks (every rank calls them; rank 0 writes)."""

    def __init__(self, job_dir: str | Path, plan: Any, groups: Any, engine: Any) -> None:
        self.job_dir, self.engine = Path(job_dir), engine
        self.validation = None
        if plan.spec.training.data.valid is not None:
            from dsforge.runtime.datasets.validation import Validation

            self.validation = Validation(plan, groups)
        self.rank0 = not dist.is_initialized() or dist.get_rank() == 0

    def on_step(self, step: int) -> None:
        """After optimizer step ``step`` (1-based): the validation loss when it is due."""
        if self.validation is None or not self.validation.due(step):
            return
        value = self.validation.loss(self.engine, step)
        write_valid(self.engine, step, value)
        if self.rank0:
            with open(self.job_dir / "train_log.jsonl", "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"step": step, "valid_loss": value}) + "\n")
            print(f"step {step}: valid loss {value:.4f} ({self.validation.spec.batches} fixed batches)",
                  flush=True)

    def after_step(self, result: Any) -> None:
        """Once step ``result.step``'s loss is known: the monitor's scalars."""
        write_step(self.engine, result.step, result.loss, result.tokens_per_s)

    def report(self) -> None:
        """The validation losses into memory_report.json and a console line (rank 0, after the report)."""
        if self.validation is None or not self.validation.history or not self.rank0:
            return
        path = self.job_dir / "memory_report.json"
        if path.is_file():
            doc = json.loads(path.read_text(encoding="utf-8"))
            doc["valid_losses"] = [{"step": s, "loss": v} for s, v in self.validation.history]
            doc["final_valid_loss"] = self.validation.history[-1][1]
            path.write_text(json.dumps(doc, indent=1), encoding="utf-8")
        step, value = self.validation.history[-1]
        print(f"dsforge: validation loss {value:.4f} after step {step}", flush=True)
