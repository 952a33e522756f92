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
    is exported; the warm-up is ``train.warmup_steps``, at most half the first round's steps. None (the
    default): half of ``train.max_steps``, then all of it, so the last round trains the finalists exactly as
    ``parnas retrain`` will train the exported one. Shorter rounds misjudge the shallower Transformer-XL: in
    PLANER's space, after 150 and 300 steps of a 300-step schedule the 2-block guard lost to 5-block networks
    that it beats after 600 steps by 1-2%. Empty: no final pick (the supernet's layout is exported, as before).
    ``k``: how many of the supernet's layouts enter, at least 1; 3 by default: on both ranking tables (PAR's 6-block
    space and PLANER's) 17 of 18 supernets exported the same network with 3 as with 4, the 18th a better one
    (the guard), for about three quarters of the pick's time. ``guard``: enter the shallower Transformer-XL
    too; it goes on to the last round whatever its rank. ``budget``: the cost ratio (to Transformer-XL's) the
    entrants must be within; None: ``search.latency_budget``, or without one the cost of the layout the
    supernet exports. ``rank``: how the supernet's ``k`` are chosen: ``probability`` (its most probable
    networks under softmax(alpha), the exported one first) or ``inherited`` (of its ``pool`` most probable
    networks within the budget, the ``k`` with the lowest validation perplexity with the supernet's weights:
    one validation pass each). A strict-fair supernet ranks well but exports badly (4 blocks: its logits' pick
    13.1% above the front, its inherited ranking's within 1.8%): rank it by ``inherited``.
    ``early_valid_fraction``: the part of the validation split the rounds before the last judge by (the first
    part of every evaluation stream, so from all of the split); the last round reads all of it, as ``parnas
    retrain`` does. A whole pass over WikiText-2's validation split reads six times the tokens a 300-step round
    trains on at wt2-cpu, and took as long as the round; the early rounds only drop the supernet's entrants
    that trail (the guard goes on to the last round whatever its rank). On the 18 supernets of both ranking
    tables, a quarter exported the same network as the whole split every time (the finalists differed twice).
    ``confirm_seeds``: when one of the supernet's layouts beats the guard in the last round, both are retrained
    on this many further seeds (``train.seed`` + 1, ...) to the last round's steps, and the guard is exported
    unless the layout's mean over every seed is lower; 0 judges on the one seed. A 600-step retrain's seeds
    spread by up to 3% in PLANER's space: two of nine searches there exported a layout that beat the guard by
    0.5-0.8% on the search's seed and lies 0.9-2.9% above it over three. Where it runs, it adds two retrains to
    the pick (at wt2-cpu, 16-17 s to a 64-65 s search).
    """

    k: int = 3
    steps: tuple[int, ...] | None = None
    guard: bool = True
    budget: float | None = None
    rank: str = "probability"
    pool: int = 32
    early_valid_fraction: float = 0.25
    confirm_seeds: int = 1

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"search.select.k must be >= 1 (the supernet's layouts the final pick retrains), got "
                              f"{self.k}; set search.select.steps=[] to turn the final pick off")
        steps = self.steps or ()
        if any(s <= 0 for s in steps) or any(a >= b for a, b in zip(steps, steps[1:])):
            raise ConfigError(f"search.select.steps must be positive and strictly increasing (the steps each round "
                              f"ends at), got {list(steps)}")
        if self.rank not in RANKS:
            raise ConfigError(f"search.select.rank must be one of {', '.join(RANKS)} (how the supernet's entrants are "
                              f"chosen), got {self.rank!r}")
        if self.pool < self.k:
            raise ConfigError(f"search.select.pool ({self.pool}) must be at least search.select.k ({self.k}): the "
                              "networks ranked by inherited perplexity, of which k enter")
        if not 0.0 < self.early_valid_fraction <= 1.0:
            raise ConfigError(f"search.select.early_valid_fraction must be in (0, 1] (the part of the validation "
                              f"split the early rounds judge by), got {self.early_valid_fraction}")
        if self.confirm_seeds < 0:
            raise ConfigError(f"search.select.confirm_seeds must be >= 0 (further seeds that confirm a win over the "
                              f"guard), got {self.confirm_seeds}")
        if self.budget is not None and not 0.0 < self.budget <= 1.0:
            raise ConfigError(f"search.select.budget must be in (0, 1] (a fraction of Transformer-XL's cost), got "
                              f"{self.budget}")

    @property
    def enabled(self) -> bool:
        """Whether the search ends with the final pick."""
        return self.steps != ()

    def rounds(self, max_steps: int) -> tuple[int, ...]:
        """The steps each round ends at, for a retrain of ``max_steps`` (``train.max_steps``)."""
        if self.steps is not None:
            return self.steps
        return (max_steps,) if max_steps < 2 else (max_steps // 2, max_steps)

    def beyond(self, max_steps: int) -> str | None:
        """The line that says so when the pick's rounds train past ``train.max_steps`` (what ``parnas retrain``
        trains the exported layout for, and a search of that length costs), else None: a 4-step search whose
        pick retrains each finalist for 1,000 steps is the user's to know before it starts, not after."""
        rounds = self.rounds(max_steps)
        if not rounds or rounds[-1] <= max_steps:
            return None
        return (f"search.select.steps={list(rounds)} go beyond train.max_steps={max_steps}: the final pick trains "
                f"each of its finalists for up to {rounds[-1]:,} steps, longer than parnas retrain trains the "
                "exported layout; lower them, or set search.select.steps=[] to export without a pick")

    @staticmethod
    def kept(entrants: int, round_index: int, n_rounds: int) -> int:
        """How many of ``entrants`` go on after round ``round_index`` of ``n_rounds``: the better half (rounded
        up), one after the last round."""
        return 1 if round_index == n_rounds - 1 else max(1, -(-entrants // 2))
