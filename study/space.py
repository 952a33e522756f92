"""Every network a search space holds, retrained: the most any search of that space could find.

The front says whether a found model beats making Transformer-XL shallower. It cannot say whether the search
found the best its space offers, nor whether the space holds anything far enough below the front at all: a
search that misses a goal may be failing, or the goal may lie outside its space. ``parnas study
--every-network`` settles it by brute force where the space is small: every distinct network of the space is
retrained like the other layouts (layouts that differ only in where their identity blocks stand are one
network, :func:`parnas.nn.model.blocks_run`, and are trained once), priced like them, and read off each
search's supernet for the ranking's Kendall tau. The study then says, per group of searches, where the found
models rank among the networks no costlier than they are, and once, which network lies furthest below the
Transformer-XL front.

The space grows as k^n (k kinds that run, n blocks), so this is for small spaces: more than
:data:`MAX_NETWORKS` are refused before anything runs. The best of many retrained perplexities is biased
low by seed noise (the minimum of noisy values), so its margin is judged against its own seed spread: use
``--retrain-seeds`` 2 or more.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from parnas.errors import ConfigError
from parnas.nn.model import NOT_RUN

MAX_NETWORKS = 1000
Row = Mapping[str, Any]


def count_networks(candidates: Sequence[str], n_blocks: int, reversible: bool = False) -> int:
    """How many distinct networks ``n_blocks`` blocks over ``candidates`` make: with an identity candidate (not
    under reversible pairs), every sequence of up to ``n_blocks`` running kinds, the empty one included."""
    if reversible or NOT_RUN not in candidates:
        return len(candidates) ** n_blocks
    running = len(candidates) - 1
    return sum(running ** depth for depth in range(n_blocks + 1))


def space_networks(candidates: Sequence[str], n_blocks: int, reversible: bool = False) -> list[tuple[str, ...]]:
    """Each distinct network once, shallowest first, as the kinds it runs (a shallower network has fewer blocks,
    as the front's do); the network that runs no block is the all-identity layout. Raises ConfigError past
    :data:`MAX_NETWORKS`, before enumerating."""
    count = count_networks(candidates, n_blocks, reversible)
    if count > MAX_NETWORKS:
        raise ConfigError(f"--every-network: {n_blocks} blocks over {', '.join(candidates)} make {count:,} "
                          f"networks; at most {MAX_NETWORKS} are retrained (fewer blocks or candidates)")
    if reversible or NOT_RUN not in candidates:
        return list(itertools.product(candidates, repeat=n_blocks))
    running = [k for k in candidates if k != NOT_RUN]
    return [(NOT_RUN,) * n_blocks] + [kinds for depth in range(1, n_blocks + 1)
                                      for kinds in itertools.product(running, repeat=depth)]


def _points(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r["role"] == "space" and r["val_ppl"] is not None]


def _judged(gap: float, spread: float | None) -> str:
    if spread is None:
        return "one retrain each: no seed spread to judge by"
    return f"{'within' if abs(gap) <= spread else 'beyond'} the seed spread ±{spread:.2f}"


def found_in_space_verdict(name: str, found: Sequence[Row], rows: Sequence[Row]) -> str | None:
    """Where ``name``'s found models (their mean perplexity at their mean cost) rank among the space's networks no
    costlier, and how far the best of those is from them. None when the study did not retrain the space."""
    from study.front import combined_spread, found_point

    space, point = _points(rows), found_point(found)
    if not space or point is None:
        return None
    ppl, ratio, found_std = point
    cheaper = [r for r in space if r["latency_ratio"] <= ratio + 1e-9]
    head = f"{name}: against every network of the space ({len(space)} retrained)"
    if not cheaper:
        return f"{head}: none is as cheap as the found models ({ratio:.2f}x)"
    best = min(cheaper, key=lambda r: r["val_ppl"])
    rank = 1 + sum(r["val_ppl"] < ppl for r in cheaper)
    spread = combined_spread(found_std, best.get("val_ppl_std"))
    gap = ppl - best["val_ppl"]
    return (f"{head}: the found models (val ppl {ppl:.2f} at {ratio:.2f}x) rank {rank} of the {len(cheaper)} "
            f"networks no costlier; the best of those is {best['layout']} at {best['latency_ratio']:.2f}x, val ppl "
            f"{best['val_ppl']:.2f} ({(ppl / best['val_ppl'] - 1) * 100:+.1f}% for the found, "
            f"{_judged(gap, spread)})")


def space_front_verdict(rows: Sequence[Row]) -> str | None:
    """The network of the space furthest below the Transformer-XL front at its own cost, and how many lie below it
    beyond the seed spread: whether the space holds a model that beats the front by a given margin at all."""
    from study.front import at_cost, combined_spread, front_points

    space, points = _points(rows), front_points(rows)
    judged = []
    for r in space:
        front = at_cost(points, r["latency_ratio"])
        if front is not None:
            judged.append((r["val_ppl"] / front[0] - 1, r, front))
    if not judged:
        return None if not space else (f"every network of the space ({len(space)} retrained): none is as costly as "
                                       "the front's cheapest point; no verdict")
    gap, best, (front_ppl, front_std) = min(judged, key=lambda j: j[0])
    below = sum(r["val_ppl"] < f_ppl - (combined_spread(r.get("val_ppl_std"), f_std) or 0.0)
                for _, r, (f_ppl, f_std) in judged)
    spread = combined_spread(best.get("val_ppl_std"), front_std)
    margin = "beyond the seed spread" if spread is not None else "(one retrain each)"
    return (f"every network of the space ({len(space)} retrained, {len(judged)} within the front's costs): the "
            f"furthest below the Transformer-XL front is {best['layout']}, val ppl {best['val_ppl']:.2f} at "
            f"{best['latency_ratio']:.2f}x vs {front_ppl:.2f} on the front ({gap * 100:+.1f}%, "
            f"{_judged(best['val_ppl'] - front_ppl, spread)}); {below} of {len(judged)} lie below the front {margin} "
            "(the best of many noisy retrains is biased low)")


def space_claim_verdict(rows: Sequence[Row], reaches: Callable[[float, float], tuple[bool, bool]], tolerance: float,
                        faster: str) -> str | None:
    """The networks of the space that meet the study's claim: ``reaches(val ppl, cost ratio)`` -> (Transformer-XL's
    perplexity within ``tolerance``, the cost ``faster`` as the claim asks). The claim's ceiling in this space, and
    where no network meets it, the cheapest whose perplexity does."""
    space = _points(rows)
    txl = next((r for r in rows if r["role"] == "transformer-xl"), None)
    if not space or txl is None or txl["val_ppl"] is None:
        return None
    met = [(r, reaches(r["val_ppl"], r["latency_ratio"])) for r in space]
    hits = sorted((r for r, (same, fast) in met if same and fast), key=lambda r: r["latency_ratio"])
    head = (f"every network of the space: {len(hits)} of {len(space)} reach Transformer-XL's val ppl "
            f"({txl['val_ppl']:.2f}) within {tolerance:.0%} {faster}")
    if not hits:
        near = min((r for r, (same, _) in met if same), key=lambda r: r["latency_ratio"], default=None)
        return head + ("" if near is None else
                       f"; the cheapest within {tolerance:.0%} is {near['layout']} at {near['latency_ratio']:.2f}x")
    shown = ", ".join(f"{r['layout']} ({r['val_ppl']:.2f} at {r['latency_ratio']:.2f}x)" for r in hits[:5])
    return f"{head}: {shown}{', ...' if len(hits) > 5 else ''}"
