"""A search run as an nnictl trial: whether it is one, the tuner's parameters, and what it reports to NNI."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parnas.kinds import attending  # imports no torch
from parnas.report.experiment_summary import pick_ppls

if TYPE_CHECKING:  # a trial's parameters are read before torch loads
    from parnas.strategies.supernet_export import Evaluated


def in_nni_trial() -> bool:
    return "NNI_PLATFORM" in os.environ and bool(os.environ.get("NNI_OUTPUT_DIR"))


def experiment_folder() -> Path | None:
    """The nnictl experiment's own folder (``<root>/<experiment id>``, above the trial's output folder), where what its
    trials share is kept; None outside a trial or where the trial's folder is not under it."""
    if not in_nni_trial():
        return None
    experiment = os.environ.get("NNI_EXP_ID")
    return next((p for p in Path(os.environ["NNI_OUTPUT_DIR"]).resolve().parents if p.name == experiment), None)


def trial_parameters() -> dict[str, Any]:
    """The tuner's parameters for this trial (dotted keys such as ``search.tau_end``), or {}."""
    if not in_nni_trial():
        return {}
    import nni

    return dict(nni.get_next_parameter() or {})


def nni_metric(result: Evaluated, latency: dict[str, Any] | None,
               selection: dict[str, Any] | None = None) -> dict[str, Any]:
    """What NNI's web UI shows for a trial, at every evaluation (so its columns fill from the first) and at the end:
    ``default`` is the exported architecture's own perplexity with the supernet's weights; the final result adds the
    final pick's retrained perplexities (``retrained_val_ppl``, ``guard_val_ppl``: :func:`pick_ppls`), named apart.
    The web UI lists the keys in this order and shows the numbers as they are: rounded as in architecture.json."""
    ratio = latency["ratio"] if latency else result.cost_ratio
    picked = {}
    if selection:
        retrained, guard_ppl = pick_ppls(selection)
        picked = {"retrained_val_ppl": retrained, "guard": (selection.get("guard") or {}).get("architecture"),
                  "guard_val_ppl": guard_ppl, "guard_won": selection["verdict"] == "guard"}
    return {"default": round(result.val_ppl, 4), "architecture": result.architecture,
            "latency_ratio": None if ratio is None else round(ratio, 4), **picked,
            "supernet_val_ppl": round(result.supernet_val_ppl, 4), "attention_blocks": attending(result.kinds),
            "predicted_step_ms": latency["target_ms"] if latency else None,
            "latency_target": latency["target"] if latency else None,
            "latency_device": latency["device"] if latency else None}


def report_to_nni(metric: dict[str, Any], final: bool = False) -> None:
    """Send an evaluation (or the final result) to NNI's manager. A manager that has gone (``nnictl stop`` ends it
    while the trial reaches an evaluation, and its SIGINT follows) makes NNI's client raise a connection error from
    deep inside ``requests``: that is a stop, not a failure of the search, so it costs one line and the run goes on
    to the signal's checkpoint (or to its end, when the manager died by itself)."""
    import sys

    import nni

    try:
        (nni.report_final_result if final else nni.report_intermediate_result)(metric)
    except OSError as e:  # requests' ConnectionError is an OSError
        print(f"parnas search: NNI's manager did not take the {'final result' if final else 'evaluation'} "
              f"({type(e).__name__}): the experiment was stopped or its manager has gone", file=sys.stderr, flush=True)
