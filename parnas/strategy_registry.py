"""The search-strategy registry: every strategy ``parnas search --strategy NAME`` runs, by name.

The block-kind registry's sibling (:mod:`parnas.kinds`): ``search.strategy``, ``parnas search --strategy`` and
``parnas strategies`` read it. Imports no torch and no NNI: configs are checked before they load. parnas's own
strategies (:mod:`parnas.strategies.builtin`) live in the package above and register as a plugin does, through an
entry point of parnas's distribution (group :data:`BUILTINS`), so nothing here names a module above it. Plugins
declare entry points in group ``parnas.strategies`` (docs/reference.md, "Search strategies"); a settings class
named by ``"module:attribute"`` must live in a module that imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

from parnas import plugins
from parnas.errors import ParnasError
from parnas.registry import Registry, is_settings_class

GROUP = "parnas.strategies"
BUILTINS = "parnas.builtin"  # the entry-point group of parnas's own strategies (a sequence of records each)
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
    (:mod:`parnas.architecture`), ``{}`` on ranks other than 0. ``check(cfg, resume)`` (optional, same forms) refuses
    with a ConfigError what the strategy cannot do; it runs before torch is imported, so it must not import it.
    ``settings`` (optional: a frozen dataclass, every field defaulted, or ``"module:attribute"`` naming one in a module
    without torch): the strategy's own settings, ``search.<name>.<field>`` in a config, read as
    ``cfg.search.settings_of(name)``; a ``check(self, config)`` method on it, if any, refuses settings that do not fit
    the rest of the config, whenever a config with ``search.strategy`` = ``name`` is built. ``supernet`` (optional, same
    forms as ``run``): the strategy has a supernet that parnas's one-shot pipeline trains, then picks from and exports
    (:func:`parnas.strategies.search.run_search`: the final pick, the architecture record, the pictures); it is called
    as ``supernet(search, settings, *, max_steps, gradient_clip_val, costs, history_path, on_evaluation)`` and returns
    the NNI one-shot strategy to train (``PARGumbelDARTS`` or a subclass), and ``run`` is then that pipeline. ``what``
    and ``source`` are for the docs.
    """

    name: str
    family: str
    run: str | Run
    check: Union[str, Check, None] = None
    settings: Union[str, type, None] = None
    supernet: Union[str, Callable[..., Any], None] = None
    what: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not all(c.isalnum() or c in "-_" for c in self.name):
            raise StrategyError(f"search strategy name {self.name!r} must be letters, digits, '-' and '_', "
                                "e.g. 'my-search'")
        if self.family not in FAMILIES:
            raise StrategyError(f"search strategy {self.name!r}: family must be {' or '.join(FAMILIES)}, "
                                f"not {self.family!r}")
        for field, value in (("run", self.run), ("check", self.check), ("supernet", self.supernet)):
            if not (callable(value) or isinstance(value, str) and plugins.split_target(value)
                    or field != "run" and value is None):
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

    def supernet_factory(self) -> Callable[..., Any] | None:
        """What builds the one-shot strategy that trains this strategy's supernet (None: it has none), imported
        on first use."""
        return None if self.supernet is None else self._load("supernet", self.supernet)

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
                                                HOW_TO_REGISTER, StrategyError, builtins=BUILTINS)
names, is_known, loaded = STRATEGIES.names, STRATEGIES.is_known, STRATEGIES.loaded
unknown_message, get, unregister = STRATEGIES.unknown_message, STRATEGIES.get, STRATEGIES.unregister


def register(strategy: SearchStrategy) -> SearchStrategy:
    """Add ``strategy``; a name already taken is an error (registering the same record again is not)."""
    return STRATEGIES.register(strategy)


# --- the built-in strategies' names (their records: parnas.strategies.builtin) -----------------------

PAR_GUMBEL_DARTS = "par-gumbel-darts"  # parnas's own search (parnas.strategies.search)
DEFAULT = PAR_GUMBEL_DARTS  # what search.strategy is unless set
NNI = "NNI 3.0"  # the source of NNI's own strategies, run on the PAR space
