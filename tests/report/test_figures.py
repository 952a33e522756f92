"""Every picture parnas draws fits its canvas and keeps its legends off the data: each figure is rendered, then
every piece of text is measured against the figure's bounds and every legend against the points it would hide.
A clipped axis label or a legend over the lines is what a user sees first in a picture and cannot fix."""

import json

import numpy as np
import pytest

from parnas.report import heatmap, pareto, plots
from parnas.report.experiments import RUNNING
from parnas.report.history import load_history
from tests.report.test_plots import ON_CPU, write_run

SLOW = pytest.mark.slow  # the other shapes of a figure: `make test` draws them, `make test-fast` one of each
SEVEN = ("attention", "dense", "identity", "conv", "glu", "sqrelu", "compressive")


def texts(fig):
    """Every text ``fig`` draws: titles, labels, notes, legends, and the tick labels of the ticks in view
    (matplotlib keeps labels for ticks beyond the axis limits and on hidden axes, which it does not draw)."""
    axes = [a for ax in fig.axes for a in (ax.xaxis, ax.yaxis)]
    every_tick = {id(label) for axis in axes for tick in (*axis.majorTicks, *axis.minorTicks)
                  for label in (tick.label1, tick.label2)}
    found = [t for t in fig.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_window_extent"))
             if id(t) not in every_tick]
    for axis in (a for ax in fig.axes if ax.axison for a in (ax.xaxis, ax.yaxis)):
        lo, hi = sorted(axis.get_view_interval())
        slack = 1e-9 * (hi - lo)
        for locs, ticks in ((axis.get_majorticklocs(), axis.get_major_ticks()),
                            (axis.get_minorticklocs(), axis.get_minor_ticks())):
            found += [label for loc, tick in zip(locs, ticks) if lo - slack <= loc <= hi + slack
                      for label in (tick.label1, tick.label2) if tick.get_visible()]
    return [t for t in found if t.get_visible() and t.get_text().strip()]


def legends(fig):
    return [leg for leg in [*fig.legends, *(ax.get_legend() for ax in fig.axes)] if leg is not None]


def data_points(fig):
    """The display coordinates of every plotted point: line vertices and scatter offsets."""
    points = []
    for ax in fig.axes:
        for line in ax.get_lines():
            xy = np.column_stack(line.get_data()).astype(float)
            points.append(ax.transData.transform(xy[np.isfinite(xy).all(axis=1)]))
        for collection in ax.collections:
            offsets = np.asarray(collection.get_offsets(), dtype=float)
            if offsets.size:
                points.append(collection.get_offset_transform().transform(offsets))
    return np.concatenate(points) if points else np.empty((0, 2))


def check_fits(fig):
    fig.canvas.draw()  # lays out (constrained layout runs here) and renders, as savefig does
    renderer = fig.canvas.get_renderer()
    canvas = fig.bbox
    for text in texts(fig):
        box = text.get_window_extent(renderer)
        assert (canvas.x0 - 0.5 <= box.x0 and box.x1 <= canvas.x1 + 0.5 and canvas.y0 - 0.5 <= box.y0
                and box.y1 <= canvas.y1 + 0.5), f"clipped: {text.get_text()!r} {box} outside {canvas}"
    points = data_points(fig)
    for legend in legends(fig):
        box = legend.get_window_extent(renderer)
        inside = points[(points[:, 0] > box.x0) & (points[:, 0] < box.x1) & (points[:, 1] > box.y0)
                        & (points[:, 1] < box.y1)]
        labels = [t.get_text() for t in legend.get_texts()]
        assert not len(inside), f"the legend {labels} covers {len(inside)} data points, e.g. {inside[0]}"


def evaluated_late(run):
    """A search whose first evaluation is halfway (as with a long warm-up): its perplexity lines start high in the
    middle of the panel."""
    lines = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    half = lines[-1]["step"] // 2
    for line in lines:
        if line["step"] < half:
            for key in ("val_ppl", "supernet_val_ppl", "architecture"):
                line.pop(key, None)
    (run / "history.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {"four": write_run(root / "four", seed=1), "late": evaluated_late(write_run(root / "late", seed=4)),
            "two": write_run(root / "two", n_blocks=2, seed=5),  # one column: the narrowest figure
            "twelve": write_run(root / "twelve", n_blocks=12, seed=2, steps=200, arch=False),
            "seven": write_run(root / "seven", n_blocks=7, seed=3, kinds=SEVEN, winners=list(SEVEN), latency=False)}


@pytest.mark.parametrize("name", ["late", "two", *(pytest.param(n, marks=SLOW) for n in ("four", "seven", "twelve"))])
def test_the_probabilities_figure_fits_and_its_legends_cover_no_line(runs, name):
    check_fits(plots.lines_figure(load_history(runs[name])))


@pytest.mark.parametrize("name", ["seven", *(pytest.param(n, marks=SLOW) for n in ("four", "twelve"))])
def test_the_architecture_figure_fits(runs, name):
    history = load_history(runs[name])
    check_fits(plots.architecture_figure(history, plots.read_architecture(runs[name], print)))


@pytest.mark.parametrize("name", ["seven"])
def test_the_heat_map_frames_fit(runs, name):
    drawer = heatmap.HeatmapFigure(load_history(runs[name]))
    drawer.render(0)
    check_fits(drawer.fig)


def trial_points(n, status_every=0):
    rng = np.random.default_rng(n)
    layouts = ["".join(rng.choice(list("ADI"), 12)) for _ in range(n)]
    return [pareto.TrialPoint(f"trial{i:02d}", float(40 + 20 * rng.random()), float(0.4 + 0.7 * rng.random()),
                              layout, RUNNING if status_every and i % status_every == 0 else "finished",
                              step=1200 if status_every and i % status_every == 0 else None)
            for i, layout in enumerate(layouts)]


@pytest.mark.parametrize("n, running, xlabel", [
    (24, 4, pareto.LATENCY_LABEL.replace("train step", "generated token on cuda")),
    *(pytest.param(*case, marks=SLOW) for case in ((12, 3, ON_CPU), (5, 2, "attention blocks"),
                                                              (8, 0, "cost of the exported architecture (ms/step)")))])
def test_the_pareto_figure_fits_and_its_legend_covers_no_trial(n, running, xlabel):
    check_fits(pareto.pareto_figure(trial_points(n, running), xlabel, "a1b2c3d4"))


def test_the_longest_label_at_either_end_of_the_pareto_axis_stays_on_the_canvas():
    layout = "ADIDADIDADIDADIDADIDADID"  # 24 blocks
    points = [pareto.TrialPoint("first-trial", 50.0, 0.2, layout, RUNNING, step=123_456),
              pareto.TrialPoint("middle", 45.0, 0.7, layout),
              pareto.TrialPoint("last-trial", 40.0, 1.3, layout, RUNNING, step=123_456)]
    check_fits(pareto.pareto_figure(points, ON_CPU, "a1b2c3d4"))
