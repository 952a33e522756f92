"""Ranking fidelity: does the supernet rank layouts as retraining does?

A one-shot search is worth its cost only if the supernet's inherited-weight perplexity of a layout orders layouts as
their retrained perplexities do. The study measures Kendall's tau over the layouts it retrained at the search's depth
(the front's shallower ones padded with identity blocks at the top, the same network); a tau below ``MIN_TAU`` is
flagged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from parnas.architecture import layout_string
from parnas.config import Config

MIN_TAU = 0.5


def kendall_tau(inherited: Mapping[str, float], retrained: Mapping[str, float]) -> float | None:
    """Kendall's tau-b between the two perplexities over the layouts both have; None with fewer than 3."""
    from scipy.stats import kendalltau

    common = [k for k in inherited if retrained.get(k) is not None]
    if len(common) < 3:
        return None
    tau = kendalltau([inherited[k] for k in common], [retrained[k] for k in common]).statistic
    return None if tau != tau else float(tau)  # NaN when one side is constant


def padded(kinds: Sequence[str], n_blocks: int) -> tuple[str, ...]:
    """A shallower layout at the supernet's depth: identity blocks above it."""
    return tuple(kinds) + ("identity",) * (n_blocks - len(kinds))


def ranking_verdict(name: str, result: Mapping[str, Any]) -> str:
    tau, n = result.get("tau"), len(result.get("inherited", {}))
    if tau is None:
        return f"{name}: ranking fidelity: too few layouts ({n}) or a constant perplexity; no Kendall tau"
    # tau is a ratio of pair counts (14/28 comes back as 0.4999999999999999): compared at the precision shown
    flag = "" if round(tau, 6) >= MIN_TAU else f" -- below {MIN_TAU}: the supernet's ranking of layouts is not " \
        "trustworthy"
    return f"{name}: ranking fidelity: Kendall tau {tau:.2f} between inherited and retrained val ppl over {n} " \
           f"layouts{flag}"


def measure_ranking(searches: Sequence[tuple[str, Path, Config, Sequence[Any]]],
                    metrics: Mapping[str, Mapping[str, Any]], progress: Any) -> dict[str, dict[str, Any]]:
    """Per search (name, run directory, config, its study entries): each retrained layout's inherited-weight val
    ppl from that search's supernet, and Kendall's tau against the retrained val ppl. Layouts with a kind that is
    not among the search's candidates cannot be read off its supernet and are left out."""
    from parnas.strategies.search import inherited_perplexities

    out = {}
    for i, (name, run_dir, cfg, entries) in enumerate(searches, 1):
        n_blocks, allowed = cfg.model.n_blocks, set(cfg.search.candidates)
        layouts = {e.layout: padded(e.kinds, n_blocks) for e in entries if set(e.kinds) <= allowed}
        progress("ranking", i, len(searches), f"{name}: inherited-weight val ppl of {len(layouts)} layouts ...")
        by_padded = inherited_perplexities(run_dir, cfg, list(layouts.values()))
        inherited = {code: by_padded[layout_string(kinds)] for code, kinds in layouts.items()}
        retrained = {code: metrics[code]["val_ppl"] for code in layouts}
        out[name] = {"inherited": inherited, "retrained": retrained, "tau": kendall_tau(inherited, retrained)}
    return out
