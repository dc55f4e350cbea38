"""The run's scalars in DeepSpeed's monitor (TensorBoard, CSV, wandb, as `training.monitor` enables them).

Each step writes ``Train/loss`` (the global-batch mean, the number the console prints), ``Train/lr`` and
``Train/tokens_per_s``; each validation writes ``Valid/loss``; all against the optimizer step. DeepSpeed's
MonitorMaster writes on rank 0 only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

MONITOR_KEYS = ("tensorboard", "csv_monitor")


def resolve_monitor_paths(ds_config: dict[str, Any], job_dir: str | os.PathLike[str]) -> None:
    """Make the monitors' relative output paths absolute inside the job directory (in place)."""
    for key in MONITOR_KEYS:
        section = ds_config.get(key)
        if isinstance(section,
                      dict) and section.get("enabled") and not os.path.isabs(section.get("output_path", "")):
            section["output_path"] = str(Path(job_dir) / section.get("output_path", ""))


def _monitor(engine: Any) -> Any:
    m = getattr(engine, "monitor", None)
    return m if m is not None and getattr(m, "enabled", False) else None


def write_step(engine: Any, step: int, loss: float, tokens_per_s: float) -> None:
    """One step's loss, learning rate and throughput."""
    m = _monitor(engine)
    if m is None:
        return
    events = [("Train/loss", loss, step), ("Train/tokens_per_s", tokens_per_s, step)]
    lrs = engine.get_lr() if hasattr(engine, "get_lr") else []
    if lrs:
        events.append(("Train/lr", float(lrs[0]), step))
    m.write_events(events)


def write_valid(engine: Any, step: int, loss: float) -> None:
    """One validation loss."""
    m = _monitor(engine)
    if m is not None:
        m.write_events([("Valid/loss", loss, step)])
