"""Every candidate of a small search space, planned as the search plans it (shared by the search tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dsforge.compiler.frontend.parse import LoadedJob, load_job
from dsforge.compiler.model.resolved import resolve_model
from dsforge.compiler.search.engine import _model_seeded
from dsforge.compiler.search.space import Layout, apply_layout, layouts, skeletons


def candidates(write_job: Callable[[str], Path], text: str) -> Iterator[tuple[LoadedJob, Layout, Any]]:
    """(job, layout, plan) of every layout legal by construction in the job file ``text``."""
    job, diags = load_job(write_job(text))
    assert job is not None, diags
    model = resolve_model(job.spec.model)
    nodes = job.spec.hardware.nodes
    for skel in skeletons(job.spec, model, nodes):
        for lay in layouts(job.spec, model, skel, nodes):
            yield job, lay, _model_seeded(apply_layout(job.spec, lay), model)
