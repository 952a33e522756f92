"""The search-strategy registry: every strategy ``parnas search --strategy NAME`` runs, by name.

The block-kind registry's sibling (:mod:`parnas.kinds`). A :class:`SearchStrategy` says its name, its family
(``one-shot``: one supernet trained, the architecture read from its logits; ``multi-trial``: each trial trains
one fixed architecture), how it runs and what it refuses. ``search.strategy``, ``parnas search --strategy``,
``parnas study --strategies`` and the reference's table of strategies all read it.

This module imports no torch and no NNI: configs are checked before they load. A strategy's code is named by
``"module:attribute"`` strings, imported the first time it runs.

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
    import it. ``forwards``: the ``search.forward`` modes it runs (what a step runs in each block).
    ``what`` and ``source`` are for the docs.
    """

    name: str
    family: str
    run: str | Run
    check: Union[str, Check, None] = None
    forwards: tuple[str, ...] = ("mixed",)
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

    def runner(self) -> Run:
        """The function that runs a search, imported on first use."""
        return self._load("run", self.run)

    def check_config(self, cfg: Any, resume: bool) -> None:
        """Refuse (ConfigError) what this strategy cannot do with ``cfg``, before anything is read or written."""
        if self.check is not None:
            self._load("check", self.check)(cfg, resume)

    def _load(self, field: str, target: str | Callable[..., Any]) -> Callable[..., Any]:
        if not isinstance(target, str):
            return target
        try:
            return plugins.load_target(target)
        except (ImportError, AttributeError) as e:
            raise StrategyError(f"search strategy {self.name!r}: cannot load its {field} {target!r} "
                                f"({type(e).__name__}: {e})") from None


# --- the registry -------------------------------------------------------------------------------

_REGISTRY: dict[str, SearchStrategy] = {}
_BUILTIN: tuple[str, ...] = ()


def register(strategy: SearchStrategy) -> SearchStrategy:
    """Add ``strategy``; a name already taken is an error (registering the same record again is not)."""
    if not isinstance(strategy, SearchStrategy):
        raise StrategyError(f"register expects a parnas.strategy_registry.SearchStrategy, "
                            f"got {type(strategy).__name__}")
    old = _REGISTRY.get(strategy.name)
    if old == strategy:
        return strategy
    if old is not None:
        raise StrategyError(f"search strategy {strategy.name!r} is already registered"
                            f"{' (built in)' if strategy.name in _BUILTIN else ''}; choose another name")
    _REGISTRY[strategy.name] = strategy
    return strategy


def unregister(name: str) -> None:
    """Remove a strategy registered in this process (tests, notebooks); built-ins stay."""
    if name in _BUILTIN:
        raise StrategyError(f"search strategy {name!r} is built in and cannot be removed")
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """Every known strategy: built-ins, then registered ones, then plugins not loaded yet. Stable order."""
    return (*_REGISTRY, *sorted(set(plugins.entry_points(GROUP)) - set(_REGISTRY)))


def is_known(name: str) -> bool:
    return name in _REGISTRY or name in plugins.entry_points(GROUP)


def unknown_message(name: str) -> str:
    return f"unknown search strategy {name!r}; known strategies: {', '.join(names())}; {HOW_TO_REGISTER}"


def get(name: str) -> SearchStrategy:
    """The strategy called ``name``, loading its plugin on first use."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    ep = plugins.entry_points(GROUP).get(name)
    if ep is None:
        raise StrategyError(unknown_message(name))
    try:
        strategy = ep.load()
    except Exception as e:  # a broken plugin is the user's to fix: say which and why, in one line
        raise StrategyError(f"search strategy {name!r}: cannot load entry point {ep.value!r} "
                            f"({type(e).__name__}: {e})") from None
    if not isinstance(strategy, SearchStrategy) or strategy.name != name:
        raise StrategyError(f"entry point {name!r} ({ep.value}) must name a parnas.strategy_registry.SearchStrategy "
                            f"called {name!r}, got {strategy!r:.80}")
    return register(strategy)


def of_family(family: str) -> tuple[str, ...]:
    """The registered strategies of one family (plugins once loaded), in registry order."""
    return tuple(name for name, strategy in _REGISTRY.items() if strategy.family == family)


def running(forward: str) -> tuple[str, ...]:
    """The registered strategies that run ``search.forward=forward`` (plugins once loaded)."""
    return tuple(name for name, strategy in _REGISTRY.items() if forward in strategy.forwards)


# --- built-in strategies -------------------------------------------------------------------------

PAR_GUMBEL_DARTS = "par-gumbel-darts"  # parnas's own search (parnas.strategies.search)
DEFAULT = PAR_GUMBEL_DARTS  # what search.strategy is unless set
NNI = "NNI 3.0"  # the source of NNI's own strategies, run on the PAR space
_NNI_ONE_SHOT = "parnas.strategies.nni_strategies:run_nni_search"
_NNI_MULTI_TRIAL = "parnas.strategies.multi_trial:run_multi_trial"
_NNI_CHECK = "parnas.strategies.nni_strategies:check_nni_strategy"

for _strategy in (
    SearchStrategy(PAR_GUMBEL_DARTS, ONE_SHOT, "parnas.strategies.search:run_search", forwards=("mixed", "sampled"),
                   what="Gumbel-softmax DARTS with tau annealed every step, a latency penalty or budget, exact resume",
                   source="Mandava et al. 2020 (PAR); parnas's own"),
    SearchStrategy("darts", ONE_SHOT, _NNI_ONE_SHOT, _NNI_CHECK,
                   what="first-order DARTS, the logits stepped on the validation stream", source=NNI),
    SearchStrategy("gumbel-darts", ONE_SHOT, _NNI_ONE_SHOT, _NNI_CHECK,
                   what="DARTS with Gumbel-softmax samples, tau annealed per epoch", source=NNI),
    SearchStrategy("random-oneshot", ONE_SHOT, _NNI_ONE_SHOT, _NNI_CHECK,
                   what="uniform random paths through the supernet, no logits", source=NNI),
    SearchStrategy("proxyless", ONE_SHOT, _NNI_ONE_SHOT, _NNI_CHECK,
                   what="one sampled binary-gated path per block", source=NNI),
    SearchStrategy("enas", ONE_SHOT, _NNI_ONE_SHOT, _NNI_CHECK,
                   what="a reinforcement-learned controller (refused: its dependencies do not install)",
                   source=NNI),
    SearchStrategy("random", MULTI_TRIAL, _NNI_MULTI_TRIAL, _NNI_CHECK,
                   what="architectures drawn at random, no repeats", source=NNI),
    SearchStrategy("regularized-evolution", MULTI_TRIAL, _NNI_MULTI_TRIAL, _NNI_CHECK,
                   what="aging evolution, population 4, sample 2", source=NNI),
    SearchStrategy("tpe", MULTI_TRIAL, _NNI_MULTI_TRIAL, _NNI_CHECK,
                   what="NNI's TPE tuner driving the choices", source=NNI),
    SearchStrategy("grid", MULTI_TRIAL, _NNI_MULTI_TRIAL, _NNI_CHECK,
                   what="every architecture in turn", source=NNI),
):
    register(_strategy)
_BUILTIN = tuple(_REGISTRY)
del _strategy
