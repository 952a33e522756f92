"""A search strategy owns its settings, as a block kind does: ``search.<strategy>.<setting>``, checked before torch
loads; a key of an earlier version, or a removed one, is refused in one line naming what to use; a strategy
registered in code declares its own; and both registries stand on one base."""

import dataclasses
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from parnas import strategy_registry
from parnas.config import Config, load_config
from parnas.errors import ConfigError
from parnas.kinds.registry import KINDS
from parnas.old_keys import REMOVED, RENAMED
from parnas.overrides import from_dict
from parnas.registry import Registry
from parnas.strategy_registry import MULTI_TRIAL, SearchStrategy, StrategyError

ROOT = Path(__file__).parents[2]
PAR = strategy_registry.DEFAULT


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_a_key_of_an_earlier_version_is_refused_naming_its_new_key(old):
    with pytest.raises(ConfigError, match=f"^{re.escape(old)} is now {re.escape(RENAMED[old])}: use that key$"):
        load_config("tiny", [f"{old}=1"])


@pytest.mark.parametrize("old", sorted(REMOVED))
def test_a_removed_setting_is_refused_saying_what_to_use_instead(old):
    with pytest.raises(ConfigError, match=f"^{re.escape(old)} was removed: "):
        load_config("tiny", [f"{old}=1"])


def test_the_presets_hold_no_old_key_and_a_config_reads_back_as_it_was_written():
    from parnas.config import presets

    for name in presets():
        cfg = load_config(name)
        assert from_dict(Config, cfg.to_dict()) == cfg


def test_settings_are_checked_and_written_without_torch():
    code = ("import sys; from parnas.config import load_config; "
            f"c = load_config('tiny', ['search.{PAR}.tau_end=0.2']); c.to_dict(); "
            "print(c.search.settings.tau_end, 'torch' in sys.modules, 'nni' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == ["0.2", "False", "False"]


@dataclass(frozen=True)
class Budgeted:
    """A plugin strategy's own settings: a number of draws, at least one, and at most the run's steps."""

    draws: int = 2

    def __post_init__(self) -> None:
        if self.draws < 1:
            raise ConfigError(f"draws must be >= 1, got {self.draws}")

    def check(self, cfg: Config) -> None:
        if self.draws > cfg.train.max_steps:
            raise ConfigError(f"search.{cfg.search.strategy}.draws ({self.draws}) exceeds train.max_steps")


@pytest.fixture
def budgeted():
    strategy = SearchStrategy("budgeted", MULTI_TRIAL, lambda cfg, *, resume: {}, settings=Budgeted)
    strategy_registry.register(strategy)
    yield strategy
    strategy_registry.unregister("budgeted")


def test_a_strategy_registered_in_code_declares_its_own_settings(budgeted):
    cfg = load_config("tiny", ["search.strategy=budgeted", "search.budgeted.draws=5"])
    assert cfg.search.settings == Budgeted(5) and from_dict(Config, cfg.to_dict()) == cfg
    assert load_config("tiny", ["search.strategy=budgeted"]).search.settings == Budgeted()
    for sets, needle in ((["search.budgeted.draws=0"], "search.budgeted.draws must be >= 1, got 0"),
                         (["search.budgeted.drawz=1"], "unknown config key search.budgeted.drawz"),
                         (["search.strategy=budgeted", "search.budgeted.draws=900"],
                          "search.budgeted.draws (900) exceeds train.max_steps"),
                         (["search.budgeted.draws=9"], "but this search runs par-gumbel-darts")):
        with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
            load_config("tiny", sets)


def test_settings_must_be_a_frozen_dataclass_or_name_one():
    @dataclass
    class Loose:
        x: int = 1

    with pytest.raises(StrategyError, match="settings must be a frozen dataclass"):
        SearchStrategy("loose", MULTI_TRIAL, print, settings=Loose)
    named = SearchStrategy("loose", MULTI_TRIAL, print, settings="parnas.strategies.par_settings:SEARCH_FORWARDS")
    with pytest.raises(StrategyError, match="must name a frozen dataclass"):
        named.settings_class()


def test_kinds_and_strategies_stand_on_one_registry_base():
    assert isinstance(KINDS, Registry) and isinstance(strategy_registry.STRATEGIES, Registry)
    for registry, example in ((KINDS, "attention"), (strategy_registry.STRATEGIES, PAR)):
        assert registry.names()[0] == example and registry.loaded(example) is registry.get(example)
        unknown = f"^unknown {registry.what} 'nope'; known {registry.plural}: {example}"
        with pytest.raises(registry.error, match=unknown):
            registry.get("nope")
        with pytest.raises(registry.error, match="is built in and cannot be removed"):
            registry.unregister(example)


def test_the_builtin_strategies_reach_their_code_by_imports_the_layer_check_sees():
    """The registry sits below the strategies, whose modules import it: a ``"module:attribute"`` string naming
    their code from the registry would be a loop no import check reports. So the built-ins register through an
    entry point of parnas's own distribution, and every piece of their code is an object, not a string."""
    from importlib import metadata

    from parnas.strategies import builtin

    (ep,) = [ep for ep in metadata.entry_points(group=strategy_registry.BUILTINS)]
    assert ep.load() is builtin.STRATEGIES
    assert [s.name for s in builtin.STRATEGIES] == list(strategy_registry.names())  # no plugin installed here
    for strategy in builtin.STRATEGIES:
        assert strategy_registry.get(strategy.name) is strategy
        assert not any(isinstance(getattr(strategy, f), str) for f in ("run", "check", "settings")), strategy.name
    source = (Path(__file__).parents[2] / "parnas" / "strategy_registry.py").read_text()
    assert not re.search(r"[\"']parnas\.strategies[\w.]*:", source)  # names none of their code


def test_the_references_table_of_search_settings_documents_every_one():
    """docs/reference.md's tables of the ``search:`` and ``search.par-gumbel-darts:`` settings name each setting
    the config holds, and none it does not."""
    from parnas.config import SearchConfig
    from parnas.pick_config import SelectConfig
    from parnas.strategies.par_settings import PARSettings

    text = (ROOT / "docs" / "reference.md").read_text()
    start = text.index("In the\n`search:` section:")
    rows = [line for line in text[start:text.index("**What a block costs.**", start)].splitlines()
            if line.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`([\w.]+)`", row.split(" | ")[0])}
    held = {f.name for f in dataclasses.fields(SearchConfig)} - {"strategy_settings"}
    held |= {f"select.{f.name}" for f in dataclasses.fields(SelectConfig)}
    held |= {f.name for f in dataclasses.fields(PARSettings)} - {"select"}
    assert named == held
