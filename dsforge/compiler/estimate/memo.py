"""Memos of the estimate layer, so that a search's tens of thousands of calls do not redo the same arithmetic.

Two kinds, both exact (a memo returns what the computation it stands for returns, bit for bit):

* `plan_memo`: results that depend on the whole plan (its ZeRO settings, activation shape, per-stage
  chunks, collectives) kept in a dict on the plan itself, so they live exactly as long as the plan;
* `bounded`: pure functions of a few hashable inputs shared by many plans (a model's per-kind layer
  tables, a chunk's FLOPs and seconds), in an `lru_cache` of fixed size, so a long process that sees many
  jobs keeps at most ``maxsize`` entries each.

`clear_caches` empties every bounded cache: the tests compare results computed with warm caches against
results computed with none (a key that left out an input would return another plan's result).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any, TypeVar, cast

from dsforge.compiler.plan.plan import AnyPlan

F = TypeVar("F", bound=Callable[..., Any])

_CACHES: list[Any] = []

_MEMO = "_estimate_memo"  # the plan's __dict__ entry (a frozen dataclass; cached_property writes there too)


def bounded(maxsize: int) -> Callable[[F], F]:
    """Decorate a pure function with an `lru_cache` of ``maxsize`` entries (typed keys: 1 and 1.0 apart),
    registered for `clear_caches`."""

    def wrap(fn: F) -> F:
        cached = lru_cache(maxsize=maxsize, typed=True)(fn)
        _CACHES.append(cached)
        return cast(F, cached)

    return wrap


def plan_memo(plan: AnyPlan) -> dict[Any, Any]:
    """The dict of estimate results kept on ``plan`` (a plan is immutable, so they never go stale)."""
    memo = plan.__dict__.get(_MEMO)
    if memo is None:
        memo = plan.__dict__[_MEMO] = {}
    return memo


def clear_caches() -> None:
    """Empty every bounded cache of the estimate layer (plans keep their own memos: build new plans)."""
    for cached in _CACHES:
        cached.cache_clear()
