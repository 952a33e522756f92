"""What ``make search`` ends with and shows on the way: the summary block (each trial's export and cost, its pick
against the guard, its pictures, the two README retrains) and trials numbered in the order they started."""

import json
import sqlite3
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from parnas.report.experiment_summary import summary_block
from parnas.report.experiments import experiment_trials
from parnas.report.follow import Follower, phase_lines

KINDS = {"A": "attention", "D": "dense", "I": "identity"}


def started_in_order(root: Path, experiment: str, ids: list[str]) -> None:
    """NNI's record of the trials' first events, in ``ids``' order."""
    db = root / experiment / "db"
    db.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(db / "nni.sqlite") as con:
        con.execute("create table TrialJobEvent (trialJobId text, event text)")
        con.executemany("insert into TrialJobEvent values (?, ?)", [(t, "WAITING") for t in ids])


def finished(root: Path, experiment: str, trial: str, layout: str, ratio: float, *, winner_ppl: float,
             guard: str | None, guard_ppl: float | None, verdict: str) -> Path:
    run = root / experiment / "environments" / "local" / "trials" / trial
    run.mkdir(parents=True)
    entrants = [{"architecture": layout, "role": "supernet #1", "val_ppl": [60.0, winner_ppl]}]
    if guard is not None and guard != layout:
        entrants.append({"architecture": guard, "role": "guard", "val_ppl": [61.0, guard_ppl]})
    name = "Transformer-XL" if guard is not None and "I" not in guard else f"the shallower Transformer-XL {guard}"
    selection = {"steps": [300, 600], "entrants": entrants, "winner": layout, "verdict": verdict,
                 "guard": None if guard is None else {"architecture": guard, "name": name}}
    record = {"architecture": {f"block_{i}": KINDS[c] for i, c in enumerate(layout)},
              "search": {"val_ppl": 70.0, "latency": {"ratio": ratio}, "selection": selection}}
    (run / "architecture.json").write_text(json.dumps(record))
    return run


def test_the_summary_says_each_trials_export_its_pick_its_pictures_and_the_readme_retrains(tmp_path):
    started_in_order(tmp_path, "exp", ["zz", "aa"])
    first = finished(tmp_path, "exp", "zz", "ADDDAD", 0.72, winner_ppl=53.1, guard="ADADII", guard_ppl=54.2,
                     verdict="search")
    finished(tmp_path, "exp", "aa", "ADADII", 0.64, winner_ppl=55.0, guard="ADADII", guard_ppl=55.0, verdict="guard")
    text = summary_block("exp", experiment_trials("exp", tmp_path), "wt2-cpu")
    lines = text.splitlines()
    assert lines[1] == ("  trial 1 (zz): exported ADDDAD, 0.72 x Transformer-XL's cost; retrained 53.10 against the "
                        "shallower Transformer-XL ADADII's 54.20 after 600 steps: the guard did not win")
    assert lines[2] == f"    pictures: {first}/{{architecture.png,probabilities.png,probabilities.gif}}"
    assert lines[3].startswith("  trial 2 (aa): exported ADADII, 0.64 x Transformer-XL's cost; the guard won: the "
                               "shallower Transformer-XL ADADII retrained 55.00")
    assert "best: trial 1's ADDDAD (0.72 x Transformer-XL's cost), retrained 53.10" in text
    assert "  parnas retrain --arch found/zz.json --config wt2-cpu --set train.max_steps=3000 --out runs/found" in lines
    assert ("  parnas retrain --arch transformer-xl --config wt2-cpu --set train.max_steps=3000 --out runs/txl"
            in lines)


def test_a_best_export_that_is_transformer_xl_is_said_and_not_compared_with_itself(tmp_path):
    finished(tmp_path, "exp", "t1", "ADADAD", 1.0, winner_ppl=50.0, guard="ADADAD", guard_ppl=50.0, verdict="guard")
    finished(tmp_path, "exp", "t2", "ADADII", 0.7, winner_ppl=53.0, guard="ADADII", guard_ppl=53.0, verdict="guard")
    text = summary_block("exp", experiment_trials("exp", tmp_path), "wt2-cpu")
    assert "(Transformer-XL itself)" in text and "the guard won: Transformer-XL retrained 50.00" in text
    assert "would compare a network with itself; the cheapest layout a trial exported instead: trial 2's ADADII" in text
    assert "--arch found/t2.json" in text and "found/t1.json" not in text


def test_every_trial_exporting_transformer_xl_gives_no_found_retrain(tmp_path):
    finished(tmp_path, "exp", "t1", "ADADAD", 1.0, winner_ppl=50.0, guard="ADADAD", guard_ppl=50.0, verdict="guard")
    text = summary_block("exp", experiment_trials("exp", tmp_path), None)
    assert "no trial exported a cheaper layout" in text and "found/" not in text.replace("--out found/", "")
    assert "  parnas retrain --arch transformer-xl --set train.max_steps=3000 --out runs/txl" in text


def test_trials_are_numbered_in_the_order_they_started_not_by_id(tmp_path):
    started_in_order(tmp_path, "exp", ["zz", "aa"])
    for trial in ("aa", "zz"):  # folders made in id order
        run = tmp_path / "exp" / "environments" / "local" / "trials" / trial
        run.mkdir(parents=True)
        (run / "history.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    follower = Follower("exp", 8080, n_trials=2, max_steps=10, root=tmp_path, status=lambda port: "RUNNING")
    lines = follower.poll()
    assert lines[:2] == ["trial 1 of 2 (zz) started", "trial 2 of 2 (aa) started"]


def test_a_trials_phases_reach_the_terminal_with_its_number(tmp_path):
    run = tmp_path / "exp" / "environments" / "local" / "trials" / "t1"
    run.mkdir(parents=True)
    (run / "trial.stderr").write_text(
        "parnas: training a 1,000-piece SentencePiece tokenizer on x (once)\n"
        "parnas: warning: the latency table was timed 3 times and never steadily (...)\n"
        "Epoch 0: 10%|# | 60/600\r")
    (run / "trial.log").write_text(  # NNI's print hook
        "[2026-12-06 20:26:40] INFO (nni) Connect\n[2026-12-06 20:26:52] PRINT step 50/600, train loss 5.0\n"
        "[2026-12-06 20:27:04] PRINT step 300: validation perplexity 90.00 exported architecture ADADAD, 89.00 "
        "supernet\n[2026-12-06 20:27:16] PRINT final pick, round 1/2: ADADAD (supernet #1) to 300 steps [1/4]\n")
    follower = Follower("exp", 8080, n_trials=1, max_steps=600, root=tmp_path, status=lambda port: "RUNNING")
    lines = follower.poll()
    assert lines[0] == "trial 1 of 1 (t1) started"
    assert lines[1:5] == ["trial 1: step 300: validation perplexity 90.00 exported architecture ADADAD, 89.00 supernet",
                          "trial 1: final pick, round 1/2: ADADAD (supernet #1) to 300 steps [1/4]",
                          "trial 1: training a 1,000-piece SentencePiece tokenizer on x (once)",
                          "trial 1: warning: the latency table was timed 3 times and never steadily (...)"]
    assert not any("train loss" in line for line in lines)
    assert phase_lines(["step 50/600, train loss 5.0"]) == []


def test_the_time_left_counts_the_final_pick(tmp_path):
    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    clock = Clock()
    follower = Follower("exp", 8080, n_trials=1, max_steps=100, root=tmp_path, clock=clock,
                        status=lambda p: "RUNNING", pick_steps=200)
    run = tmp_path / "exp" / "environments" / "local" / "trials" / "t1"
    run.mkdir(parents=True)
    (run / "history.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    follower.poll()
    clock.now = 50.0
    (run / "history.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(51)))
    (line,) = follower.poll()
    # 1 s a supernet step; 50 steps left and the pick's 200 retrain steps at half a step each: 150 s
    assert line.endswith("about 2 min left"), line


def test_the_final_metric_and_the_export_table_carry_the_picks_retrained_perplexities(tmp_path):
    from parnas.strategies.experiment_export import export_experiment, table
    from parnas.strategies.nni_trial import nni_metric
    from parnas.strategies.supernet_export import Evaluated

    probabilities = {f"block_{i}": {"attention": 0.8, "dense": 0.15, "identity": 0.05} for i in range(4)}
    result = Evaluated(600, 0.1, probabilities, ["attention", "dense", "attention", "identity"], 80.0, 79.0, 0.7)
    selection = {"entrants": [{"architecture": "ADAI", "val_ppl": [60.0, 53.1]},
                              {"architecture": "ADII", "val_ppl": [61.0, 54.2]}],
                 "winner": "ADAI", "verdict": "search", "guard": {"architecture": "ADII", "val_ppl": [61.0, 54.2]}}
    metric = nni_metric(result, None, selection)
    assert (metric["default"], metric["retrained_val_ppl"], metric["guard_val_ppl"]) == (80.0, 53.1, 54.2)
    assert list(metric)[:3] == ["default", "architecture", "latency_ratio"] and metric["guard_won"] is False
    assert "retrained_val_ppl" not in nni_metric(result, None)  # an evaluation during the search: no pick yet

    run = finished(tmp_path, "exp", "t1", "ADAI", 0.7, winner_ppl=53.1, guard="ADII", guard_ppl=54.2,
                   verdict="search")
    from parnas.architecture import make_record
    from parnas.config import load_config

    record = json.loads((run / "architecture.json").read_text())
    record = make_record(record["architecture"], load_config("tiny").model, 1000, probabilities=probabilities,
                         search=record["search"])
    (run / "architecture.json").write_text(json.dumps(record))
    rows = export_experiment("exp", root=tmp_path)
    assert rows[0]["retrained_val_ppl"] == 53.1 and rows[0]["guard_val_ppl"] == 54.2
    # the margins are the exported kinds': block_1 exported dense where the supernet preferred attention
    assert rows[0]["margins"]["block_1"] < 0 and rows[0]["overruled"] == ["block_1", "block_3"]
    assert "53.10" in table(rows) and "ADII 54.20" in table(rows)


def test_the_readme_retrains_take_a_found_layout_a_pick_confirmed_over_a_guard_that_retrained_lower(tmp_path):
    """A guard that won its pick is a shallower Transformer-XL: retraining it beside Transformer-XL compares no
    found network, so a found layout that beat its own guard is the one the retrain lines take."""
    started_in_order(tmp_path, "exp", ["g", "f"])
    finished(tmp_path, "exp", "g", "ADADII", 0.72, winner_ppl=53.7, guard="ADADII", guard_ppl=53.7, verdict="guard")
    finished(tmp_path, "exp", "f", "AIIDDI", 0.54, winner_ppl=54.2, guard="AIIIDI", guard_ppl=55.6, verdict="search")
    text = summary_block("exp", experiment_trials("exp", tmp_path), "wt2-cpu")
    assert "best: trial 2's AIIDDI (0.54 x Transformer-XL's cost), retrained 54.20: the best of the layouts a pick " \
           "confirmed over their guard" in text, text
    assert "--arch found/f.json" in text
    (tmp_path / "exp" / "environments" / "local" / "trials" / "f" / "architecture.json").unlink()
    text = summary_block("exp", experiment_trials("exp", tmp_path), "wt2-cpu")
    assert "best: trial 1's ADADII (0.72 x Transformer-XL's cost), retrained 53.70: no pick confirmed" in text, text


def test_the_summary_the_export_table_and_nnis_metric_give_one_perplexity_where_confirming_seeds_ran(tmp_path):
    """The pick judges its winner and guard over the last round and the confirming seeds; every place that shows
    their perplexities shows that mean, so the terminal's summary and `parnas export`'s table never disagree."""
    from parnas.strategies.experiment_export import export_experiment, table
    from parnas.strategies.nni_trial import nni_metric
    from parnas.strategies.supernet_export import Evaluated

    started_in_order(tmp_path, "exp", ["t1"])
    run = finished(tmp_path, "exp", "t1", "ADAI", 0.7, winner_ppl=53.1, guard="ADII", guard_ppl=54.2,
                   verdict="search")
    from parnas.architecture import make_record
    from parnas.config import load_config

    record = json.loads((run / "architecture.json").read_text())
    selection = record["search"]["selection"]
    for entrant, confirmed in zip(selection["entrants"], ([54.1], [55.0])):
        entrant["confirm_val_ppl"] = confirmed  # last rounds 53.1 and 54.2: means 53.6 and 54.6
    probabilities = {f"block_{i}": {"attention": 0.8, "dense": 0.15, "identity": 0.05} for i in range(4)}
    record = make_record(record["architecture"], load_config("tiny").model, 1000, probabilities=probabilities,
                         search=record["search"])
    (run / "architecture.json").write_text(json.dumps(record))
    summary = summary_block("exp", experiment_trials("exp", tmp_path), "wt2-cpu")
    assert "retrained 53.60 against the shallower Transformer-XL ADII's 54.60" in summary, summary
    assert "mean of 2 seeds" in summary
    row = next(r for r in export_experiment("exp", root=tmp_path) if r["trial"] == "t1")
    assert (row["retrained_val_ppl"], row["guard_val_ppl"]) == pytest.approx((53.6, 54.6))
    assert "53.60" in table([row]) and "ADII 54.60" in table([row])
    result = Evaluated(600, 0.1, {}, ["attention", "dense", "attention", "identity"], 80.0, 79.0, 0.7)
    metric = nni_metric(result, None, selection)
    assert (metric["retrained_val_ppl"], metric["guard_val_ppl"]) == pytest.approx((53.6, 54.6))


@pytest.mark.slow  # renders every figure of a run
def test_the_pictures_show_the_export_apart_from_what_the_supernet_preferred_and_no_unread_tau(tmp_path):
    from test_plots import write_run

    from parnas.report.heatmap import progress_label
    from parnas.report.history import load_history
    from parnas.report.plots import architecture_figure, lines_figure, plot_run

    run = tmp_path / "run"
    write_run(run, n_blocks=4, winners=["attention"] * 4)  # the supernet prefers AAAA
    record = json.loads((run / "architecture.json").read_text())
    record["architecture"] = {f"block_{i}": k for i, k in enumerate(["attention", "dense"] * 2)}  # the pick's ADAD
    record["search"].pop("tau_final", None)  # a forward that read no temperature records none
    (run / "architecture.json").write_text(json.dumps(record))
    plot_run(run, tensorboard=False)
    texts = [t.get_text() for t in architecture_figure(load_history(run), record).axes[0].texts]
    assert texts[0] != "" and any(t.startswith("Exported architecture: 4 blocks") for t in texts)
    assert "the supernet preferred AAAA; exported ADAD" in texts
    assert sum(t.startswith("preferred attention") for t in texts) == 2
    assert "supernet's probabilities (softmax \u03b1)" in texts and not any("\u03c4 final" in t for t in texts)
    history = load_history(run)
    record["search"]["tau_final"] = 0.1
    assert any("\u03c4 final 0.1" in t.get_text() for t in architecture_figure(history, record).axes[0].texts)
    assert "tau" in progress_label(history, -1)
    untimed = replace(history, tau=np.full_like(history.tau, np.nan))
    labels = [line.get_label() for ax in lines_figure(untimed).axes for line in ax.get_lines()]
    assert "temperature \u03c4" not in labels and "tau" not in progress_label(untimed, -1)
    assert "temperature \u03c4" in [line.get_label() for line in lines_figure(history).axes[0].get_lines()]


def test_tensorboard_has_no_epoch_card_and_shows_the_first_scalars_first(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from parnas.report.plots import FIRST_SCALARS, log_tensorboard
    from parnas.training.trainer import StepsTakenLogger

    logger = StepsTakenLogger(str(tmp_path), name="tensorboard", version="")
    logger.log_metrics({"epoch": 0.0, "train/loss": 5.0}, step=0)
    logger.log_metrics({"epoch": 0.0}, step=1)
    logger.finalize("success")
    log_tensorboard(tmp_path / "tensorboard", np.zeros((4, 4, 3), dtype=np.uint8), 1)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == ["train/loss"] and "custom_scalars__config__" in events.Tags()["tensors"]
    (charts,) = FIRST_SCALARS.values()
    assert next(iter(charts.values()))[1] == ["train/loss"]  # the loss first, then both perplexities


def test_pareto_gives_coinciding_trials_one_label_and_axes_a_readable_span():
    from parnas.report.pareto import LATENCY_LABEL, MIN_X_SPAN, MIN_Y_SPAN, TrialPoint, pareto_figure

    points = [TrialPoint("MaXZC", 31.94, 1.0, "ADADAD"), TrialPoint("xnguz", 31.95, 1.0, "ADADAD"),
              TrialPoint("other", 33.0, 0.7, "ADDDDD")]
    ax = pareto_figure(points, LATENCY_LABEL, "e").axes[0]
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == ["ADADAD (MaXZC, xnguz)", "ADDDDD (other)"]
    single = pareto_figure(points[:2], LATENCY_LABEL, "e").axes[0]
    (x0, x1), (y0, y1) = single.get_xlim(), single.get_ylim()
    assert x1 - x0 >= MIN_X_SPAN - 1e-9 and y1 - y0 >= MIN_Y_SPAN * 31.9 and x0 < 1.0 < x1


def test_a_guard_the_supernet_picked_too_is_said_to_be_both(tmp_path):
    finished(tmp_path, "exp", "t1", "ADII", 0.5, winner_ppl=50.0, guard="ADII", guard_ppl=50.0, verdict="search")
    text = summary_block("exp", experiment_trials("exp", tmp_path), "wt2-cpu")
    assert "exported ADII, 0.50 x Transformer-XL's cost; the supernet picked the shallower Transformer-XL ADII too: " \
           "retrained 50.00 after 600 steps" in text
