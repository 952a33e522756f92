"""The settings of a search's final pick (``select.*``), checked when the config is read (no torch).

A supernet ranks a large space's layouts poorly, so the pick retrains its best few and, as a guard, the deepest
shallower Transformer-XL within the budget, and exports the best: a user is never handed a network that lost to
that one-line alternative. The stage itself is :mod:`parnas.strategies.final_pick`.
"""

from __future__ import annotations

from dataclasses import dataclass

from parnas.errors import ConfigError

EARLY_VALID_FRACTION = 0.25  # the part of the validation split the rounds before the last judge by


@dataclass(frozen=True)
class SelectConfig:
    """``select`` (PAR's settings): the final pick after the supernet (settings: docs/reference.md, "The final pick";
    why each is what it is: docs/results.md).

    ``steps``: the steps each round ends at (strictly increasing; None: half of ``train.max_steps``, then all of it, so
    the last round trains the finalists as ``parnas retrain`` will; empty: no pick). ``k``: the supernet's layouts that
    enter. ``budget``: the cost ratio they must be within (None: ``latency_budget``, else the exported layout's). The
    guard enters whatever the budget ranks, and reaches the last round. ``confirm_seeds``: further seeds both retrain on
    when a layout beats the guard (a short retrain's seeds spread by more than the margins the guard is beaten by).
    """

    k: int = 3
    steps: tuple[int, ...] | None = None
    budget: float | None = None
    confirm_seeds: int = 1

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"select.k must be >= 1 (the supernet's layouts the final pick retrains), got "
                              f"{self.k}; set select.steps=[] to turn the final pick off")
        steps = self.steps or ()
        if any(s <= 0 for s in steps) or any(a >= b for a, b in zip(steps, steps[1:])):
            raise ConfigError(f"select.steps must be positive and strictly increasing (the steps each round "
                              f"ends at), got {list(steps)}")
        if self.budget is not None and not 0.0 < self.budget <= 1.0:
            raise ConfigError(f"select.budget must be in (0, 1] (a fraction of Transformer-XL's cost), got "
                              f"{self.budget}")
        if self.confirm_seeds < 0:
            raise ConfigError(f"select.confirm_seeds must be >= 0 (further seeds that confirm a win over the "
                              f"guard), got {self.confirm_seeds}")

    @property
    def enabled(self) -> bool:
        """Whether the search ends with the final pick."""
        return self.steps != ()

    def rounds(self, max_steps: int) -> tuple[int, ...]:
        """The steps each round ends at, for a retrain of ``max_steps`` (``train.max_steps``)."""
        if self.steps is not None:
            return self.steps
        return (max_steps,) if max_steps < 2 else (max_steps // 2, max_steps)

    def beyond(self, max_steps: int, key: str) -> str | None:
        """The line that says so when the pick's rounds train past ``train.max_steps`` (what ``parnas retrain``
        trains the exported layout for, and a search of that length costs), else None; ``key`` names the steps' setting
        (``search.<strategy>.select.steps``). A 4-step search whose
        pick retrains each finalist for 1,000 steps is the user's to know before it starts, not after."""
        rounds = self.rounds(max_steps)
        if not rounds or rounds[-1] <= max_steps:
            return None
        return (f"{key}={list(rounds)} go beyond train.max_steps={max_steps}: the final pick trains "
                f"each of its finalists for up to {rounds[-1]:,} steps, longer than parnas retrain trains the "
                f"exported layout; lower them, or set {key}=[] to export without a pick")

    @staticmethod
    def kept(entrants: int, round_index: int, n_rounds: int) -> int:
        """How many of ``entrants`` go on after round ``round_index`` of ``n_rounds``: the better half (rounded
        up), one after the last round."""
        return 1 if round_index == n_rounds - 1 else max(1, -(-entrants // 2))
