"""The search-strategy registry: every strategy registered once, read by the config, the CLI, the study and the
docs; plugins through entry points (the reference's example, installed the way pip installs it); and one clear
line for every mistake."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from parnas import architecture, strategy_registry
from parnas.cli import main
from parnas.config import SearchConfig, load_config
from parnas.errors import ConfigError
from parnas.strategies import nni_specs
from parnas.strategy_registry import MULTI_TRIAL, ONE_SHOT, SearchStrategy, StrategyError

ROOT = Path(__file__).parents[2]


def test_builtins_are_registered_once_with_a_family_and_the_default_is_named():
    names = strategy_registry.names()
    assert names[0] == strategy_registry.DEFAULT == SearchConfig().strategy == "par-gumbel-darts"
    assert len(set(names)) == len(names)
    families = {name: strategy_registry.get(name).family for name in names}
    assert [n for n in names if families[n] == MULTI_TRIAL] == ["random", "regularized-evolution", "tpe", "grid"]
    assert set(families.values()) == {ONE_SHOT, MULTI_TRIAL}


def test_nnis_strategies_are_one_list_that_the_registry_and_the_cli_read(capsys):
    nni = nni_specs.NNI_STRATEGIES
    assert strategy_registry.names()[1:] == tuple(s.name for s in nni)  # every built-in but parnas's own
    for spec in nni:
        registered = strategy_registry.get(spec.name)
        assert (registered.family, registered.what, registered.source) == (spec.family, spec.what,
                                                                           strategy_registry.NNI)
    assert main(["search", "--help"]) == 0
    parser_help = " ".join(capsys.readouterr().out.split())
    assert all(spec.name in parser_help for spec in nni) and "search.NAME.SETTING" in parser_help
    with pytest.raises(StrategyError, match="not one of NNI's"):
        nni_specs.nni_strategy(strategy_registry.DEFAULT)


@pytest.mark.slow
def test_the_dispatch_builds_each_nni_strategy_from_the_list_with_the_runs_settings():
    from nni.nas import strategy as nni_strategy

    from parnas.strategies.nni_strategies import nni_strategy_object

    for spec in nni_specs.NNI_STRATEGIES:
        cfg = load_config("tiny", [f"search.strategy={spec.name}", "search.arch_lr=0.02"])
        made = nni_strategy_object(cfg)
        assert isinstance(made, getattr(nni_strategy, spec.nni_class)), spec
        assert getattr(made, "arc_learning_rate", None) == (0.02 if spec.logits else None)


def test_every_builtin_runs_and_checks_through_its_registered_code():
    for name in strategy_registry.names():
        strategy = strategy_registry.get(name)
        assert callable(strategy.runner())
        cfg = load_config("tiny", [f"search.strategy={name}"])
        strategy.check_config(cfg, False)
        if name != strategy_registry.DEFAULT:  # only parnas's own search resumes
            with pytest.raises(ConfigError):
                strategy.check_config(cfg, True)


def test_the_references_table_is_the_registry():
    text = (ROOT / "docs" / "reference.md").read_text()
    table = text.split("<!-- strategies-table -->\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    rows = [[cell.strip().strip("`") for cell in row.strip("|").split("|")] for row in table]
    assert rows == [[s.name, s.family, s.what, s.source] for s in map(strategy_registry.get, strategy_registry.names())]


def test_config_validation_imports_neither_torch_nor_nni():
    code = ("import sys; from parnas.config import load_config; "
            "load_config('tiny', ['search.strategy=tpe']); print('torch' in sys.modules, 'nni' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("make, needle", [
    (lambda: strategy_registry.register(SearchStrategy("darts", ONE_SHOT, print)),
     "'darts' is already registered (built in)"),
    (lambda: SearchStrategy("mine", "evolutionary", print), "family must be one-shot or multi-trial"),
    (lambda: SearchStrategy("mine", ONE_SHOT, "no_colon"), "run must be a callable or a 'module:attribute' string"),
    (lambda: SearchStrategy("my search", ONE_SHOT, print), "must be letters, digits, '-' and '_'"),
    (lambda: strategy_registry.get("nope"), "unknown search strategy 'nope'; known strategies: par-gumbel-darts"),
    (lambda: strategy_registry.unregister("tpe"), "'tpe' is built in"),
])
def test_bad_registrations_and_lookups_say_what_is_wrong_in_one_line(make, needle):
    with pytest.raises(StrategyError) as info:
        make()
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_an_unknown_strategy_stops_the_command_with_one_line(capsys, tmp_path):
    assert main(["search", "--config", "tiny", "--strategy", "nope", "--set", f"search.out_dir={tmp_path}/s"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "known strategies: par-gumbel-darts" in err
    assert "entry point in group 'parnas.strategies'" in err and not (tmp_path / "s").exists()
    with pytest.raises(ConfigError, match="strategies: give two or more of par-gumbel-darts"):
        from parnas.study.strategy_study import parse_strategies

        parse_strategies("darts,nope")


def test_a_strategy_registered_in_code_is_a_config_value_and_runs_from_the_cli(tmp_path, capsys):
    ran = []

    def run(cfg, *, resume):
        ran.append((cfg.search.strategy, resume))
        chosen = {architecture.label(i): "attention" for i in range(cfg.model.n_blocks)}
        return architecture.make_record(chosen, cfg.model, 500, search={"strategy": "in-code", "steps": 0})

    def check(cfg, resume):
        if resume:
            raise ConfigError("in-code cannot resume")

    strategy_registry.register(SearchStrategy("in-code", MULTI_TRIAL, run, check))
    try:
        assert load_config("tiny", ["search.strategy=in-code"]).search.strategy == "in-code"
        assert main(["search", "--config", "tiny", "--strategy", "in-code", "--resume"]) == 2
        assert "in-code cannot resume" in capsys.readouterr().err
        assert main(["search", "--config", "tiny", "--strategy", "in-code",
                     "--set", f"search.out_dir={tmp_path}"]) == 0
        assert ran == [("in-code", False)] and "architecture AA" in capsys.readouterr().out
    finally:
        strategy_registry.unregister("in-code")
    with pytest.raises(ConfigError, match="unknown search strategy 'in-code'"):
        load_config("tiny", ["search.strategy=in-code"])


# --- plugins: the reference's example (docs/reference.md), installed as pip would -------------------

def reference_example() -> dict[str, str]:
    """The files the reference's strategy plugin example shows, by the path in its marker comment."""
    text = (ROOT / "docs" / "reference.md").read_text()
    blocks = re.findall(r"<!-- strategy-plugin-example: (\S+) -->\n```\w+\n(.*?)```", text, flags=re.S)
    assert [p for p, _ in blocks] == ["pyproject.toml", "parnas_random_layout/__init__.py"]
    return dict(blocks)


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """The example package on sys.path with the dist-info (metadata, entry points) pip writes for it."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    files = reference_example()
    project = tomllib.loads(files["pyproject.toml"])["project"]
    package = tmp_path / "site"
    (package / "parnas_random_layout").mkdir(parents=True)
    (package / "parnas_random_layout" / "__init__.py").write_text(files["parnas_random_layout/__init__.py"])
    info = package / f"parnas_random_layout-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    points = project["entry-points"]["parnas.strategies"]
    (info / "entry_points.txt").write_text("[parnas.strategies]\n" +
                                           "".join(f"{k} = {v}\n" for k, v in points.items()))
    monkeypatch.syspath_prepend(str(package))
    yield package
    strategy_registry.unregister("random-layout")
    sys.modules.pop("parnas_random_layout", None)


def test_a_plugin_strategy_is_known_by_name_before_its_module_is_imported(installed_plugin):
    code = ("import sys; from parnas.config import load_config; from parnas import strategy_registry as r; "
            "load_config('tiny', ['search.strategy=random-layout']); "
            "print('parnas_random_layout' in sys.modules, 'torch' in sys.modules, 'random-layout' in r.names()); "
            "print(r.get('random-layout').family, 'parnas_random_layout' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": f"{installed_plugin}:{ROOT}", "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == ["False", "False", "True", "multi-trial", "True"]


def test_the_plugin_strategy_searches_from_the_cli_and_its_record_is_retrainable(installed_plugin, micro,
                                                                                  tmp_path, capsys):
    sets = [f"data.path={micro}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "model.n_blocks=3",
            f"search.out_dir={tmp_path / 'search'}", "search.random-layout.skip=[identity]"]  # its own setting
    assert main(["search", "--config", "tiny", "--strategy", "random-layout",
                 *(a for s in sets for a in ("--set", s))]) == 0
    record = architecture.read(tmp_path / "search" / "architecture.json")
    assert record["search"]["strategy"] == "random-layout" and len(record["architecture"]) == 3
    assert set(record["architecture"].values()) <= {"attention", "dense"}
    assert architecture.layout_string(architecture.layout(record)) in capsys.readouterr().out
    assert main(["search", "--config", "tiny", "--strategy", "random-layout",
                 "--set", "search.random-layout.skip=[attention, dense, identity]"]) == 2
    assert capsys.readouterr().err.strip().endswith("search.random-layout.skip leaves no candidate to draw")
