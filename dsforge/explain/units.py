"""Human-readable numbers for the tables: bytes in GB (1e9, as memory_gb), durations, counts, percentages."""

from __future__ import annotations


def gb(n_bytes: float) -> str:
    """Bytes as GB (1e9 bytes) with two decimals (MB, kB, B for small ones), "-" for nothing."""
    if n_bytes == 0:
        return "-"
    if abs(n_bytes) < 1e3:
        return f"{n_bytes:.0f} B"
    if abs(n_bytes) < 1e5:
        return f"{n_bytes / 1e3:.1f} kB"
    if abs(n_bytes) < 1e8:
        return f"{n_bytes / 1e6:.1f} MB"
    return f"{n_bytes / 1e9:.2f} GB"


MINUTE, HOUR, DAY, YEAR = 60.0, 3600.0, 86400.0, 365.0 * 86400.0


#: (seconds per unit, name, decimals, where the next unit takes over, in this unit).
_DURATIONS = ((1e-6, "us", 1, 1000.0), (1e-3, "ms", 1, 1000.0), (1.0, "s", 2, MINUTE),
              (MINUTE, "min", 1, 60.0), (HOUR, "h", 1, 48.0), (DAY, "days", 1, 730.0),
              (YEAR, "years", 1, float("inf")))


def seconds(s: float) -> str:
    """A duration in us, ms, s, min, h, days or years, whichever reads best (28.6 min, not 1713.64 s).

    Each unit holds until its rounded value would reach the next one's (59.99 s, then 1.0 min).
    """
    for size, unit, digits, limit in _DURATIONS:
        value = round(s / size, digits)
        if value < limit:
            return f"{value:.{digits}f} {unit}"
    raise AssertionError("unreachable: the last unit has no limit")


def time_axis(span: float) -> tuple[float, str]:
    """The factor and unit for a time axis from 0 to ``span`` seconds (ms, s, min or h), for the pictures."""
    if span < 1:
        return 1e3, "ms"
    if span < 2 * MINUTE:
        return 1.0, "s"
    if span < 2 * HOUR:
        return 1 / MINUTE, "min"
    return 1 / HOUR, "h"


def count(n: float) -> str:
    """A large count with a k/M/B/T suffix."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}"
    return f"{n:.3g}" if isinstance(n, float) and not float(n).is_integer() else f"{int(n)}"


def plural(n: int, word: str, many: str = "") -> str:
    """``n`` and ``word``, in its plural (``many``, default word + "s") unless n is 1: "1 stage", "4
    stages"."""
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"


def rate(x: float) -> str:
    """A rate with three significant digits (TFLOP/s figures from 0.05 to 1,000)."""
    return f"{x:.4g}" if x >= 1 else f"{x:.3g}"


def pct(x: float) -> str:
    """A 0-1 fraction as a percentage with one decimal."""
    return f"{100 * x:.1f} %"


def table(headers: list[str], rows: list[list[str]], right: tuple[int, ...] = (), indent: str = "  ") -> str:
    """Text columns under a header row; the columns listed in ``right`` (numbers) are right-aligned."""
    cells = [headers] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        out = [cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        return (indent + "  ".join(out)).rstrip()

    return "\n".join(line(r) for r in cells)
