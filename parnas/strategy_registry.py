"""The search-strategy registry: every strategy ``parnas search --strategy NAME`` runs, by name.

The block-kind registry's sibling (:mod:`parnas.kinds`). A :class:`SearchStrategy` says its name, its family
(``one-shot``: one supernet trained, the architecture read from its logits; ``multi-trial``: each trial trains
one fixed architecture), how it runs, what it refuses and its own settings. ``search.strategy``, ``parnas search
--strategy``, ``parnas study --strategies`` and the reference's table of strategies all read it.

A strategy owns its settings, as a block kind does: ``SearchStrategy.settings`` is a frozen dataclass (defaults
and checks in ``__post_init__``) that a config fills under ``search.<strategy>.<setting>``, e.g.
``search.par-gumbel-darts.tau_end``; :class:`parnas.config.SearchConfig` holds only what every search has.

This module imports no torch and no NNI: configs are checked before they load. A strategy's code is named by
``"module:attribute"`` strings, imported the first time it runs; a settings class named so must live in a module
that imports no torch. NNI's own strategies are one list, :data:`NNI_STRATEGIES`, which their dispatch, the CLI,
the docs and the tests read.

User strategies come from Python entry points in group ``parnas.strategies``: a plugin package declares
``[project.entry-points."parnas.strategies"] my-search = "mypkg.search:STRATEGY"`` with ``STRATEGY`` a
:class:`SearchStrategy` named ``my-search``. The name is read without importing the plugin; the plugin is
imported the first time the strategy is looked up. Code can also :func:`register` one directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

from parnas import plugins
from parnas.errors import ParnasError
from parnas.registry import Registry, is_settings_class

GROUP = "parnas.strategies"
HOW_TO_REGISTER = (f"a plugin registers one with an entry point in group {GROUP!r} "
                   "(docs/reference.md, 'Search strategies'), or code calls parnas.strategy_registry.register")
ONE_SHOT, MULTI_TRIAL = "one-shot", "multi-trial"
FAMILIES = (ONE_SHOT, MULTI_TRIAL)

# ``cfg`` is a parnas.config.Config, not imported here: the config imports this module to check its names
Run = Callable[..., dict[str, Any]]  # run(cfg, *, resume) -> the architecture record ({} on ranks other than 0)
Check = Callable[[Any, bool], None]  # check(cfg, resume): raises ConfigError for what it cannot do


class StrategyError(ParnasError):
    """A search strategy that cannot be registered, found or loaded."""


@dataclass(frozen=True)
class SearchStrategy:
    """One search strategy.

    ``run(cfg, *, resume)`` (a callable, or ``"module:attribute"`` naming one) searches with ``cfg`` into
    ``cfg.search.out_dir`` (or the NNI trial's folder), writes ``architecture.json`` and returns its record
    (:mod:`parnas.architecture`), ``{}`` on ranks other than 0. ``check(cfg, resume)`` (optional, same forms)
    refuses with a ConfigError what the strategy cannot do; it runs before torch is imported, so it must not
    import it. ``settings`` (optional: a frozen dataclass, every field defaulted, or ``"module:attribute"``
    naming one in a module without torch): the strategy's own settings, ``search.<name>.<field>`` in a config,
    read as ``cfg.search.settings_of(name)``; a ``check(self, config)`` method on it, if any, refuses settings
    that do not fit the rest of the config, whenever a config with ``search.strategy`` = ``name`` is built.
    ``what`` and ``source`` are for the docs.
    """

    name: str
    family: str
    run: str | Run
    check: Union[str, Check, None] = None
    settings: Union[str, type, None] = None
    what: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not all(c.isalnum() or c in "-_" for c in self.name):
            raise StrategyError(f"search strategy name {self.name!r} must be letters, digits, '-' and '_', "
                                "e.g. 'my-search'")
        if self.family not in FAMILIES:
            raise StrategyError(f"search strategy {self.name!r}: family must be {' or '.join(FAMILIES)}, "
                                f"not {self.family!r}")
        for field, value in (("run", self.run), ("check", self.check)):
            if not (callable(value) or isinstance(value, str) and plugins.split_target(value)
                    or field == "check" and value is None):
                raise StrategyError(f"search strategy {self.name!r}: {field} must be a callable or a "
                                    f"'module:attribute' string, got {value!r}")
        if not (self.settings is None or is_settings_class(self.settings)
                or isinstance(self.settings, str) and plugins.split_target(self.settings)):
            raise StrategyError(f"search strategy {self.name!r}: settings must be a frozen dataclass or a "
                                f"'module:attribute' string naming one, got {self.settings!r}")

    def runner(self) -> Run:
        """The function that runs a search, imported on first use."""
        return self._load("run", self.run)

    def check_config(self, cfg: Any, resume: bool) -> None:
        """Refuse (ConfigError) what this strategy cannot do with ``cfg``, before anything is read or written."""
        if self.check is not None:
            self._load("check", self.check)(cfg, resume)

    def settings_class(self) -> type | None:
        """The class of this strategy's settings (None: it has none), imported on first use."""
        if self.settings is None:
            return None
        settings = self._load("settings", self.settings)
        if not is_settings_class(settings):
            raise StrategyError(f"search strategy {self.name!r}: its settings {self.settings!r} must name a frozen "
                                f"dataclass, got {settings!r:.80}")
        return settings

    def _load(self, field: str, target: str | Callable[..., Any]) -> Any:
        return STRATEGIES.load(self.name, field, target) if isinstance(target, str) else target


# --- the registry -------------------------------------------------------------------------------

STRATEGIES: Registry[SearchStrategy] = Registry(SearchStrategy, "search strategy", "strategies", GROUP,
                                                HOW_TO_REGISTER, StrategyError)
names, is_known, loaded = STRATEGIES.names, STRATEGIES.is_known, STRATEGIES.loaded
unknown_message, get, unregister = STRATEGIES.unknown_message, STRATEGIES.get, STRATEGIES.unregister


def register(strategy: SearchStrategy) -> SearchStrategy:
    """Add ``strategy``; a name already taken is an error (registering the same record again is not)."""
    return STRATEGIES.register(strategy)


def of_family(family: str) -> tuple[str, ...]:
    """The registered strategies of one family (plugins once loaded), in registry order."""
    return tuple(strategy.name for strategy in STRATEGIES.records() if strategy.family == family)


# --- built-in strategies -------------------------------------------------------------------------

PAR_GUMBEL_DARTS = "par-gumbel-darts"  # parnas's own search (parnas.strategies.search)
DEFAULT = PAR_GUMBEL_DARTS  # what search.strategy is unless set
NNI = "NNI 3.0"  # the source of NNI's own strategies, run on the PAR space


@dataclass(frozen=True)
class NNIStrategy:
    """One of NNI's own strategies as parnas runs it on the PAR space: ``nni_class`` (in ``nni.nas.strategy``)
    built with the fixed ``arguments``; where ``logits``, also with the run's ``search.arch_lr``, ``train.clip``
    and ``search.log_every`` (the strategy learns architecture logits); where ``settings`` (as
    :attr:`SearchStrategy.settings`), with what its settings' ``nni_arguments()`` returns. ``refused``: why parnas
    does not run it (its check says so in one line)."""

    name: str
    family: str
    nni_class: str
    what: str
    arguments: tuple[tuple[str, Any], ...] = ()
    logits: bool = False
    settings: str | None = None
    refused: str = ""


NNI_STRATEGIES = (
    NNIStrategy("darts", ONE_SHOT, "DARTS", "first-order DARTS, the logits stepped on the validation stream",
                logits=True),
    NNIStrategy("gumbel-darts", ONE_SHOT, "GumbelDARTS", "DARTS with Gumbel-softmax samples, tau annealed per epoch",
                logits=True, settings="parnas.strategies.nni_strategies:NNIGumbelSettings"),
    NNIStrategy("random-oneshot", ONE_SHOT, "RandomOneShot", "uniform random paths through the supernet, no logits"),
    NNIStrategy("proxyless", ONE_SHOT, "Proxyless", "one sampled binary-gated path per block", logits=True),
    NNIStrategy("enas", ONE_SHOT, "ENAS",
                "a reinforcement-learned controller (refused: its dependencies do not install)",
                refused="needs NNI's optional reinforcement-learning dependencies (tianshou<1 and gym), which do not "
                        "install beside this torch"),
    NNIStrategy("random", MULTI_TRIAL, "Random", "architectures drawn at random, no repeats", (("dedup", True),)),
    NNIStrategy("regularized-evolution", MULTI_TRIAL, "RegularizedEvolution", "aging evolution, population 4, "
                "sample 2", (("population_size", 4), ("sample_size", 2))),
    # as the other strategies: the larger metric is the better
    NNIStrategy("tpe", MULTI_TRIAL, "TPE", "NNI's TPE tuner driving the choices", (("optimize_mode", "maximize"),)),
    NNIStrategy("grid", MULTI_TRIAL, "GridSearch", "every architecture in turn"),
)
_NNI_RUN = {ONE_SHOT: "parnas.strategies.nni_strategies:run_nni_search",
            MULTI_TRIAL: "parnas.strategies.multi_trial:run_multi_trial"}


def nni_strategy(name: str) -> NNIStrategy:
    """NNI's strategy ``name`` as parnas runs it (StrategyError for a name that is not one of NNI's)."""
    for strategy in NNI_STRATEGIES:
        if strategy.name == name:
            return strategy
    raise StrategyError(f"search strategy {name!r} is not one of NNI's: "
                        f"{', '.join(s.name for s in NNI_STRATEGIES)}")


STRATEGIES.register(SearchStrategy(
    PAR_GUMBEL_DARTS, ONE_SHOT, "parnas.strategies.search:run_search",
    check="parnas.strategies.par_settings:check_par_search", settings="parnas.strategies.par_settings:PARSettings",
    what="Gumbel-softmax DARTS with tau annealed every step, a latency penalty or budget, exact resume",
    source="Mandava et al. 2020 (PAR); parnas's own"), builtin=True)
for _nni in NNI_STRATEGIES:
    STRATEGIES.register(SearchStrategy(_nni.name, _nni.family, _NNI_RUN[_nni.family],
                                       "parnas.strategies.nni_strategies:check_nni_strategy", settings=_nni.settings,
                                       what=_nni.what, source=NNI), builtin=True)
del _nni
