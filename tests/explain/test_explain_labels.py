"""`dsforge explain` labels each of its three bubble figures and prints durations in human units.

The three figures measure different things and so differ for one job: the critical rank's idle time
as a share of its step (timing table), the idle share of all ranks over the simulated pipeline span
(the timeline picture), and the closed form (p-1)/(v*m+p-1) for equal stages without communication.
Text, HTML and the picture must say which is which; every duration reads in us, ms, s, min, h, days
or years (28.6 min, not 1713.64 s).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from dsforge.cli import cli
from dsforge.compiler.validate import validate_file
from dsforge.explain.report import Explanation, explain_plan
from dsforge.explain.text import BUBBLE_ROW, IDEAL_LABEL, SIMULATED_LABEL, render
from dsforge.explain.units import DAY, HOUR, MINUTE, YEAR, pct, seconds, time_axis
from tests.conftest import EXAMPLES

MULTINODE = next(p for p in EXAMPLES if p.name == "llama3-70b-multinode.yaml")
NO_PIPELINE = next(p for p in EXAMPLES if p.name == "tiny-tp2-dp2.yaml")
TINY_3D = next(p for p in EXAMPLES if p.name == "tiny-3d.yaml")
UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": MINUTE, "h": HOUR, "days": DAY, "years": YEAR}


def explained(path: Path) -> Explanation:
    result = validate_file(path)
    assert result.plan is not None
    return explain_plan(result.plan)


def test_each_bubble_figure_says_what_it_measures() -> None:
    ex = explained(MULTINODE)
    text, t, p = render(ex.summary), ex.summary["time"], ex.summary["pipeline"]
    share = pct(t["bubble_s"] / t["step_s"])
    row = next(line for line in text.splitlines() if line.strip().startswith(BUBBLE_ROW))
    assert row.split()[-2:] == share.split()  # the table's share column
    assert f"{share} of this rank's step" in text
    assert f"{pct(p['bubble_fraction'])} of the pipeline's rank-time, {SIMULATED_LABEL}" in text
    assert f"{pct(p['bubble_fraction_closed_form'])} {IDEAL_LABEL}" in text
    # why labels matter
    assert len({share, pct(p["bubble_fraction"]), pct(p["bubble_fraction_closed_form"])}) == 3
    assert "pipeline bubble: none (one pipeline stage)" in render(explained(NO_PIPELINE).summary)


def test_time_to_train_of_half_an_hour_reads_in_minutes() -> None:
    tokens_per_s = explained(TINY_3D).summary["time"]["tokens_per_s"]
    result = CliRunner().invoke(cli, ["explain", str(TINY_3D), "--tokens", str(tokens_per_s * 1713.64)])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if "time to train" in x)
    assert "28.6 min for" in line and " s for" not in line


@pytest.mark.parametrize(("s", "shown"), [
    (0.0, "0.0 us"), (2.5e-5, "25.0 us"), (0.0123, "12.3 ms"), (0.99999, "1.00 s"), (19.1, "19.10 s"),
    (59.99, "59.99 s"), (59.999, "1.0 min"), (1713.64, "28.6 min"), (3599.0, "1.0 h"), (5400.0, "1.5 h"),
    (47 * HOUR, "47.0 h"), (11.1 * DAY, "11.1 days"), (3 * YEAR, "3.0 years"),
])
def test_durations_pick_the_unit_that_reads_best(s: float, shown: str) -> None:
    assert seconds(s) == shown


@given(st.floats(min_value=1e-6, max_value=1e11, allow_nan=False))
def test_every_duration_is_a_number_at_least_one_of_a_unit_and_means_the_same_time(s: float) -> None:
    match = re.fullmatch(r"(\d+\.\d+) (us|ms|s|min|h|days|years)", seconds(s))
    assert match, seconds(s)
    value, unit = float(match.group(1)), match.group(2)
    assert value >= 1.0 or unit == "us"
    assert value * UNITS[unit] == pytest.approx(s, rel=0.05, abs=0.051 * UNITS[unit])


@pytest.mark.parametrize(("span", "unit"), [(0.3, "ms"), (19.0, "s"), (600.0, "min"), (9000.0, "h")])
def test_timeline_axis_unit(span: float, unit: str) -> None:
    scale, name = time_axis(span)
    assert name == unit and 1.0 <= span * scale < 1000


def test_picture_and_html_carry_the_labels(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from dsforge.explain import plots
    from dsforge.explain.report import write_outputs

    ex = explained(MULTINODE)
    p = ex.summary["pipeline"]
    fig = plots.timeline_figure(ex.step.timeline, "job", ideal=p["bubble_fraction_closed_form"])
    title = fig.axes[0].get_title()
    plots.close(fig)
    assert f"{100 * p['bubble_fraction']:.1f} % of rank-time ({SIMULATED_LABEL})" in title
    assert f"{100 * p['bubble_fraction_closed_form']:.1f} % {IDEAL_LABEL}" in title
    page = tmp_path / "report.html"
    write_outputs(ex, None, page)
    html = page.read_text(encoding="utf-8")
    assert BUBBLE_ROW in html and SIMULATED_LABEL in html and IDEAL_LABEL in html
