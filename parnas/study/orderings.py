"""The orderings of a found architecture's kinds that a study retrains beside it: Press et al.'s sandwich
(all attention first) and random shuffles, the same for the same kind counts, each a network of its own."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from parnas.config import BLOCK_KINDS
from parnas.nn.model import blocks_run


def sandwich(kinds: Sequence[str]) -> tuple[str, ...]:
    """Press et al.'s sandwich ordering of these kinds: all attention, then dense, then identity. Other kinds
    go with their family: token mixers (kinds with a memory: conv, compressive) after attention, other
    feed-forwards (glu, sqrelu) after dense, each family's kinds by name."""
    from parnas import kinds as registry

    def rank(kind: str) -> tuple[int, str]:
        if kind in BLOCK_KINDS:
            return (0, 2, 4)[BLOCK_KINDS.index(kind)], ""
        return (1 if registry.is_known(kind) and registry.get(kind).uses_memory else 3), kind

    return tuple(sorted(kinds, key=rank))


def random_orderings(kinds: Sequence[str], count: int, exclude: Sequence[Sequence[str]] = (),
                     tries: int = 2000, reversible: bool = False) -> list[tuple[str, ...]]:
    """``count`` shuffles of ``kinds``, each a different network (:func:`parnas.nn.model.blocks_run`), from an RNG
    seeded by the kind counts alone, avoiding the networks of ``exclude`` while others exist; fewer if there are not."""
    counts = Counter(kinds)
    rng = random.Random("parnas-study:" + ",".join(f"{k}={counts[k]}" for k in sorted(counts)))
    excluded = {blocks_run(e, reversible) for e in exclude}
    seen: set[tuple[str, ...]] = set()
    fresh: list[tuple[str, ...]] = []
    spare: list[tuple[str, ...]] = []  # orderings of excluded networks, used only when no other is left
    for _ in range(tries):
        order = sorted(kinds)
        rng.shuffle(order)
        ordering, net = tuple(order), blocks_run(order, reversible)
        if net not in seen:
            seen.add(net)
            (spare if net in excluded else fresh).append(ordering)
        if len(fresh) >= count:
            break
    return (fresh + spare)[:count]
