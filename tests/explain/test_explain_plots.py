"""Pictures and the HTML report: files are real PNG/SVG, and the timeline shows work and bubbles where they
are."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsforge.cli import cli
from dsforge.compiler.validate import validate_file
from dsforge.explain import plots
from dsforge.explain.report import explain_plan
from tests.conftest import EXAMPLES

pytest.importorskip("matplotlib")

TINY_3D = next(p for p in EXAMPLES if p.name == "tiny-3d.yaml")


def _hex(colour: str) -> tuple[float, float, float]:
    return tuple(int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))  # type: ignore[return-value]


def test_plot_and_html_files(tmp_path: Path) -> None:
    html = tmp_path / "report.html"
    result = CliRunner().invoke(cli,
                                ["explain", str(TINY_3D), "--plot", str(tmp_path / "pics"), "--html",
                                 str(html)])
    assert result.exit_code == 0, result.output
    for stem in ("timeline", "memory", "placement"):
        png, svg = tmp_path / "pics" / f"{stem}.png", tmp_path / "pics" / f"{stem}.svg"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert ET.parse(svg).getroot().tag.endswith("svg")
    page = html.read_text(encoding="utf-8")
    assert page.count("<svg") == 3 and "<table>" in page
    assert 'src="http' not in page and "<link" not in page  # self-contained
    for chunk in page.split("<svg")[1:]:
        ET.fromstring("<svg" + chunk.split("</svg>")[0] + "</svg>")  # every inline SVG is well-formed


def test_timeline_picture_shows_passes_and_the_bubble(tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    ex = explain_plan(validate_file(TINY_3D).plan)
    with_bubble = ex.step.timeline.bubble_fraction
    fig = plots.timeline_figure(ex.step.timeline, "tiny")
    plots.save(fig, tmp_path, "timeline")
    plots.close(fig)
    pixels = mpimg.imread(tmp_path / "timeline.png")[:, :, :3]

    def share(colour: str) -> float:
        target = _hex(colour)
        close = (abs(pixels - target) < 0.02).all(axis=2)
        return float(close.mean())

    forward, backward, idle = share(plots._FORWARD[0]), share(plots._BACKWARD[0]), share(plots._IDLE)
    assert forward > 0.01 and backward > 0.01 and idle > 0.01
    # the painted areas follow the simulated pass lengths and the idle share
    slots = [x for row in ex.step.timeline.stages for x in row]
    b_over_f = sum(x.end - x.start for x in slots if x.kind == "B") / sum(
        x.end - x.start for x in slots if x.kind == "F"
    )
    assert backward / forward == pytest.approx(b_over_f, rel=0.15)
    assert idle / (forward + backward + idle) == pytest.approx(with_bubble, rel=0.25)


def test_memory_and_placement_pictures_of_a_multinode_job(tmp_path: Path) -> None:
    path = next(p for p in EXAMPLES if p.name == "gpt3-175b-cluster.yaml")
    ex = explain_plan(validate_file(path).plan)
    fig = plots.memory_figure(ex.memory, "gpt3")
    ax = fig.axes[0]
    assert len({round(b.get_x(), 3) for b in ax.patches}) == 16  # one bar per stage
    assert any(line.get_ydata()[0] == pytest.approx(80.0) for line in ax.lines)  # the capacity line, GB
    plots.close(fig)
    assert ex.plan.placement is not None
    fig = plots.placement_figure(ex.plan.placement, ["tp", "pp", "dp"], "gpt3")
    images = [ax.images[0].get_array() for ax in fig.axes]
    assert [a.shape for a in images] == [(8, 128)] * 3  # 128 nodes x 8 GPUs, transposed to stay wide
    assert images[1][:, 0].tolist() == [0] * 8 and images[1][:, -1].tolist() == [15] * 8  # stages by node
    assert len(set(images[0][:, 0].tolist())) == 1  # a tensor-parallel group fills a node
    plots.close(fig)
