"""An nnictl experiment's trials side by side: every trial's pictures, and ``pareto.png``.

``pareto.png`` plots each trial's validation perplexity against the cost of the
architecture it found, with the Pareto front marked: the trade-off that the
compute penalty's weight sweeps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parnas.architecture import layout_string
from parnas.errors import ParnasError
from parnas.experiments import experiment_dir, trial_run_dirs
from parnas.plots import (
    ARCHITECTURE,
    MAX_FRAMES,
    Note,
    block_key,
    figure,
    plot_run,
    read_architecture,
    save_figure,
    stderr_note,
)


def pareto_figure(points: Sequence[TrialPoint], xlabel: str, title: str) -> Any:
    """Validation perplexity against cost, one dot per trial, the Pareto front joined and ringed."""
    fig = figure(7.5, 5.0, layout="constrained")
    ax = fig.add_subplot()
    xy = [(p.cost, p.val_ppl) for p in points]
    front = pareto_front(xy)
    ax.scatter(*zip(*xy), color="#777777", s=30, label="trial", zorder=2)
    fx, fy = zip(*(xy[i] for i in front))
    ax.step(fx, fy, where="post", color="#d62728", linewidth=1.5, zorder=1)
    ax.scatter(fx, fy, s=90, facecolors="none", edgecolors="#d62728", linewidths=1.8, label="Pareto front", zorder=3)
    for p in points:
        ax.annotate(f"{p.layout} ({p.trial})", (p.cost, p.val_ppl), textcoords="offset points", xytext=(5, 4),
                    fontsize=8)
    ax.set_xlabel(xlabel + "  \u2192 cheaper to the left")
    ax.set_ylabel("validation perplexity  (lower is better)")
    ax.set_title(f"Perplexity vs cost of the found architectures \u2014 {title}")
    ax.grid(alpha=0.3)
    ax.margins(x=0.12, y=0.08)
    ax.legend(frameon=False)
    return fig


@dataclass(frozen=True)
class TrialPoint:
    trial: str
    val_ppl: float
    cost: float
    layout: str  # e.g. "AADD"


def trial_cost(record: Mapping[str, Any]) -> tuple[float | None, str | None]:
    """``search.architecture_cost``, else the sum of ``search.block_costs`` over the architecture."""
    search = record.get("search") or {}
    unit = search.get("cost_unit")
    if isinstance(search.get("architecture_cost"), (int, float)):
        return float(search["architecture_cost"]), unit
    costs, arch = search.get("block_costs"), record.get("architecture") or {}
    if isinstance(costs, dict) and arch and all(isinstance(costs.get(k), (int, float)) for k in arch.values()):
        return float(sum(costs[k] for k in arch.values())), unit
    return None, unit


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (lower is better), by cost."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def experiment_points(run_dirs: Mapping[str, Path], note: Note = stderr_note) -> tuple[list[TrialPoint], str]:
    """One point per trial with a validation perplexity; x is the architecture's cost when every such
    trial records one in the same unit, else the number of attention blocks for all of them."""
    rows = []
    for trial, run in run_dirs.items():
        record = read_architecture(run, note) or {}
        ppl = (record.get("search") or {}).get("val_ppl")
        arch = record.get("architecture") or {}
        if not isinstance(ppl, (int, float)) or not math.isfinite(ppl) or not arch:
            note(f"trial {trial}: no search.val_ppl in {run / ARCHITECTURE}; left out of the Pareto plot")
            continue
        kinds = [arch[b] for b in sorted(arch, key=block_key)]
        rows.append((trial, float(ppl), kinds, *trial_cost(record)))
    units = {unit for *_, cost, unit in rows}
    if rows and all(cost is not None for *_, cost, _ in rows) and len(units) == 1:
        unit = units.pop()
        return [TrialPoint(t, p, c, layout_string(k)) for t, p, k, c, _ in rows], f"cost ({unit or 'as recorded'})"
    if rows:
        note("not every trial records search.architecture_cost (or block_costs) in one unit: "
             "the Pareto plot counts attention blocks instead")
    return ([TrialPoint(t, p, float(k.count("attention")), layout_string(k)) for t, p, k, *_ in rows],
            "attention blocks")


def plot_experiment(experiment_id: str, root: str | Path | None = None, *, max_frames: int = MAX_FRAMES,
                    tensorboard: bool = True, note: Note = stderr_note) -> list[Path]:
    """:func:`plot_run` for every trial of an nnictl experiment, then ``pareto.png`` in the experiment
    folder. A trial whose plots fail is reported and skipped; no trial at all is an error."""
    folder = experiment_dir(experiment_id, root)
    runs = trial_run_dirs(experiment_id, root)
    if not runs:
        raise ParnasError(f"experiment {experiment_id!r} ({folder}) has no trial with an architecture.json yet")
    written: list[Path] = []
    for trial, run in runs.items():
        try:
            written += plot_run(run, max_frames=max_frames, tensorboard=tensorboard, note=note)
        except ParnasError as e:
            note(f"trial {trial}: {e}")
    points, xlabel = experiment_points(runs, note)
    if points:
        written.append(save_figure(pareto_figure(points, xlabel, experiment_id),
                                    folder / "pareto.png"))
    else:
        note("no trial has a validation perplexity: pareto.png not written")
    return written
