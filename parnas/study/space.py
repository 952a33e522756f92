"""Every network a search space holds, retrained: the most any search of that space could find.

The front cannot say whether the search found the best its space offers, nor whether the space holds anything far
enough below the front at all: a search that misses a goal may be failing, or the goal may lie outside its space.
``parnas study --space all`` settles it by brute force where the space is small: every distinct network of the space
(:func:`parnas.nn.model.blocks_run`) is retrained, priced and read off each supernet like the other layouts, and the
verdicts say where the found models rank among the networks no costlier, and which lies furthest below the front.

The space grows as k^n (k kinds that run, n blocks): more than :data:`MAX_NETWORKS` are refused before anything
runs. A larger space is judged by a census, ``--space N`` (:func:`census_networks`): N distinct networks drawn at
random, stratified by predicted cost so that the sample spans the cheap and the costly ends alike, which the
verdicts then name as a sample. The best of many retrained perplexities is biased low by seed noise, so its margin
is judged against its own seed spread: use ``--seeds S,K`` with K 2 or more.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from parnas.config import Config
from parnas.errors import ConfigError
from parnas.nn.model import SKIPPED_KIND, blocks_run

MAX_NETWORKS = 1000
MAX_COUNTS = 1_000_000  # a census prices each way to count the kinds of a network; at most this many
EVERY = "every network of the space"  # how the verdicts name the networks retrained, without a census
Row = Mapping[str, Any]


class SpacePlan(Protocol):
    """What the space reads of a study's plan (:class:`parnas.study.plan.Plan`, which imports this module)."""

    base: Config
    candidate_sets: tuple[tuple[str, ...], ...]
    every_network: bool
    census: int


def _orders(candidates: Sequence[str], n_blocks: int, reversible: bool) -> tuple[list[str], range]:
    """The kinds whose order makes a network, and the depths a network may have: with an identity candidate (not
    under reversible pairs), sequences of up to ``n_blocks`` running kinds, the empty one included."""
    if reversible or SKIPPED_KIND not in candidates:
        return list(candidates), range(n_blocks, n_blocks + 1)
    return [k for k in candidates if k != SKIPPED_KIND], range(n_blocks + 1)


def count_networks(candidates: Sequence[str], n_blocks: int, reversible: bool = False) -> int:
    """How many distinct networks ``n_blocks`` blocks over ``candidates`` make."""
    kinds, depths = _orders(candidates, n_blocks, reversible)
    return sum(len(kinds) ** depth for depth in depths)


def space_networks(candidates: Sequence[str], n_blocks: int, reversible: bool = False) -> list[tuple[str, ...]]:
    """Each distinct network once, shallowest first, as the kinds it runs (a shallower network has fewer blocks,
    as the front's do); the network that runs no block is the all-identity layout. Raises ConfigError past
    :data:`MAX_NETWORKS`, before enumerating."""
    count = count_networks(candidates, n_blocks, reversible)
    if count > MAX_NETWORKS:
        raise ConfigError(f"--space all: {n_blocks} blocks over {', '.join(candidates)} make {count:,} "
                          f"networks; at most {MAX_NETWORKS} are retrained (fewer blocks or candidates)")
    kinds, depths = _orders(candidates, n_blocks, reversible)
    return [net or (SKIPPED_KIND,) * n_blocks for depth in depths for net in itertools.product(kinds, repeat=depth)]


def check_space(plan: SpacePlan) -> None:
    """Refuses a space too large to retrain whole (``--space all``) or a census it cannot give."""
    if plan.census and len(plan.candidate_sets) > 1:
        raise ConfigError("--space N samples one search space: give at most one --candidates set")
    if plan.census:
        check_census(plan.census, _searched(plan)[0], plan.base.model.n_blocks, plan.base.model.reversible)
    else:
        space_layouts(plan)


def space_layouts(plan: SpacePlan, costs: Mapping[str, float] | None = None) -> list[tuple[str, ...]]:
    """With ``--space all``, each distinct network of the searched candidate sets once; with ``--space N``,
    N of them drawn with ``train.seed``, stratified by ``costs`` (the searches' block costs, needed then); else
    none."""
    model = plan.base.model
    if plan.census:
        if costs is None:
            raise ValueError("a census is stratified by the searches' block costs: give them")
        return census_networks(_searched(plan)[0], model.n_blocks, plan.census, costs, plan.base.train.seed,
                               model.reversible)
    if not plan.every_network:
        return []
    return list(dict.fromkeys(kinds for candidates in _searched(plan)
                              for kinds in space_networks(candidates, model.n_blocks, model.reversible)))


def census_record(plan: SpacePlan) -> dict[str, Any] | None:
    """What study.json says of the census: ``networks`` of the space's ``of``, drawn with ``seed``; None without one."""
    if not plan.census:
        return None
    model = plan.base.model
    return {"networks": plan.census, "of": count_networks(_searched(plan)[0], model.n_blocks, model.reversible),
            "seed": plan.base.train.seed, "stratified_by": "the searches' predicted block costs"}


def _searched(plan: SpacePlan) -> tuple[tuple[str, ...], ...]:
    """The candidate sets the study searches."""
    return plan.candidate_sets or (tuple(plan.base.search.candidates),)


def space_name(census: int, total: int) -> str:
    """How the verdicts name the networks of the space the study retrained: all of them, or a census of them."""
    return EVERY if not census else f"a sample of {census:,} of the space's {total:,} networks"


def check_census(census: int, candidates: Sequence[str], n_blocks: int, reversible: bool = False) -> None:
    """Raises ConfigError for a census the space cannot give: more networks than it holds, or more ways to count a
    network's kinds than :data:`MAX_COUNTS` (each is priced to stratify the sample)."""
    total = count_networks(candidates, n_blocks, reversible)
    if census > total:
        raise ConfigError(f"--space {census:,}: {n_blocks} blocks over {', '.join(candidates)} make only {total:,} "
                          f"networks; give at most {total:,}, or --space all")
    kinds, depths = _orders(candidates, n_blocks, reversible)
    counts = sum(math.comb(depth + len(kinds) - 1, depth) for depth in depths)
    if counts > MAX_COUNTS:
        raise ConfigError(f"--space {census:,}: {n_blocks} blocks over {', '.join(candidates)} are too many to "
                          f"stratify by cost ({counts:,} ways to count a network's kinds, at most {MAX_COUNTS:,}); "
                          "use fewer blocks or candidates")


def census_networks(candidates: Sequence[str], n_blocks: int, size: int, costs: Mapping[str, float], seed: int,
                    reversible: bool = False) -> list[tuple[str, ...]]:
    """``size`` distinct networks of the space drawn at random with ``seed``, stratified by predicted cost, listed as
    :func:`space_networks` lists them; the space is never enumerated.

    A network's cost is the sum of its blocks' ``costs``, so the space is priced one count of each kind at a time,
    each standing for its orderings. The cost range is cut into ``size`` equal strata; each that holds networks gets
    an equal share of the sample (never more than it holds, the rest to the others), drawn uniformly without
    replacement: the sample spans the cheap and costly ends, which a uniform draw, crowded into the middle, misses."""
    check_census(size, candidates, n_blocks, reversible)
    kinds, depths = _orders(candidates, n_blocks, reversible)
    price = {SKIPPED_KIND: 0.0, **costs}
    groups = [(counts, sum(c * price[k] for c, k in zip(counts, kinds))) for depth in depths
              for counts in _counts(len(kinds), depth)]
    low, high = min(cost for _, cost in groups), max(cost for _, cost in groups)
    strata: list[list[tuple[int, ...]]] = [[] for _ in range(size)]
    for counts, cost in groups:
        strata[0 if high == low else min(size - 1, int((cost - low) / (high - low) * size))].append(counts)
    rng = random.Random(seed)
    ends = [list(itertools.accumulate(_orderings(counts) for counts in stratum)) for stratum in strata]
    sizes = [end[-1] if end else 0 for end in ends]  # networks in each stratum
    drawn = []
    for stratum, end, held, share in zip(strata, ends, sizes, _shares(sizes, size, rng)):
        for index in _distinct(held, share, rng):
            g = bisect.bisect_right(end, index)  # the count whose orderings hold the index-th network
            network = _ordering(kinds, stratum[g], index - (end[g - 1] if g else 0))
            drawn.append(network if network else (SKIPPED_KIND,) * n_blocks)
    order = {k: i for i, k in enumerate(candidates)}
    return sorted(drawn, key=lambda net: (len(blocks_run(net, reversible)), [order[k] for k in net]))


def _counts(n_kinds: int, depth: int) -> Iterator[tuple[int, ...]]:
    """Every way to share ``depth`` blocks among ``n_kinds`` kinds."""
    if n_kinds == 1:
        yield (depth,)
        return
    for first in range(depth, -1, -1):
        for rest in _counts(n_kinds - 1, depth - first):
            yield (first, *rest)


def _orderings(counts: Sequence[int]) -> int:
    """The distinct orderings of blocks with these counts of each kind: the networks that count."""
    return math.factorial(sum(counts)) // math.prod(math.factorial(c) for c in counts)


def _ordering(kinds: Sequence[str], counts: Sequence[int], index: int) -> tuple[str, ...]:
    """The ``index``-th of the orderings of ``counts`` blocks of ``kinds``, in lexicographic order."""
    left, out = list(counts), []
    for _ in range(sum(counts)):
        for i, kind in enumerate(kinds):
            if not left[i]:
                continue
            left[i] -= 1
            after = _orderings(left)  # the orderings that put ``kind`` here
            if index < after:
                out.append(kind)
                break
            index -= after
            left[i] += 1
    return tuple(out)


def _shares(sizes: Sequence[int], total: int, rng: random.Random) -> list[int]:
    """``total`` draws shared equally among strata of these sizes, none getting more than it holds; where a round
    cannot give every open stratum one more, which do is drawn at random."""
    shares, left = [0] * len(sizes), total
    while left:
        open_ = [i for i, size in enumerate(sizes) if shares[i] < size]
        for i in open_ if len(open_) <= left else rng.sample(open_, left):
            shares[i] += 1
        left -= min(left, len(open_))
    return shares


def _distinct(n: int, k: int, rng: random.Random) -> list[int]:
    """``k`` distinct integers of ``range(n)``, uniformly (Floyd's algorithm: ``n`` may be far too large to list)."""
    chosen: set[int] = set()
    for j in range(n - k, n):
        t = rng.randrange(j + 1)
        chosen.add(j if t in chosen else t)
    return sorted(chosen)


def _points(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r["role"] == "space" and r["val_ppl"] is not None]


def _judged(gap: float, spread: float | None) -> str:
    if spread is None:
        return "one retrain each: no seed spread to judge by"
    return f"{'within' if abs(gap) <= spread else 'beyond'} the seed spread ±{spread:.2f}"


def found_in_space_verdict(name: str, found: Sequence[Row], rows: Sequence[Row], space: str = EVERY) -> str | None:
    """Where ``name``'s found models (mean perplexity at mean cost) stand among the space's networks no costlier, and
    how far the best of those is from them; ``space``: :func:`space_name`. None when the study retrained no space."""
    from parnas.study.front import combined_spread, found_point

    points, point = _points(rows), found_point(found)
    if not points or point is None:
        return None
    ppl, ratio, found_std = point
    cheaper = [r for r in points if r["latency_ratio"] <= ratio + 1e-9]
    head = f"{name}: against {space} ({len(points)} retrained)"
    if not cheaper:
        return f"{head}: none is as cheap as the found models ({ratio:.2f}x)"
    best = min(cheaper, key=lambda r: r["val_ppl"])
    better = sum(r["val_ppl"] < ppl for r in cheaper)  # a sample need not hold the found network itself
    spread = combined_spread(found_std, best.get("val_ppl_std"))
    gap = ppl - best["val_ppl"]
    return (f"{head}: the found models (val ppl {ppl:.2f} at {ratio:.2f}x): {better} of the {len(cheaper)} "
            "networks no costlier have a lower val ppl; "
            f"the best of those is {best['layout']} at {best['latency_ratio']:.2f}x, val ppl "
            f"{best['val_ppl']:.2f} ({(ppl / best['val_ppl'] - 1) * 100:+.1f}% for the found, "
            f"{_judged(gap, spread)})")


def space_front_verdict(rows: Sequence[Row], space: str = EVERY) -> str | None:
    """The network of the space furthest below the Transformer-XL front at its own cost, and how many lie below it
    beyond the seed spread: whether the space holds a model that beats the front by a given margin at all."""
    from parnas.study.front import at_cost, combined_spread, front_points

    networks, points = _points(rows), front_points(rows)
    judged = []
    for r in networks:
        front = at_cost(points, r["latency_ratio"])
        if front is not None:
            judged.append((r["val_ppl"] / front[0] - 1, r, front))
    if not judged:
        return None if not networks else (f"{space} ({len(networks)} retrained): none is as costly as the front's "
                                          "cheapest point; no verdict")
    gap, best, (front_ppl, front_std) = min(judged, key=lambda j: j[0])
    below = sum(r["val_ppl"] < f_ppl - (combined_spread(r.get("val_ppl_std"), f_std) or 0.0)
                for _, r, (f_ppl, f_std) in judged)
    spread = combined_spread(best.get("val_ppl_std"), front_std)
    margin = "beyond the seed spread" if spread is not None else "(one retrain each)"
    return (f"{space} ({len(networks)} retrained, {len(judged)} within the front's costs): the "
            f"furthest below the Transformer-XL front is {best['layout']}, val ppl {best['val_ppl']:.2f} at "
            f"{best['latency_ratio']:.2f}x vs {front_ppl:.2f} on the front ({gap * 100:+.1f}%, "
            f"{_judged(best['val_ppl'] - front_ppl, spread)}); {below} of {len(judged)} lie below the front {margin} "
            "(the best of many noisy retrains is biased low)")


def space_claim_verdict(rows: Sequence[Row], reaches: Callable[[float, float], tuple[bool, bool]], tolerance: float,
                        faster: str, space: str = EVERY) -> str | None:
    """The networks of the space that meet the study's claim (``reaches(val ppl, cost ratio)`` -> (perplexity within
    ``tolerance``, cost ``faster``)), and where none does, the cheapest whose perplexity does."""
    networks = _points(rows)
    txl = next((r for r in rows if r["role"] == "transformer-xl"), None)
    if not networks or txl is None or txl["val_ppl"] is None:
        return None
    met = [(r, reaches(r["val_ppl"], r["latency_ratio"])) for r in networks]
    hits = sorted((r for r, (same, fast) in met if same and fast), key=lambda r: r["latency_ratio"])
    head = (f"{space}: {len(hits)} of {len(networks)} reach Transformer-XL's val ppl "
            f"({txl['val_ppl']:.2f}) within {tolerance:.0%} {faster}")
    if not hits:
        near = min((r for r, (same, _) in met if same), key=lambda r: r["latency_ratio"], default=None)
        return head + ("" if near is None else
                       f"; the cheapest within {tolerance:.0%} is {near['layout']} at {near['latency_ratio']:.2f}x")
    shown = ", ".join(f"{r['layout']} ({r['val_ppl']:.2f} at {r['latency_ratio']:.2f}x)" for r in hits[:5])
    return f"{head}: {shown}{', ...' if len(hits) > 5 else ''}"
