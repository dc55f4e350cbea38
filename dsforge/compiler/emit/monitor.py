"""DeepSpeed's `monitor` sections (tensorboard, csv_monitor, wandb) from `training.monitor`.

DeepSpeed's MonitorMaster opens the writers on rank 0 at deepspeed.initialize; dsforge's training loop
writes the global-batch loss, learning rate, throughput and validation loss through them
(dsforge.runtime.monitor), beside DeepSpeed's own per-rank `Train/Samples/*` events. A relative `dir`
is inside the job directory (the runtime makes it absolute there).
"""

from __future__ import annotations

from typing import Any

from dsforge.compiler.spec.schema import JobSpec


def monitor_sections(spec: JobSpec) -> dict[str, Any]:
    """The ds_config sections of the job's enabled monitors (none when all are off)."""
    m = spec.training.monitor
    out: dict[str, Any] = {}
    if m.tensorboard:
        out["tensorboard"] = {"enabled": True, "output_path": m.dir, "job_name": spec.name}
    if m.csv:
        out["csv_monitor"] = {"enabled": True, "output_path": m.dir, "job_name": spec.name}
    if m.wandb:
        out["wandb"] = {"enabled": True, "project": spec.name}
    return out
