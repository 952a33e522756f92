"""Gather the architectures an nnictl experiment's trials found, best first, and say how sure each is.

A trial's quality is its exported architecture's validation perplexity with the supernet's weights (``search.val_ppl``),
beside the supernet's own and, after a final pick, the retrained ones of its export and guard. A block's margin is
the *exported* kind's probability less the best other kind's: below
:data:`parnas.report.experiments.UNDECIDED_MARGIN` the choice is close to a coin toss (*undecided*); below 0 the
budget or the final pick chose it over the supernet's preference (*overruled*).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from parnas import architecture
from parnas.config import TARGET_LABELS
from parnas.errors import ParnasError
from parnas.files import copy_atomic, ensure_writable_dir, write_json_atomic
from parnas.report.experiment_summary import pick_ppls
from parnas.report.experiments import (
    FINISHED,
    LETTER_CODE,
    RUNNING,
    STOPPED,
    UNDECIDED_MARGIN,
    experiment_trials,
    margin,
    perplexities,
)

PARAMETERS = ("seed", "penalty_weight", "arch_lr", "forward", "tau_final")


def trial_row(trial_id: str, path: Path) -> dict[str, Any]:
    """What ``parnas export`` reports of one finished trial (the ``--json`` dump's row)."""
    record = architecture.read(path)
    search = record["search"]
    exported, supernet = perplexities(search)
    blocks = [architecture.label(i) for i in range(len(record["architecture"]))]  # input first
    probs = record["probabilities"]
    margins = {b: round(exported_margin(probs[b], record["architecture"][b]), 4) for b in blocks
               if isinstance(probs.get(b), dict) and probs[b]}
    selection = search.get("selection") if isinstance(search.get("selection"), dict) else {}
    (retrained, guard_ppl), guard = pick_ppls(selection), selection.get("guard") or {}
    latency = search.get("latency") if isinstance(search.get("latency"), dict) else None
    gap = search.get("discretisation_gap")
    return {"trial": trial_id, "val_ppl": exported, "supernet_val_ppl": supernet,
            "discretisation_gap": gap if gap is not None or None in (exported, supernet) else exported - supernet,
            "architecture": architecture.layout_string(architecture.layout(record)),
            "blocks": record["architecture"], "probabilities": record["probabilities"], "margins": margins,
            "undecided": [b for b, m in margins.items() if 0 <= m < UNDECIDED_MARGIN],
            "overruled": [b for b, m in margins.items() if m < 0],
            "retrained_val_ppl": retrained, "guard": guard.get("architecture"), "guard_val_ppl": guard_ppl,
            "guard_won": selection.get("verdict") == "guard" if selection else None,
            "latency": latency, "latency_ratio": (latency or {}).get("ratio"),
            "architecture_cost": search.get("architecture_cost"), "cost_unit": search.get("cost_unit"),
            "parameters": {k: search.get(k) for k in PARAMETERS}, "path": str(path)}


def exported_margin(probabilities: dict[str, float], exported: str) -> float:
    """The exported kind's probability less the best other kind's (negative where the supernet preferred another);
    the block's margin (:func:`parnas.report.experiments.margin`) when the record does not price the exported kind."""
    if exported not in probabilities:
        return margin(probabilities.values())
    others = [float(p) for k, p in probabilities.items() if k != exported]
    return float(probabilities[exported]) - max(others) if others else 1.0


def export_experiment(experiment_id: str, out: str | Path | None = None,
                      root: str | Path | None = None) -> list[dict[str, Any]]:
    """One row per finished trial (one with an architecture.json), best val ppl of the exported architecture first;
    with ``out`` and at least one row, each trial's file copied to ``<out>/<trial id>.json`` and the rows written to
    ``<out>/summary.json``."""
    rows = [trial_row(t.id, t.run_dir / "architecture.json")
            for t in experiment_trials(experiment_id, root).values() if t.status == FINISHED]
    rows.sort(key=lambda r: (r["val_ppl"] is None, r["val_ppl"] or 0.0, r["supernet_val_ppl"] or 0.0))
    if out is not None and rows:
        folder = ensure_writable_dir(out)
        try:
            for row in rows:
                copy_atomic(row["path"], folder / f"{row['trial']}.json")
            write_json_atomic(folder / "summary.json", rows)
        except OSError as e:
            raise ParnasError(f"cannot write into --out {folder}: {e.strerror or e}") from None
    return rows


def warnings(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per trial with undecided or overruled blocks."""
    lines = []
    for r in rows:
        if r["undecided"]:
            blocks = ", ".join(f"{b} (margin {r['margins'][b]:.2f})" for b in r["undecided"])
            lines.append(f"trial {r['trial']}: undecided {blocks}: top \u2212 second probability < "
                         f"{UNDECIDED_MARGIN:g}, the exported choice there is close to a tie")
        if r.get("overruled"):
            blocks = ", ".join(f"{b} (margin {r['margins'][b]:.2f})" for b in r["overruled"])
            lines.append(f"trial {r['trial']}: overruled {blocks}: the supernet preferred another kind there; the "
                         "budget or the final pick chose the exported one")
    return lines


def nothing_finished(experiment_id: str, root: str | Path | None = None) -> str:
    """The message for an experiment without a finished trial, with how many are running or stopped."""
    trials = experiment_trials(experiment_id, root)
    running = sum(t.status == RUNNING for t in trials.values())
    stopped = sum(t.status == STOPPED for t in trials.values())
    return (f"no trial of experiment {experiment_id} has finished yet (none has an architecture.json): "
            f"{running} running, {stopped} stopped; `parnas plot --experiment {experiment_id}` draws their "
            "histories so far")


def _number(value: Any, spec: str = ".2f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The default output: one line per trial, then what the columns mean."""
    head = ("trial", "val ppl", "supernet", "retrained", "guard", "architecture", "latency ratio | cost",
            "block margins", "undecided")
    lines = [head]
    for r in rows:
        cost = (_number(r["latency_ratio"]) if r["latency_ratio"] is not None else
                f"{r['architecture_cost']:.4g} {r['cost_unit'] or ''}".rstrip()
                if isinstance(r["architecture_cost"], (int, float)) else "-")
        guard = (f"{r['guard']} {_number(r['guard_val_ppl'])}" + (" (won)" if r["guard_won"] else "")
                 if r.get("guard") else "-")
        lines.append((r["trial"], _number(r["val_ppl"]), _number(r["supernet_val_ppl"]),
                      _number(r.get("retrained_val_ppl")), guard, r["architecture"], cost,
                      " ".join(f"{m:.2f}" for m in r["margins"].values()), ", ".join(r["undecided"]) or "-"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    right = {1, 2, 3, 6}
    text = ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip()
            for line in lines]
    targets = sorted({TARGET_LABELS.get((r["latency"] or {}).get("target"), "train step") for r in rows
                      if r["latency_ratio"] is not None}) or ["train step"]
    return "\n".join(text + [
        "",
        "val ppl: validation perplexity of the exported architecture (supernet weights, not retrained); "
        "supernet: the supernet's (candidates mixed by softmax(alpha)); retrained: the exported architecture's after "
        "the final pick's retrain from scratch (its last round, averaged with its confirming seeds where they ran); "
        "guard: the Transformer-XL it was checked against, retrained alike",
        f"architecture: {LETTER_CODE}",
        f"latency ratio: predicted {' or '.join(targets)} of the exported architecture / the standard "
        "Transformer-XL's at the "
        "same n_blocks (search.latency.ratio); where none is recorded, the architecture's cost and its unit",
        "block margins: the exported kind's probability less the best other kind's, each block, input first "
        f"(below 0: the supernet preferred another kind); undecided: from 0 to {UNDECIDED_MARGIN:g}",
    ])
