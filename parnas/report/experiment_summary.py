"""The block ``parnas launch --wait`` (``make search``) ends with: each trial's export and cost, what its final pick
retrained it to against the guard, its pictures, and the two retrains that compare the best find with Transformer-XL.
Plain records in, text out (no torch); trials numbered in start order, as the progress lines said them. When the best
export is Transformer-XL itself, the block says so and offers the cheapest layout a trial exported instead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from parnas.architecture import layout_string
from parnas.config import transformer_xl_layout
from parnas.report.experiments import FINISHED, Trial

RETRAIN_STEPS = 3000  # the first hour's retrain length (README): found network and Transformer-XL alike
PICTURES = ("architecture.png", "probabilities.png", "probabilities.gif")


def trial_outcome(number: int, trial: Trial) -> dict[str, Any] | None:
    """What the summary says of one finished trial (None: unreadable or not finished)."""
    if trial.status != FINISHED:
        return None
    try:
        record = json.loads((trial.run_dir / "architecture.json").read_text())
        kinds = [record["architecture"][f"block_{i}"] for i in range(len(record["architecture"]))]
        search = record.get("search") or {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    layout = layout_string(kinds)
    latency = search.get("latency") if isinstance(search.get("latency"), dict) else {}
    ratio = latency.get("ratio", search.get("cost_ratio"))
    selection = search.get("selection") if isinstance(search.get("selection"), dict) else None
    outcome = {"number": number, "trial": trial.id, "architecture": layout, "cost_ratio": ratio,
               "transformer_xl": layout == layout_string(transformer_xl_layout(len(kinds))),
               "supernet_weight_ppl": search.get("val_ppl"), "retrained_ppl": None, "steps": None,
               "guard": None, "guard_ppl": None, "guard_won": None, "pictures": trial.run_dir}
    if selection:
        entrants = {e.get("architecture"): e for e in selection.get("entrants") or [] if isinstance(e, dict)}
        winner, guard = entrants.get(selection.get("winner")), selection.get("guard") or {}
        outcome["steps"] = (selection.get("steps") or [None])[-1]
        outcome["guard"] = guard.get("name") or (f"the shallower Transformer-XL {guard['architecture']}"
                                                 if guard.get("architecture") else None)
        outcome["retrained_ppl"], outcome["guard_ppl"] = pick_ppls(selection)
        outcome["guard_won"] = selection.get("verdict") == "guard"
        outcome["picked_guard"] = bool(guard) and selection.get("winner") == guard.get("architecture")
        outcome["seeds"] = 1 + len((winner or {}).get("confirm_val_ppl") or [])
    return outcome


def pick_ppl(entrant: Mapping[str, Any]) -> float | None:
    """An entrant's perplexity as its final pick judged it: the last round's, averaged with its confirming seeds'
    where they ran (None where any is missing or not finite). Every place that shows a pick's retrained perplexity
    (this summary, ``parnas export``'s table, NNI's final metric) shows this one, so they never disagree."""
    values = [*(entrant.get("val_ppl") or [])[-1:], *(entrant.get("confirm_val_ppl") or [])]
    if not values or any(not isinstance(v, (int, float)) or not math.isfinite(v) for v in values):
        return None
    return sum(values) / len(values)


def pick_ppls(selection: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """The final pick's winner's and guard's perplexities (:func:`pick_ppl`), None where the record lacks one: the
    one reading of a pick that this summary, ``parnas export``'s table and NNI's final metric share."""
    entrants = {e.get("architecture"): e for e in selection.get("entrants") or [] if isinstance(e, dict)}
    winner, guard = selection.get("winner"), (selection.get("guard") or {}).get("architecture")
    return (pick_ppl(entrants[winner]) if winner in entrants else None,
            pick_ppl(entrants[guard]) if guard in entrants else None)


def _ppl(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _line(o: Mapping[str, Any]) -> str:
    cost = f"{o['cost_ratio']:.2f} x Transformer-XL's cost" if isinstance(o["cost_ratio"], (int, float)) else "cost n/a"
    head = f"trial {o['number']} ({o['trial']}): exported {o['architecture']}"
    head += " (Transformer-XL itself)" if o["transformer_xl"] else ""
    if o["steps"] is None:
        return (f"{head}, {cost}; no final pick ran (val ppl {_ppl(o['supernet_weight_ppl'])} with the supernet's "
                "weights)")
    seeds = f", mean of {o['seeds']} seeds" if o.get("seeds", 1) > 1 else ""
    if o["guard"] is None:
        return f"{head}, {cost}; retrained {_ppl(o['retrained_ppl'])} after {o['steps']} steps; no guard within budget"
    if o.get("picked_guard") and not o["guard_won"]:
        return (f"{head}, {cost}; the supernet picked {o['guard']} too: retrained {_ppl(o['retrained_ppl'])} after "
                f"{o['steps']} steps")
    verdict = "the guard won" if o["guard_won"] else "the guard did not win"
    if o["guard_won"]:
        return f"{head}, {cost}; {verdict}: {o['guard']} retrained {_ppl(o['retrained_ppl'])} after {o['steps']} steps"
    return (f"{head}, {cost}; retrained {_ppl(o['retrained_ppl'])} against {o['guard']}'s {_ppl(o['guard_ppl'])} "
            f"after {o['steps']} steps{seeds}: {verdict}")


def best_outcome(outcomes: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The trial the README's retrains take: the best retrained of the exports a pick confirmed over their guard, else
    of all (supernet-weight perplexity where no pick ran). Earliest wins ties."""
    def key(o: Mapping[str, Any]) -> tuple[float, float, int]:
        retrained, inherited = o["retrained_ppl"], o["supernet_weight_ppl"]
        return (retrained if retrained is not None else math.inf,
                inherited if isinstance(inherited, (int, float)) else math.inf, o["number"])

    return min([o for o in outcomes if confirmed(o)] or outcomes, key=key)


def confirmed(outcome: Mapping[str, Any]) -> bool:
    """Whether the trial's final pick kept a found layout over the shallower Transformer-XL it was checked against."""
    return outcome["guard"] is not None and outcome["guard_won"] is False and not outcome.get("picked_guard")


def retrain_line(config: str | None, arch: str, out: str) -> str:
    flag = f" --config {config}" if config else ""
    return f"parnas retrain --arch {arch}{flag} --set train.max_steps={RETRAIN_STEPS} --out {out}"


def summary_block(experiment: str, trials: Mapping[str, Trial], preset: str | None) -> str | None:
    """The block, or None when no trial finished."""
    outcomes = [o for o in (trial_outcome(n, t) for n, t in enumerate(trials.values(), start=1)) if o is not None]
    if not outcomes:
        return None
    lines = [f"summary of experiment {experiment} ({len(outcomes)} of {len(trials)} trials finished; perplexities "
             "on the validation split, retrained from scratch in each trial's final pick):"]
    for o in outcomes:
        lines.append("  " + _line(o))
        lines.append(f"    pictures: {o['pictures']}/{{{','.join(PICTURES)}}}")
    folders = {o["pictures"].parent for o in outcomes}
    if len(folders) == 1:
        lines.append(f"  TensorBoard: tensorboard --logdir {folders.pop()}   (a run per trial, <trial>/tensorboard; "
                     "its final pick's retrains beside it, <trial>/select/<layout>/tensorboard)")
    best = best_outcome(outcomes)
    if best["transformer_xl"]:
        cheaper = [o for o in outcomes if not o["transformer_xl"] and isinstance(o["cost_ratio"], (int, float))]
        found = min(cheaper, key=lambda o: (o["cost_ratio"], o["number"])) if cheaper else None
        lines.append(f"best: trial {best['number']} exported Transformer-XL itself: retraining it beside "
                     "Transformer-XL would compare a network with itself"
                     + (f"; the cheapest layout a trial exported instead: trial {found['number']}'s "
                        f"{found['architecture']} ({found['cost_ratio']:.2f} x)" if found else
                        "; no trial exported a cheaper layout (give search.par-gumbel-darts.latency_budget a lower "
                        "value)"))
    else:
        found = best
        why = ("the best of the layouts a pick confirmed over their guard" if confirmed(best) else
               "no pick confirmed a found layout over its guard" if best["steps"] is not None else "no pick ran")
        lines.append(f"best: trial {best['number']}'s {best['architecture']} "
                     f"({best['cost_ratio']:.2f} x Transformer-XL's cost), retrained {_ppl(best['retrained_ppl'])}: "
                     f"{why}")
    lines.append("next: retrain it and Transformer-XL as the README does, then compare them:")
    lines.append(f"  parnas export --experiment {experiment} --out found/")
    if found is not None:
        lines.append("  " + retrain_line(preset, f"found/{found['trial']}.json", "runs/found"))
    lines.append("  " + retrain_line(preset, "transformer-xl", "runs/txl"))
    lines.append(f"  nnictl stop {experiment}   (the web UI stays up until then)")
    return "\n".join(lines)

