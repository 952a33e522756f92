"""NNI's own strategies as parnas runs them on the PAR space: one list, :data:`NNI_STRATEGIES`, which the built-in
records, the dispatch, the CLI, the docs and the tests read; and the check that refuses what they cannot do. Imports
no torch: a config is checked before it loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from parnas.errors import ConfigError
from parnas.strategies.nni_trial import in_nni_trial
from parnas.strategy_registry import DEFAULT, MULTI_TRIAL, ONE_SHOT, StrategyError

if TYPE_CHECKING:
    from parnas.config import Config


@dataclass(frozen=True)
class NNIStrategy:
    """One of NNI's own strategies as parnas runs it: ``nni_class`` (in ``nni.nas.strategy``) built with the fixed
    ``arguments`` and, where it learns ``logits``, with ``search.arch_lr``, ``train.clip`` and ``search.log_every``."""

    name: str
    family: str
    nni_class: str
    what: str
    arguments: tuple[tuple[str, Any], ...] = ()
    logits: bool = False


NNI_STRATEGIES = (
    NNIStrategy("darts", ONE_SHOT, "DARTS", "first-order DARTS, the logits stepped on the validation stream",
                logits=True),
    NNIStrategy("gumbel-darts", ONE_SHOT, "GumbelDARTS", "DARTS with Gumbel-softmax samples, tau annealed per epoch",
                logits=True),
    NNIStrategy("random-oneshot", ONE_SHOT, "RandomOneShot", "uniform random paths through the supernet, no logits"),
    NNIStrategy("proxyless", ONE_SHOT, "Proxyless", "one sampled binary-gated path per block", logits=True),
    NNIStrategy("random", MULTI_TRIAL, "Random", "architectures drawn at random, no repeats", (("dedup", True),)),
    NNIStrategy("regularized-evolution", MULTI_TRIAL, "RegularizedEvolution", "aging evolution, population 4, "
                "sample 2", (("population_size", 4), ("sample_size", 2))),
    # as the other strategies: the larger metric is the better
    NNIStrategy("tpe", MULTI_TRIAL, "TPE", "NNI's TPE tuner driving the choices", (("optimize_mode", "maximize"),)),
    NNIStrategy("grid", MULTI_TRIAL, "GridSearch", "every architecture in turn"),
)


def nni_strategy(name: str) -> NNIStrategy:
    """NNI's strategy ``name`` as parnas runs it (StrategyError for a name that is not one of NNI's)."""
    for strategy in NNI_STRATEGIES:
        if strategy.name == name:
            return strategy
    raise StrategyError(f"search strategy {name!r} is not one of NNI's: "
                        f"{', '.join(s.name for s in NNI_STRATEGIES)}")


def check_nni_strategy(cfg: Config, resume: bool) -> None:
    """Refuse, in one line, what NNI's strategy ``search.strategy`` cannot do (before anything is read or written):
    the registry's check for NNI's one-shot and multi-trial strategies."""
    name, spec = cfg.search.strategy, nni_strategy(cfg.search.strategy)
    multi_trial = spec.family == MULTI_TRIAL
    if multi_trial and (in_nni_trial() or resume):
        raise ConfigError(f"search.strategy={name} starts an NNI experiment of its own: run it outside nnictl, "
                          "without --resume")
    if resume:
        raise ConfigError(f"--resume continues a {DEFAULT} search; NNI's {name} cannot resume: start it again")
    if cfg.train.devices * cfg.train.num_nodes != 1:
        raise ConfigError(f"search.strategy={name} runs in one process (train.devices=1): NNI's one-shot modules "
                          "do not keep the logits alike across ranks")
