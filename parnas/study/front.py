"""The study's verdict against the depth-scaled Transformer-XL front.

"Cheaper than Transformer-XL at the same perplexity" must beat the obvious ways of being cheaper: a shallower
Transformer-XL (the standard layouts of 2, 4, ... N blocks, retrained and timed like every other layout) and, with
``--widths``, a narrower one (``d_model`` and ``d_ff`` scaled alike). The front is the Pareto-optimal ones of these
points. A found model is judged against the front's perplexity *at its own cost*, interpolated between the two front
points that bracket it; above the costliest point the front stays at its perplexity (a larger budget still buys
that model), below the cheapest there is no verdict. The difference counts only beyond the seed spread: the
standard deviations over retrain (and search) seeds of the found model and of the two front points, combined.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from parnas.config import ModelConfig, transformer_xl_layout
from parnas.errors import ConfigError
from parnas.study.table import seed_spread

Row = Mapping[str, Any]


def front_layouts(n_blocks: int) -> list[tuple[str, ...]]:
    """The shallower standard layouts: 2, 4, ... blocks below ``n_blocks`` (which the study trains anyway)."""
    return [transformer_xl_layout(n) for n in range(2, n_blocks, 2)]


def parse_widths(text: str | None, model: ModelConfig) -> tuple[int, ...]:
    """``--widths 64,96``: the ``d_model`` of each width-scaled front point; each must make a valid model."""
    if not text:
        return ()
    try:
        widths = tuple(dict.fromkeys(int(w) for w in text.split(",")))
    except ValueError:
        raise ConfigError(f"--widths takes d_model values separated by commas, e.g. 64,96; got {text!r}") from None
    for width in widths:
        if width == model.d_model:
            raise ConfigError(f"--widths: {width} is model.d_model itself (the study's Transformer-XL)")
        try:
            width_model(model, width)
        except ConfigError as error:
            raise ConfigError(f"--widths: {error}") from None
    return widths


def width_model(model: ModelConfig, d_model: int) -> ModelConfig:
    """``model`` at another width: ``d_model`` and ``d_ff`` in proportion, the heads as they are."""
    if d_model <= 0:
        raise ConfigError(f"model.d_model must be > 0, got {d_model}")
    return replace(model, d_model=d_model, d_ff=max(1, round(model.d_ff * d_model / model.d_model)))


def front_points(rows: Sequence[Row]) -> list[tuple[float, float, float | None]]:
    """(cost ratio, mean val ppl, its spread over retrain seeds) of the front's points, by cost: the Pareto-optimal
    ones of the shallower, narrower (``--widths``) and standard Transformer-XLs."""
    from parnas.report.pareto import pareto_front

    points = sorted({(r["latency_ratio"], r["val_ppl"], r.get("val_ppl_std")) for r in rows
                     if r["role"] in ("front", "transformer-xl") and r["val_ppl"] is not None})
    return [points[i] for i in pareto_front([(x, y) for x, y, _ in points])]


def at_cost(points: Sequence[tuple[float, float, float | None]], ratio: float) -> tuple[float, float | None] | None:
    """The front's perplexity (and spread) at ``ratio``: interpolated between the bracketing points, the costliest
    point's above it, None below the cheapest."""
    for (x0, y0, s0), (x1, y1, s1) in zip(points, points[1:]):
        if x0 <= ratio <= x1:
            w = 0.0 if x1 == x0 else (ratio - x0) / (x1 - x0)
            spread = None if s0 is None or s1 is None else (1 - w) * s0 + w * s1
            return (1 - w) * y0 + w * y1, spread
    if points and ratio >= points[-1][0]:
        return points[-1][1], points[-1][2]
    return None


def combined_spread(*stds: float | None) -> float | None:
    """The spread of a difference of independent means: the root of the sum of their squared spreads (None: none
    known)."""
    parts = [s for s in stds if s is not None]
    return math.sqrt(sum(s * s for s in parts)) if parts else None


def found_point(found: Sequence[Row]) -> tuple[float, float, float | None] | None:
    """A group's found models as one point: (mean val ppl over every retrain of every search seed, mean cost ratio,
    the ppl's spread); None when no perplexity is finite."""
    ppls = [p for r in found for p in (r.get("val_ppl_seeds") or [r["val_ppl"]]) if p is not None]
    if not ppls:
        return None
    return statistics.fmean(ppls), statistics.fmean(r["latency_ratio"] for r in found), seed_spread(ppls)


def front_verdict(name: str, found: Sequence[Row], rows: Sequence[Row]) -> str:
    """``name``'s found models (one per search seed) against the front at their mean cost."""
    point = found_point(found)
    if point is None:
        return f"{name}: against the Transformer-XL front: no perplexity (not finite)"
    ppl, ratio, ppl_spread = point
    points = front_points(rows)
    front = at_cost(points, ratio)
    if front is None:
        costs = ", ".join(f"{x:.2f}" for x, _, _ in points)
        return (f"{name}: against the Transformer-XL front: cost {ratio:.2f}x lies below the front's costs "
                f"({costs}); no verdict")
    front_ppl, front_spread = front
    gap = (ppl / front_ppl - 1) * 100
    scaled = "depth- and width-scaled" if any("-d" in r["layout"] for r in rows if r["role"] == "front") \
        else "depth-scaled"
    costs = found[0].get("costs", "measured")
    cost = "cost" if costs == "measured" else f"cost ({costs})"
    head = (f"{name}: val ppl {ppl:.2f} at {ratio:.2f}x Transformer-XL's {cost} vs {front_ppl:.2f} on the "
            f"{scaled} Transformer-XL front at that cost ({gap:+.1f}%)")
    spread = combined_spread(ppl_spread, front_spread)
    if spread is None:
        return f"{head}; one retrain of each: no seed spread to judge by (use --seeds S,3)"
    if abs(ppl - front_ppl) <= spread:
        return f"{head}: on the front, not distinguishable (within the seed spread ±{spread:.2f})"
    return f"{head}: {'below the front (better)' if ppl < front_ppl else 'above the front (worse)'} beyond the seed " \
           f"spread ±{spread:.2f}"
