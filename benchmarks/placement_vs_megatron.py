"""A longer run of the placement differential test: place() against the Megatron reference.

tests/compiler/plan/test_placement_megatron.py compares 2,500 random (layout, order) cases in CI; this
compares N more (worlds up to --max-world ranks), stops at the first disagreement with the failing case, and
prints how many cases fell in each outcome class.

    python benchmarks/placement_vs_megatron.py [N] [--max-world 4096]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.compiler.plan.test_placement_megatron import run_comparison


def main() -> int:
    """Run the comparison and print the counts; exit 1 on a disagreement."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="?", type=int, default=20000)
    parser.add_argument("--max-world", type=int, default=4096)
    args = parser.parse_args()
    seen: Counter[str] = Counter()
    start = time.perf_counter()
    try:
        run_comparison(args.cases, seen, max_world=args.max_world)
    except AssertionError as exc:
        print(f"disagreement after {sum(seen.values())} cases:\n{exc}")
        return 1
    print(f"{sum(seen.values())} (layout, order) cases, worlds up to {args.max_world} ranks, "
          f"{time.perf_counter() - start:.0f} s, all equal to the reference:")
    for outcome, count in sorted(seen.items()):
        print(f"  {count:7d}  {outcome}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
