"""The settings of a search's final pick (``search.select.*``), checked when the config is read (no torch).

A supernet ranks layouts poorly in a large space, so the layout it prefers may train worse than simply taking
blocks off Transformer-XL. The final pick retrains briefly, from scratch, the ``k`` layouts the supernet prefers
within the budget and, as a guard, the deepest shallower Transformer-XL (attention and dense pairs) within it,
by successive halving, and exports the best: a user is never handed a network that lost to that one-line
alternative. The stage itself is :mod:`parnas.strategies.select`.
"""

from __future__ import annotations

from dataclasses import dataclass

from parnas.errors import ConfigError

RANKS = ("probability", "inherited")  # how the final pick chooses the supernet's entrants


@dataclass(frozen=True)
class SelectConfig:
    """``search.select``: the final pick after the supernet.

    ``steps``: the training steps each surviving candidate has reached at the end of each round (strictly
    increasing; training continues from the previous round's checkpoint, one learning-rate schedule spanning
    the last round's steps); after every round but the last the better half goes on, and the last round's best
    is exported; the warm-up is ``train.warmup_steps``, at most half the first round's steps. Empty: no final pick
    (the supernet's layout is exported, as before). ``k``: how many of the
    supernet's layouts enter, at least 1. ``guard``: enter the shallower Transformer-XL too. ``budget``: the
    cost ratio (to Transformer-XL's) the entrants must be within; None: ``search.latency_budget``, or without
    one the cost of the layout the supernet exports. ``rank``: how the supernet's ``k`` are chosen:
    ``probability`` (its most probable networks under softmax(alpha), the exported one first) or ``inherited``
    (of its ``pool`` most probable networks within the budget, the ``k`` with the lowest validation perplexity
    with the supernet's weights: one validation pass each). A strict-fair supernet ranks well but exports badly
    (4 blocks: its logits' pick 13.1% above the front, its inherited ranking's within 1.8%): rank it by
    ``inherited``.
    """

    k: int = 4
    steps: tuple[int, ...] = (150, 300)
    guard: bool = True
    budget: float | None = None
    rank: str = "probability"
    pool: int = 32

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"search.select.k must be >= 1 (the supernet's layouts the final pick retrains), got "
                              f"{self.k}; set search.select.steps=[] to turn the final pick off")
        if any(s <= 0 for s in self.steps) or any(a >= b for a, b in zip(self.steps, self.steps[1:])):
            raise ConfigError(f"search.select.steps must be positive and strictly increasing (the steps each round "
                              f"ends at), got {list(self.steps)}")
        if self.rank not in RANKS:
            raise ConfigError(f"search.select.rank must be one of {', '.join(RANKS)} (how the supernet's entrants are "
                              f"chosen), got {self.rank!r}")
        if self.pool < self.k:
            raise ConfigError(f"search.select.pool ({self.pool}) must be at least search.select.k ({self.k}): the "
                              "networks ranked by inherited perplexity, of which k enter")
        if self.budget is not None and not 0.0 < self.budget <= 1.0:
            raise ConfigError(f"search.select.budget must be in (0, 1] (a fraction of Transformer-XL's cost), got "
                              f"{self.budget}")

    @property
    def enabled(self) -> bool:
        """Whether the search ends with the final pick."""
        return bool(self.steps)

    def kept(self, entrants: int, round_index: int) -> int:
        """How many of ``entrants`` go on after round ``round_index``: the better half (rounded up), one after the
        last round."""
        return 1 if round_index == len(self.steps) - 1 else max(1, -(-entrants // 2))
