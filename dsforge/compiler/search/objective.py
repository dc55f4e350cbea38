"""What the search minimises: seconds per token (throughput), time or money for a token budget, or GPUs."""

from __future__ import annotations

from dataclasses import dataclass

from dsforge.compiler.search.space import options
from dsforge.compiler.spec.schema import JobSpec


@dataclass(frozen=True)
class Objective:
    """An objective with its inputs: the token budget, the price of a GPU-hour, the deadline."""

    name: str
    tokens: float
    price_per_gpu_hour: float | None
    deadline_s: float | None

    def value(self, step_s: float, tokens_per_step: float, gpus: int) -> float:
        """The quantity to minimise for a step time (the bounds rely on it growing with step_s)."""
        train_s = self.tokens * step_s / tokens_per_step
        if self.name == "throughput":
            return step_s / tokens_per_step
        if self.name == "cost":
            return train_s / 3600.0 * gpus * (self.price_per_gpu_hour or 0.0)
        return train_s  # time_to_train, and min_gpus among the layouts of one GPU count

    def feasible(self, step_s: float, tokens_per_step: float) -> bool:
        """False when the layout misses the deadline (min_gpus); a lower bound of step_s that misses it rules
        the layout out exactly."""
        if self.deadline_s is None:
            return True
        return self.tokens * step_s / tokens_per_step <= self.deadline_s

    @property
    def unit(self) -> str:
        """How the value reads."""
        return {"throughput": "s/token", "cost": "currency", "time_to_train": "s", "min_gpus": "s"}[self.name]


def objective_of(spec: JobSpec) -> Objective:
    """The job's objective with its defaults filled (tokens: training.steps x the tokens of a step)."""
    o = options(spec)
    tokens = o.tokens if o.tokens is not None else float(spec.training.steps * spec.training.global_batch
                                                        * spec.model.seq_len)
    deadline = (
        o.deadline_hours * 3600.0 if o.deadline_hours is not None and o.objective == "min_gpus" else None
    )
    return Objective(o.objective, tokens, o.price_per_gpu_hour, deadline)
