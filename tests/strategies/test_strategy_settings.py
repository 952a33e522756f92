"""A search strategy owns its settings, as a block kind does: ``search.<strategy>.<setting>``, checked before torch
loads; the flat keys of earlier versions still load with one note each; a strategy registered in code declares
its own; and both registries stand on one base."""

import dataclasses
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from parnas import strategy_registry
from parnas.config import Config, load_config
from parnas.config_upgrade import FLAT_SEARCH_SETTINGS, upgrade_config
from parnas.errors import ConfigError
from parnas.kinds.registry import KINDS
from parnas.overrides import from_dict
from parnas.registry import Registry
from parnas.strategies.par_settings import PARSettings
from parnas.strategy_registry import MULTI_TRIAL, SearchStrategy, StrategyError

ROOT = Path(__file__).parents[2]
PAR = strategy_registry.DEFAULT
# a value other than the default for each of PAR's settings that was a flat search key
CHANGED = {"mode": "bilevel", "tau_start": 2.0, "tau_end": 0.5, "tau_schedule": "cosine", "hard": True,
           "forward": "sampled", "arch_weight_decay": 0.01, "arch_warmup_steps": 7, "budget_hinge": "expected",
           "export_samples": 3, "dual_lr": 0.5}


def test_search_config_holds_no_setting_of_one_strategy():
    general = {f.name for f in dataclasses.fields(load_config().search)}
    assert not general & set(FLAT_SEARCH_SETTINGS)
    assert set(CHANGED) == set(FLAT_SEARCH_SETTINGS) <= {f.name for f in dataclasses.fields(PARSettings)}


@pytest.mark.parametrize("key", FLAT_SEARCH_SETTINGS)
def test_each_old_flat_key_still_loads_into_pars_section_with_one_note(key, capsys):
    sets = [f"search.{key}={str(CHANGED[key]).lower()}", "search.latency_budget=0.9"]
    cfg = load_config("tiny", sets)
    assert getattr(cfg.search.settings, key) == CHANGED[key]
    assert cfg == load_config("tiny", [f"search.{PAR}.{key}={str(CHANGED[key]).lower()}", "search.latency_budget=0.9"])
    assert capsys.readouterr().err.splitlines() == [f"parnas: search.{key} is deprecated: use search.{PAR}.{key}"]


def test_an_old_key_goes_to_the_chosen_strategy_that_has_it_and_the_section_wins(capsys):
    cfg = load_config("tiny", ["search.strategy=gumbel-darts", "search.tau_end=0.3", "search.mode=joint"])
    assert cfg.search.settings.tau_end == 0.3 and cfg.search.settings_of(PAR) == PARSettings()
    assert "use search.gumbel-darts.tau_end" in capsys.readouterr().err
    both = load_config("tiny", ["search.tau_end=0.3", f"search.{PAR}.tau_end=0.2"])
    assert both.search.settings.tau_end == 0.2


def test_repo_presets_use_the_new_keys_and_a_checkpoints_old_keys_read_as_new(capsys):
    from parnas.config import presets

    for name in presets():
        load_config(name)
    assert capsys.readouterr().err == ""  # no preset gives an old key
    cfg = load_config("tiny", [f"search.{PAR}.tau_end=0.2", f"search.{PAR}.mode=bilevel"])
    old = cfg.to_dict()
    old["search"] = {k: v for k, v in old["search"].items() if k not in (PAR, "gumbel-darts")}
    old["search"] |= {"tau_end": 0.2, "mode": "bilevel"}  # as a checkpoint of an earlier version holds it
    assert from_dict(Config, old) == cfg
    assert upgrade_config(old, note=False)["search"][PAR] == {"tau_end": 0.2, "mode": "bilevel"}
    assert len(capsys.readouterr().err.splitlines()) == 2


def test_settings_are_checked_and_written_without_torch():
    code = ("import sys; from parnas.config import load_config; "
            f"c = load_config('tiny', ['search.{PAR}.tau_end=0.2', 'search.gumbel-darts.tau_end=0.3']); c.to_dict(); "
            "print(c.search.settings.tau_end, 'torch' in sys.modules, 'nni' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == ["0.2", "False", "False"]


@pytest.mark.parametrize("sets, needle", [
    ([f"search.{PAR}.mode=bilevel", "search.strategy=proxyless"], f"search.{PAR}.mode=bilevel is {PAR}'s setting"),
    ([f"search.{PAR}.forward=sampled", "search.strategy=darts"], f"search.{PAR}.forward=sampled is {PAR}'s"),
    ([f"search.{PAR}.export_samples=3", "search.strategy=tpe"],
     f"search.{PAR}.export_samples=3 is {PAR}'s setting; NNI's tpe exports its own choice"),
])
def test_nnis_strategies_refuse_pars_own_settings_in_one_line(sets, needle):
    cfg = load_config("tiny", sets)
    with pytest.raises(ConfigError, match="^" + needle.replace(".", r"\.")):
        strategy_registry.get(cfg.search.strategy).check_config(cfg, False)
    preset = load_config("wt2-cpu", ["search.strategy=darts"])  # its PAR section: warm-up steps, accepted
    strategy_registry.get("darts").check_config(preset, False)


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
    assert load_config("tiny", ["search.budgeted.draws=900"]).search.settings_of("budgeted").draws == 900  # unused
    for sets, needle in ((["search.budgeted.draws=0"], "search.budgeted.draws must be >= 1, got 0"),
                         (["search.budgeted.drawz=1"], "unknown config key search.budgeted.drawz"),
                         (["search.strategy=budgeted", "search.budgeted.draws=900"],
                          "search.budgeted.draws (900) exceeds train.max_steps")):
        with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
            load_config("tiny", sets)


def test_settings_must_be_a_frozen_dataclass_or_name_one():
    @dataclass
    class Loose:
        x: int = 1

    with pytest.raises(StrategyError, match="settings must be a frozen dataclass"):
        SearchStrategy("loose", MULTI_TRIAL, print, settings=Loose)
    named = SearchStrategy("loose", MULTI_TRIAL, print, settings="parnas.strategies.par_settings:MODES")
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
