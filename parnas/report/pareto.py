"""An nnictl experiment's trials side by side: every trial's pictures, and ``pareto.png``: the exported
architectures' val ppl against their predicted latency (or cost), the trade-off the compute penalty's weight sweeps.
Trials not finished are drawn from their history so far, hollow (docs/reference.md, "Seeing the search").
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parnas.config import TARGET_LABELS
from parnas.errors import ParnasError
from parnas.report.experiments import (
    EXPORTED_PPL_LABEL,
    FINISHED,
    LETTER_CODE,
    RUNNING,
    STOPPED,
    Trial,
    experiment_dir,
    experiment_trials,
    perplexities,
    status_counts,
)
from parnas.report.history import HISTORY, HistoryError, block_key, load_history
from parnas.report.plots import (
    ARCHITECTURE,
    MAX_FRAMES,
    Note,
    figure,
    plot_run,
    read_architecture,
    save_figure,
    stderr_note,
)

LATENCY_LABEL = "predicted train step \u00f7 Transformer-XL's at the same n_blocks (search.latency.ratio)"
_MARKERS = {FINISHED: ("o", "finished"), RUNNING: ("o", "running (history so far)"),
            STOPPED: ("s", "stopped (history until it stopped)")}


@dataclass(frozen=True)
class TrialPoint:
    trial: str
    val_ppl: float  # the exported architecture's (supernet weights, not retrained)
    cost: float  # the x axis: latency ratio, cost, or attention blocks
    layout: str  # e.g. "AADD"
    status: str = FINISHED  # FINISHED, RUNNING or STOPPED
    step: int | None = None  # the evaluation's step, for a trial not finished


def pareto_figure(points: Sequence[TrialPoint], xlabel: str, title: str) -> Any:
    """Perplexity against cost, one dot per trial (hollow: not finished), the Pareto front (of the finished trials;
    with none, of the histories so far) joined and ringed."""
    fig = figure(8.0, 5.4, layout="constrained")
    ax = fig.add_subplot()
    for status, (marker, label) in _MARKERS.items():
        group = [p for p in points if p.status == status]
        if group:
            face = "#777777" if status == FINISHED else "none"
            ax.scatter([p.cost for p in group], [p.val_ppl for p in group], marker=marker, s=34, facecolors=face,
                       edgecolors="#555555", linewidths=1.3, label=label, zorder=2)
    finished = [p for p in points if p.status == FINISHED]
    ranked = finished or list(points)
    xy = [(p.cost, p.val_ppl) for p in ranked]
    fx, fy = zip(*(xy[i] for i in pareto_front(xy)))
    ax.step(fx, fy, where="post", color="#d62728", linewidth=1.5, zorder=1)
    ax.scatter(fx, fy, s=100, facecolors="none", edgecolors="#d62728", linewidths=1.8, zorder=3,
               label="Pareto front" + ("" if finished else " (histories so far)"))
    for group in coinciding(points):
        trials = ", ".join(p.trial + ("" if p.step is None else f", step {p.step:,}") for p in group)
        ax.annotate(f"{group[0].layout} ({trials})", (group[0].cost, group[0].val_ppl), textcoords="offset points",
                    xytext=(5, 4), fontsize=8)
    ax.set_xlabel(f"{xlabel}\n\u2190 cheaper", fontsize=9)  # two lines: a device's latency label is long
    ax.set_ylabel(EXPORTED_PPL_LABEL.replace(" (", "\n("), fontsize=9)
    what = "predicted latency" if xlabel.startswith("predicted ") else xlabel.split(" (")[0]
    fig.suptitle(f"Perplexity vs {what} of the found architectures \u2014 {title}", fontsize=11)
    ax.set_title(f"labels: architecture ({LETTER_CODE}), trial", fontsize=8, color="#555555")
    ax.grid(alpha=0.3)
    ax.margins(x=0.12, y=0.08)
    low, high = ax.get_xlim()
    ax.set_xlim(*widened(low, high, MIN_X_SPAN if xlabel == LATENCY_LABEL else 0.1 * max(abs(low), abs(high))))
    low, high = ax.get_ylim()
    ax.set_ylim(*widened(low, high, MIN_Y_SPAN * (low + high) / 2))
    # under the axis, not over the trials: wherever they lie, a legend inside could hide some
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), frameon=False, fontsize=8)
    return fig


MIN_X_SPAN = 0.2  # of a latency ratio: layouts a block apart differ by about a tenth of Transformer-XL's step
MIN_Y_SPAN = 0.05  # of the perplexity: beyond the seed spread of a short retrain, so noise never fills the axis
SAME_PPL = 0.005  # points of one layout and cost whose perplexities differ by less share a label


def coinciding(points: Sequence[TrialPoint]) -> list[list[TrialPoint]]:
    """The points in groups one label names (one layout at one cost, perplexities within :data:`SAME_PPL`), in order."""
    groups: list[list[TrialPoint]] = []
    for p in points:
        group = next((g for g in groups if g[0].layout == p.layout and math.isclose(g[0].cost, p.cost, rel_tol=1e-3)
                      and abs(g[0].val_ppl - p.val_ppl) <= SAME_PPL * g[0].val_ppl), None)
        if group is None:
            groups.append([p])
        else:
            group.append(p)
    return groups


def widened(low: float, high: float, span: float) -> tuple[float, float]:
    """``(low, high)`` widened about its middle to at least ``span``."""
    if high - low >= span:
        return low, high
    middle = (low + high) / 2
    return middle - span / 2, middle + span / 2


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


def latency_ratio(record: Mapping[str, Any]) -> float | None:
    """``search.latency.ratio``: the exported architecture's predicted train step over Transformer-XL's."""
    latency = (record.get("search") or {}).get("latency")
    ratio = latency.get("ratio") if isinstance(latency, dict) else None
    return float(ratio) if isinstance(ratio, (int, float)) and math.isfinite(ratio) else None


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (lower is better), by cost."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


@dataclass(frozen=True)
class _Row:
    trial: str
    status: str
    val_ppl: float
    layout: str
    ratio: float | None = None
    cost: float | None = None
    unit: str | None = None
    step: int | None = None
    block_costs: tuple[tuple[str, float], ...] = ()
    config: str = ""  # model settings, block costs and latency device: trials alike in these can be compared
    device: str | None = None  # the device whose latency table priced the trial
    target: str = "train step"  # what that latency is (search.latency.target)


def _finished_row(trial: Trial, note: Note) -> _Row | None:
    record = read_architecture(trial.run_dir, note) or {}
    arch = record.get("architecture") or {}
    exported, supernet = perplexities(record.get("search") or {})
    if exported is None or not arch:
        why = (f"records only the supernet's val ppl ({supernet:.2f}), an older search" if supernet else
               "records no val ppl of its exported architecture")
        note(f"trial {trial.id}: {trial.run_dir / ARCHITECTURE} {why}; left out of the Pareto plot")
        return None
    layout = "".join(arch[b][0].upper() for b in sorted(arch, key=block_key))
    search = record.get("search") or {}
    costs = search.get("block_costs") if isinstance(search.get("block_costs"), dict) else {}
    latency = search.get("latency") if isinstance(search.get("latency"), dict) else {}
    config = json.dumps([record.get("model"), costs, search.get("cost_unit"), latency.get("device"),
                         latency.get("transformer_xl_ms")], sort_keys=True, default=str)
    return _Row(trial.id, FINISHED, exported, layout, latency_ratio(record), *trial_cost(record),
                block_costs=tuple(sorted(costs.items())), config=config,
                device=latency.get("device") if isinstance(latency.get("device"), str) else None,
                target=TARGET_LABELS.get(latency.get("target"), "train step"))


def _history_row(trial: Trial, note: Note) -> _Row | None:
    """A trial not finished: its last evaluation of the exported architecture so far (None before its first)."""
    if not (trial.run_dir / HISTORY).is_file():
        return None  # nothing logged yet
    try:
        history = load_history(trial.run_dir)
    except HistoryError as e:
        note(f"trial {trial.id} ({trial.status}): {e}")
        return None
    known = np.flatnonzero(np.isfinite(history.val_ppl))
    if not known.size:
        note(f"trial {trial.id} ({trial.status}): no evaluation of its exported architecture yet; "
             "left out of the Pareto plot")
        return None
    i, step = int(known[-1]), int(history.val_steps[known[-1]])
    layout = history.architectures[i]
    if not layout:
        probs = history.probs[int(np.searchsorted(history.steps, step))]
        layout = "".join(history.kinds[j][0].upper() for j in probs.argmax(axis=1))
    return _Row(trial.id, trial.status, float(history.val_ppl[i]), layout, step=step)


def experiment_points(trials: Mapping[str, Trial], note: Note = stderr_note) -> tuple[list[TrialPoint], str]:
    """One point per trial with a val ppl of its exported architecture (unfinished trials: from their history). x is
    ``search.latency.ratio`` where every finished trial records one, else the cost where they all record one in one
    unit, else the number of attention blocks; a trial not finished without one (:func:`_unfinished_x`) is left out."""
    rows = [row for trial in trials.values()
            if (row := (_finished_row if trial.status == FINISHED else _history_row)(trial, note)) is not None]
    base = [r for r in rows if r.status == FINISHED] or rows
    units = {r.unit for r in base}
    if base and all(r.ratio is not None for r in base):
        devices = {r.device for r in base}  # named when one device priced them all (maybe not this machine)
        targets = {r.target for r in base}
        target = targets.pop() if len(targets) == 1 else "latency"
        on = f" on {devices.pop()}" if len(devices) == 1 and None not in devices else ""
        axis, xlabel = "ratio", LATENCY_LABEL.replace("train step", f"{target}{on}")
    elif base and all(r.cost is not None for r in base) and len(units) == 1:
        axis, xlabel = "cost", f"cost of the exported architecture ({units.pop() or 'as recorded'})"
    else:
        if any(r.status == FINISHED for r in base):
            note("not every finished trial records search.latency, search.architecture_cost or block_costs in one "
                 "unit: the Pareto plot counts attention blocks instead")
        axis, xlabel = "attention", "attention blocks"
    finished = [r for r in rows if r.status == FINISHED]
    points = []
    for r in rows:
        if axis == "attention":
            value: float | None = float(r.layout.count("A"))
        else:
            value = getattr(r, axis) if r.status == FINISHED else _unfinished_x(r, finished, axis)
        if value is None:
            note(f"trial {r.trial} ({r.status}): no {xlabel.split(' (')[0]} for {r.layout} until it finishes; "
                 "left out of the Pareto plot")
            continue
        points.append(TrialPoint(r.trial, r.val_ppl, value, r.layout, r.status, r.step))
    return points, xlabel


def _unfinished_x(row: _Row, finished: Sequence[_Row], axis: str) -> float | None:
    """The latency ratio or cost of a trial not finished (its history gives only its architecture so far), where every
    finished trial has one model, block costs and latency device: its architecture's cost under those block costs, or
    the latency ratio of a finished trial that exported the same architecture."""
    if not finished or len({r.config for r in finished}) != 1:
        return None
    if axis == "cost" and finished[0].block_costs:
        costs = {kind[0].upper(): cost for kind, cost in finished[0].block_costs}
        return float(sum(costs[c] for c in row.layout)) if set(row.layout) <= set(costs) else None
    return next((getattr(r, axis) for r in finished if r.layout == row.layout), None)


def plot_experiment(experiment_id: str, root: str | Path | None = None, *, max_frames: int = MAX_FRAMES,
                    tensorboard: bool = True, note: Note = stderr_note) -> list[Path]:
    """:func:`plot_run` for every trial that has logged a step, then ``pareto.png`` in the experiment folder. A trial
    whose plots fail is reported and skipped; no trial with a history at all is an error."""
    folder = experiment_dir(experiment_id, root)
    every = experiment_trials(experiment_id, root)
    trials = {t: trial for t, trial in every.items() if trial.status == FINISHED or (trial.run_dir / HISTORY).is_file()}
    if not trials:
        raise ParnasError(f"experiment {experiment_id!r} ({folder}) has no trial with a {HISTORY} yet "
                          f"({status_counts(every)})")
    if any(t.status != FINISHED for t in trials.values()):
        note(f"experiment {experiment_id}: {status_counts(every)}; trials not finished are drawn from their "
             "history so far (hollow markers in pareto.png)")
    written: list[Path] = []
    for trial in trials.values():
        try:
            written += plot_run(trial.run_dir, max_frames=max_frames, tensorboard=tensorboard, note=note)
        except ParnasError as e:
            note(f"trial {trial.id}: {e}")
    points, xlabel = experiment_points(trials, note)
    if points:
        written.append(save_figure(pareto_figure(points, xlabel, experiment_id), folder / "pareto.png"))
    else:
        note("no trial has a val ppl of its exported architecture yet: pareto.png not written")
    return written

