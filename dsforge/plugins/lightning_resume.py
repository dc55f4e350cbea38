"""Which Lightning checkpoints resume as the uninterrupted run, and the loop state that makes them do so.

Lightning 2.6 saves a ``ModelCheckpoint(save_on_train_epoch_end=True)`` checkpoint inside
``FitLoop.on_advance_end``: after the epoch's last batch and ``epoch_progress.increment_processed``, before
``increment_completed``. Restarted from it, the fit loop takes the stage ``RESTARTED_ON_EPOCH_END`` while the
epoch loop takes ``RESTARTED_ON_LAST``; no branch of ``FitLoop.reset`` completes the epoch for that pair, so
the finished epoch goes on with a fresh iterator and trains one extra batch (measured: batch_idx 4 of a
4-batch epoch, then the next epoch; every later step differs). The loop state such a checkpoint needs is the
one Lightning itself holds at the start of the next epoch: the epoch completed, the epoch loop's per-epoch
counters reset as ``reset_on_run`` resets them. Any other checkpoint is refused by the caller: one from
inside an epoch (``every_n_train_steps``, even at the epoch's last batch) restarts a DataLoader that does not
keep its own position at the epoch's first batch, and the other restart stages were not measured exact.
"""

from __future__ import annotations

from typing import Any

#: The Lightning releases whose restart logic the rewrite below was measured against (2.6.6): another
#: release's loops may restart differently, so its resume is refused rather than rewritten on trust.
MEASURED_LIGHTNING = ("2.6",)

#: The fit loop's keys in Lightning's ``loops`` checkpoint entry.
FIT = "fit_loop"
EPOCH = "epoch_progress"
BATCHES = "epoch_loop.batch_progress"
SCHEDULER = "epoch_loop.scheduler_progress"
OPTIM = "epoch_loop.automatic_optimization.optim_progress"
VAL_BATCHES = "epoch_loop.val_loop.batch_progress"


def _zero(counters: dict[str, Any]) -> None:
    """Set every counter of one Lightning progress record to 0 (``reset`` of its tracker)."""
    for key in counters:
        counters[key] = 0


def _reset_current(progress: dict[str, Any]) -> None:
    """Zero the per-epoch (``current``) counters of a progress record, nested ones included."""
    for key, value in progress.items():
        if key == "current" and isinstance(value, dict):
            _zero(value)
        elif isinstance(value, dict):
            _reset_current(value)


def measured_release(version: str) -> bool:
    """Whether a Lightning version is of a release this module's loop-state rewrite was measured on."""
    return ".".join(version.split(".")[:2]) in MEASURED_LIGHTNING


def at_epoch_end(loops: dict[str, Any]) -> bool:
    """Whether a Lightning checkpoint's loop state is the one saved at the end of an epoch (in
    ``on_train_epoch_end``): the epoch processed but not completed, and every batch of it completed."""
    fit = loops.get(FIT, {})
    try:
        epochs = fit[EPOCH]["total"]
        batches = fit[BATCHES]["current"]
        last = fit[BATCHES]["is_last_batch"]
    except (KeyError, TypeError):
        return False
    return bool(epochs["ready"] == epochs["started"] == epochs["processed"] == epochs["completed"] + 1
                and batches["ready"] == batches["started"] == batches["processed"] == batches["completed"] > 0
                and last)


def finish_epoch(loops: dict[str, Any]) -> None:
    """Rewrite an epoch-end checkpoint's loop state (in place) into the state at the next epoch's start."""
    fit = loops[FIT]
    for part in ("total", "current"):
        fit[EPOCH][part]["completed"] = fit[EPOCH][part]["processed"]
    _reset_current(fit[BATCHES])
    fit[BATCHES]["is_last_batch"] = False
    for key in (SCHEDULER, OPTIM):
        if key in fit:
            _reset_current(fit[key])
    if VAL_BATCHES in fit:
        _zero(fit[VAL_BATCHES]["total"])
