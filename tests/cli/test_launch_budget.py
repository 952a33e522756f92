"""``parnas launch`` refuses an experiment whose trials can draw a latency budget below the cheapest layout of their
space, in one line, before nnictl starts anything; search.yaml's own budgets are within reach."""

from pathlib import Path

import yaml

from parnas.cli import main
from parnas.config import load_config
from parnas.strategies import experiment_budget

REPO = Path(__file__).resolve().parents[2]


def test_search_yaml_gives_its_trials_budgets_cheaper_than_transformer_xl():
    experiment = yaml.safe_load((REPO / "search.yaml").read_text())
    cfg = experiment_budget.trial_config(experiment)
    budgets = experiment_budget.drawn_budgets(experiment, cfg)
    assert budgets and max(budgets) < 1.0 and 0.65 in budgets


def test_a_budget_below_the_cheapest_layout_is_refused_in_one_line_and_nothing_starts(tmp_path, capsys,
                                                                                      monkeypatch):
    monkeypatch.setattr(experiment_budget, "cheapest_ratio", lambda cfg: (0.31, "identity", "a table", None))
    monkeypatch.setenv("NNI_EXPERIMENTS_DIR", str(tmp_path / "experiments"))
    experiment = yaml.safe_load((REPO / "search.yaml").read_text())
    experiment["searchSpace"]["search.par-gumbel-darts.latency_budget"] = {"_type": "choice", "_value": [0.2, 0.65]}
    experiment["experimentWorkingDirectory"] = str(tmp_path / "experiments")
    config = tmp_path / "search.yaml"
    config.write_text(yaml.safe_dump(experiment))
    assert main(["launch", "--config", str(config), "--port", "8743"]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and "search.par-gumbel-darts.latency_budget=0.2" in err, err
    assert "0.31" in err, err
    assert out == "" and not (tmp_path / "experiments").exists()


def test_a_range_is_checked_at_its_lower_end_and_a_fixed_budget_too():
    cfg = load_config("wt2-cpu", ["search.par-gumbel-darts.latency_budget=0.9"])
    ranged = {"searchSpace": {"search.par-gumbel-darts.latency_budget": {"_type": "uniform", "_value": [0.4, 0.9]}}}
    assert experiment_budget.drawn_budgets(ranged, cfg) == [0.4]
    assert experiment_budget.drawn_budgets({"searchSpace": {}}, cfg) == [0.9]


def test_the_table_the_launch_priced_with_is_the_one_its_trials_reuse(tmp_path):
    from tests.training.test_latency_cache import table

    timed = table(spread=0.4, load=3.0)  # never steady: the machine's cache would not keep it
    experiment_budget.share_with_trials(experiment_budget.Checked("checked", timed), tmp_path / "exp")
    reused, _, made_before = experiment_budget.experiment_table(tmp_path / "exp" / "latency", timed.key,
                                                                lambda: table(cost=9.0))
    assert made_before and reused.kinds_ms == timed.kinds_ms
