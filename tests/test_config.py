"""Config: presets, YAML, --set overrides, and errors that name the key."""

import re

import pytest

from parnas.cli import main
from parnas.config import Config, ModelConfig, load_config, presets
from parnas.errors import ConfigError
from parnas.nn.model import TransformerXL
from parnas.overrides import parse_overrides


def test_presets_load_and_set_overrides_win(tmp_path):
    assert {"tiny", "wt2-seed"} <= set(presets())
    cfg = load_config("wt2-seed", ["model.d_model=256", "model.cutoffs=[100, 1000]", "train.lr=1"])
    assert load_config("tiny", ["train.lr=1e-3"]).train.lr == 1e-3
    assert cfg.model.d_model == 256 and cfg.model.cutoffs == (100, 1000)
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.data.vocab_size == 12000  # untouched keys keep the preset's value
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  n_heads: 8\n")
    assert load_config(path).model.n_heads == 8
    assert load_config(None) == Config()


def test_settings_lightning_accepts_pass():
    cfg = load_config("tiny", ["train.precision=bf16-mixed", "train.accelerator=gpu", "train.devices=2"])
    assert (cfg.train.precision, cfg.train.accelerator, cfg.train.devices) == ("bf16-mixed", "gpu", 2)


def test_parse_overrides_nests_and_parses_yaml_values():
    assert parse_overrides(["a.b=3", "a.c=[1, 2]", "d=x"]) == {"a": {"b": 3, "c": [1, 2]}, "d": "x"}


@pytest.mark.parametrize("overrides, names", [
    (["model.d_modle=3"], "model.d_modle"),
    (["extra.x=1"], "extra"),
    (["model.d_model=big"], "model.d_model"),
    (["model.d_model=1.5"], "model.d_model"),
    (["model.n_heads=true"], "model.n_heads"),
    (["model.cutoffs=5"], "model.cutoffs"),
    (["model.d_model=100", "model.n_heads=3"], "divisible"),
    (["model.cutoffs=[2500, 250]"], "increasing"),
    (["model.blocks=[attention, lstm]"], "unknown block kind 'lstm'"),
    (["model.blocks=[attention]"], "model.n_blocks"),
    (["model.d_model=15", "model.n_heads=5"], "even"),
    (["data.seg_len=0"], "data.seg_len"),
    (["data.tokenizer=bytes"], "data.tokenizer"),
    (["train.max_steps=0"], "train.max_steps"),
    (["nokey"], "key=value"),
    (["train.precision=bogus"], "train.precision"),
    (["train.accelerator=tpu"], "train.accelerator"),
    (["train.lr=.inf"], "train.lr must be a finite number"),
    (["search.par-gumbel-darts.tau_start=.inf"], "search.par-gumbel-darts.tau_start must be a finite number"),
    (["search.par-gumbel-darts.tau_end=2"], "search.par-gumbel-darts.tau_end (2.0) must not exceed tau_start"),
    (["search.par-gumbel-darts.forward=both"], "search.par-gumbel-darts.forward must be one of gumbel, fair"),
    (["search.par-gumbel-darts.taus=1"], "unknown config key search.par-gumbel-darts.taus"),
    (["search.par-gumbel-darts=1"], "search.par-gumbel-darts must be a mapping"),
    (["search.darts.tau_end=0.2"], "search.darts: the darts strategy has no settings"),
    (["search.gumbel-darts.tau_end=0"], "search.gumbel-darts.tau_end was removed"),
    (["search.strategy_settings={}"], "give a strategy's settings as search.<strategy>.<setting>"),
    (["search.arch_lr=nan"], "search.arch_lr must be a finite number"),
    (["train.devices=3"], "divisible by the 3 processes"),
    (["train.devices=2", "data.eval_batch_size=3"], "data.eval_batch_size"),
])
def test_bad_settings_raise_one_line_naming_the_problem(overrides, names):
    with pytest.raises(ConfigError, match=re.escape(names)) as err:
        load_config("tiny", overrides)
    assert "\n" not in str(err.value)


def test_unknown_preset_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no config file or preset"):
        load_config("nosuchpreset")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_cutoffs_must_lie_inside_the_vocabulary():
    with pytest.raises(ConfigError, match="vocabulary size 2000"):
        TransformerXL(ModelConfig(cutoffs=(250, 2500)), vocab_size=2000)


def test_configs_are_frozen():
    with pytest.raises(AttributeError):
        ModelConfig().d_model = 3  # type: ignore[misc]


def test_a_pick_that_trains_past_max_steps_says_so_in_one_line_before_the_search(capsys, tmp_path):
    """A 4-step search whose pick would retrain each finalist for 1,000 steps: said at the start, in one line."""
    code = main(["search", "--dry-run", "--config", "tiny", "--set", "train.max_steps=4",
                 "--set", "search.par-gumbel-darts.select.steps=[1000]", "--set", f"search.out_dir={tmp_path}/run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 0 and len(err) == 1, err
    assert "search.par-gumbel-darts.select.steps=[1000] go beyond train.max_steps=4" in err[0], err
    assert "for up to 1,000 steps" in err[0] and not (tmp_path / "run").exists()


def test_a_section_the_user_gives_for_a_strategy_that_does_not_run_is_refused(tmp_path, capsys):
    """A preset's PAR section is its default and stays silent under another strategy; the same section given by
    the user (--set, their own file) would be read by nothing, and is refused in one line naming the strategy."""
    assert load_config("tiny", ["search.strategy=darts"]).search.strategy == "darts"
    own = tmp_path / "own.yaml"
    own.write_text("search:\n  strategy: darts\n  par-gumbel-darts:\n    tau_end: 0.2\n")
    with pytest.raises(ConfigError, match="search.par-gumbel-darts .*this search runs darts"):
        load_config(own)
    assert main(["search", "--dry-run", "--config", "tiny", "--strategy", "darts",
                 "--set", "search.par-gumbel-darts.latency_budget=0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "this search runs darts" in err[0], err
    assert load_config("tiny", ["search.par-gumbel-darts.tau_end=0.2"]).search.settings.tau_end == 0.2
