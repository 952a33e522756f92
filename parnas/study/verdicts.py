"""What ``parnas study`` concludes, computed from its rows (:func:`parnas.study.report.build_rows`): a summary per
group (a budget, or with ``--candidates`` a candidate set and budget) and a verdict per question in plain words:
Transformer-XL's perplexity reached within ``PPL_TOLERANCE`` at a latency ``SPEEDUP`` shorter, the found order
against its random and sandwich orderings, and whether each seed puts its attention early.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from parnas import kinds
from parnas.config import TARGET_LABELS
from parnas.retrain.compare import cell
from parnas.study.table import mean_of, seed_spread

PPL_TOLERANCE = 0.01  # "the same perplexity": within 1% of Transformer-XL's
# "faster", per latency target: a train step or inference segment at least 30% shorter than Transformer-XL's;
# a generated token at least a third shorter (1.5x lower latency, what generation-targeted searches aim for)
SPEEDUP = {"train": 0.30, "inference": 0.30, "generate": 1 / 3}


def _ppl(value: float | None) -> str:
    """A perplexity as the verdicts write it."""
    return cell(value, "{:.2f}")


Group = tuple[Any, str]  # (candidate set letters or None, budget label)


def groups(rows: Sequence[Mapping[str, Any]]) -> list[Group]:
    """The (candidates, budget) pairs searched, in the order of the rows."""
    return list(dict.fromkeys((r.get("candidates"), r["budget"]) for r in rows if r["role"] == "found"))


def group_name(s: Mapping[str, Any]) -> str:
    """``budget 0.65``, or ``candidates ACDGI, budget none`` in a study of several candidate sets."""
    return ("" if s.get("candidates") is None else f"candidates {s['candidates']}, ") + f"budget {s['budget']}"


def _of(rows: Sequence[Mapping[str, Any]], role: str, group: Group, seed: int | None = None) -> list[Mapping]:
    return [r for r in rows if r["role"] == role and (r.get("candidates"), r["budget"]) == group
            and (seed is None or r["seed"] == seed)]


def summarise(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per group: the found architectures' mean and std over seeds; random, sandwich and Transformer-XL means."""
    txl = next(r for r in rows if r["role"] == "transformer-xl")
    out = []
    for key in groups(rows):
        found = _of(rows, "found", key)
        row: dict[str, Any] = {"candidates": key[0], "budget": key[1], "seeds": len(found)}
        for role in ("found", "random", "sandwich"):
            group = _of(rows, role, key)
            row[f"{role}_val_ppl"] = mean_of([r["val_ppl"] for r in group])
            row[f"{role}_ratio"] = mean_of([r["latency_ratio"] for r in group])
        row["found_val_ppl_std"] = seed_spread([r["val_ppl"] for r in found])
        row["found_ratio_std"] = seed_spread([r["latency_ratio"] for r in found])
        out.append({**row, "transformer_xl_val_ppl": txl["val_ppl"],
                    "transformer_xl_train_step_ms": txl["train_step_ms"]})
    return out


def attention_early(layout: str) -> bool | None:
    """Do the attention blocks (every kind that attends) sit earlier (lower mean depth) than the blocks of every
    other kind? None: not both."""
    letters = {kinds.letter(name) for name in kinds.names() if kinds.loaded(name) and kinds.get(name).attends}
    att = [i for i, c in enumerate(layout) if c in letters]
    rest = [i for i, c in enumerate(layout) if c not in letters]
    return statistics.fmean(att) < statistics.fmean(rest) if att and rest else None


def _reaches(ppl: float | None, ratio: float, txl_ppl: float | None, speedup: float) -> tuple[bool, bool]:
    same = ppl is not None and txl_ppl is not None and ppl <= txl_ppl * (1 + PPL_TOLERANCE)
    return same, ratio <= 1 - speedup + 1e-9


def claim_verdict(s: Mapping[str, Any], found: Sequence[Mapping[str, Any]]) -> str:
    """Transformer-XL's validation perplexity within 1% at a latency ``SPEEDUP`` shorter (30% for a train step,
    a third for a generated token): per seed, and on the mean."""
    txl, what, speedup = s["transformer_xl_val_ppl"], target_label(found), SPEEDUP[target(found)]
    hits = sum(all(_reaches(r["val_ppl"], r["latency_ratio"], txl, speedup)) for r in found)
    same, fast = _reaches(s["found_val_ppl"], s["found_ratio"], txl, speedup)
    gap = (s["found_val_ppl"] / txl - 1) * 100 if s["found_val_ppl"] and txl else math.nan
    why = "yes" if same and fast else "no: " + " and ".join(
        w for w, bad in ((f"perplexity not within {PPL_TOLERANCE:.0%}", not same),
                         (f"{what} not {speedup:.0%} shorter", not fast)) if bad)
    return (f"{group_name(s)}: {hits} of {s['seeds']} seeds reach Transformer-XL's validation perplexity "
            f"({_ppl(txl)}) within {PPL_TOLERANCE:.0%} at a {costs_label(found)} {what} >= {speedup:.0%} shorter "
            f"({1 / (1 - speedup):.2g}x faster). Mean over seeds: val ppl {_ppl(s['found_val_ppl'])} ({gap:+.1f}% vs "
            f"Transformer-XL) at {s['found_ratio']:.2f}x its {what} time -> {why}.")


def costs_label(rows: Sequence[Mapping[str, Any]]) -> str:
    """Where the ratios' times come from: ``measured`` here, or ``predicted for <device>`` by a latency table."""
    return next((r["costs"] for r in rows if r.get("costs")), "measured")


def target(rows: Sequence[Mapping[str, Any]]) -> str:
    """The study's latency target: what the ratios measure (``train`` unless ``search.latency_target`` says)."""
    return next((r.get("latency_target") for r in rows if r.get("latency_target")), "train")


def target_label(rows: Sequence[Mapping[str, Any]]) -> str:
    return TARGET_LABELS[target(rows)]


def _beats(rows: Sequence[Mapping[str, Any]], found: Mapping[str, Any], role: str) -> bool | None:
    """Is the found layout's val ppl below the mean of its ``role`` orderings that are other networks (the same
    blocks with only identities moved train alike)? None: nothing else to compare."""
    mine = found.get("network", found["layout"])
    others = [x for x in _of(rows, role, (found.get("candidates"), found["budget"]), found["seed"])
              if x.get("network", x["layout"]) != mine]
    ppl = [x["val_ppl"] for x in others]
    if not others or None in (found["val_ppl"], *ppl):
        return None
    return found["val_ppl"] < statistics.fmean(ppl)


def orderings_verdict(rows: Sequence[Mapping[str, Any]], s: Mapping[str, Any],
                      found: Sequence[Mapping[str, Any]]) -> str:
    """Is the found order better than the same blocks in random order, and than the sandwich order?"""
    beats, missing = [], []
    for role, what in (("random", "the mean of its random orderings"), ("sandwich", "its sandwich ordering")):
        if not any(_of(rows, role, (r.get("candidates"), r["budget"]), r["seed"]) for r in found):
            missing.append(role)
            continue
        results = [b for b in (_beats(rows, r, role) for r in found) if b is not None]
        if not results:
            beats.append(f"runs the network of {what} in every seed (identity blocks moved: not compared)")
            continue
        beats.append(f"beats {what} in {sum(results)} of {len(results)} seeds")
        if len(results) < len(found):
            beats[-1] += f" (a seed whose {role} ordering runs the found network itself is not counted)"
    parts = "the found architecture " + " and ".join(beats) if beats else "no other ordering was trained"
    if beats and missing:
        parts += f" ({' and '.join(missing)} orderings: none trained)"
    return (f"{group_name(s)}: {parts}; mean val ppl: "
            f"found {_ppl(s['found_val_ppl'])}, random {_ppl(s['random_val_ppl'])}, "
            f"sandwich {_ppl(s['sandwich_val_ppl'])}.")


def depth_verdict(s: Mapping[str, Any], found: Sequence[Mapping[str, Any]]) -> str:
    """Do the seeds agree on PAR's pattern, attention early and dense/identity late?"""
    layouts = [r["layout"] for r in found]
    early = [attention_early(lay) for lay in layouts]
    unanimous = sum(len({lay[i] for lay in layouts}) == 1 for i in range(len(layouts[0])))
    agreement = (f"all seeds choose the same kind at {unanimous} of {len(layouts[0])} depths" if len(layouts) > 1
                 else "one seed: agreement across seeds not measured")
    both = [e for e in early if e is not None]
    if not both:
        answer = "cannot say: no seed found both attention and other blocks"
    else:
        pattern = len(both) == len(early) and all(both)
        answer = ("yes" if pattern else "no") if len(early) == 1 else \
            "the seeds agree" if pattern else "the seeds do not agree"
    return (f"{group_name(s)}: attention early, the other kinds late in {sum(both)} of {len(early)} seeds "
            f"({', '.join(layouts)}) -> {answer}; {agreement}.")


def verdicts(rows: Sequence[Mapping[str, Any]], summary: Sequence[Mapping[str, Any]],
             ranking: Mapping[str, Mapping[str, Any]] | None = None, space: str | None = None) -> list[str]:
    """Plain-language answers per group: the claim, the orderings, the depths, the found model against the front and
    against the space's networks retrained (``space``: :func:`parnas.study.space.space_name`); then the space's
    best against the front, and each search's ranking fidelity."""
    from parnas.study.front import front_verdict
    from parnas.study.ranking import ranking_verdict
    from parnas.study.space import EVERY, found_in_space_verdict, space_claim_verdict, space_front_verdict

    space = space or EVERY
    lines = []
    for s in summary:
        found = _of(rows, "found", (s["candidates"], s["budget"]))
        lines += [claim_verdict(s, found), orderings_verdict(rows, s, found), depth_verdict(s, found),
                  front_verdict(group_name(s), found, rows), found_in_space_verdict(group_name(s), found, rows, space)]
    txl, speedup = next(r["val_ppl"] for r in rows if r["role"] == "transformer-xl"), SPEEDUP[target(rows)]
    lines += [space_front_verdict(rows, space), space_claim_verdict(
        rows, lambda ppl, ratio: _reaches(ppl, ratio, txl, speedup), PPL_TOLERANCE,
        f"at a {costs_label(rows)} {target_label(rows)} >= {speedup:.0%} shorter", space)]
    return [line for line in lines if line] + [ranking_verdict(name, r) for name, r in (ranking or {}).items()]
