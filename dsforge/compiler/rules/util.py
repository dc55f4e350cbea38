"""Small arithmetic helpers shared by the rules' messages and fixes."""

from __future__ import annotations

from math import isqrt


def divisors(n: int, limit: int | None = None) -> list[int]:
    """The divisors of ``n`` in increasing order (at most ``limit`` as a value, if given)."""
    small = [d for d in range(1, isqrt(n) + 1) if n % d == 0] if n > 0 else []
    # each divisor d <= sqrt(n) pairs with n // d >= sqrt(n); a square's root is listed once
    out = small + [n // d for d in reversed(small) if d * d != n]
    return [d for d in out if limit is None or d <= limit]


def choices(values: list[int]) -> str:
    """Render a set of candidate values as ``{1, 2, 4}``."""
    return "{" + ", ".join(str(v) for v in values) + "}"


def next_multiple(n: int, k: int) -> int:
    """The smallest multiple of ``k`` that is >= ``n``."""
    return -(-n // k) * k
