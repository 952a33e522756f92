"""Gather the architectures an nnictl experiment's trials found, best first."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from parnas import architecture
from parnas.experiments import trial_run_dirs
from parnas.files import write_json_atomic


def export_experiment(experiment_id: str, out: str | Path | None = None,
                      root: str | Path | None = None) -> list[dict[str, Any]]:
    """One row per trial with an architecture.json, sorted by validation perplexity.

    With ``out``, each trial's file is copied to ``<out>/<trial id>.json`` and the
    rows are written to ``<out>/summary.json``.
    """
    rows = []
    for trial_id, run_dir in trial_run_dirs(experiment_id, root).items():
        record = architecture.read(run_dir / "architecture.json")
        search = record["search"]
        rows.append({"trial": trial_id, "val_ppl": search.get("val_ppl"),
                     "architecture": architecture.layout_string(architecture.layout(record)),
                     "blocks": record["architecture"], "probabilities": record["probabilities"],
                     "parameters": {k: search.get(k) for k in ("seed", "penalty_weight", "arch_lr", "mode", "hard")}
                     | {"tau_final": search.get("tau_final")},
                     "architecture_cost": search.get("architecture_cost"), "cost_unit": search.get("cost_unit"),
                     "path": str(run_dir / "architecture.json")})
    rows.sort(key=lambda r: (r["val_ppl"] is None, r["val_ppl"]))
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        for row in rows:
            shutil.copyfile(row["path"], folder / f"{row['trial']}.json")
        write_json_atomic(folder / "summary.json", rows)
    return rows
