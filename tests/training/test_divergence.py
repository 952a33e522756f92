"""A diverged run is a result, not a crash: perplexity is inf where exp overflows; train, retrain, --resume,
evaluate and search end with one line naming the step and train.lr (exit status 2); train's metrics.json is
still written, marked ``diverged``; a diverged search exports nothing and stays a run --resume takes up."""

import json
import math

import pytest

from parnas.cli import main
from parnas.training.evaluation import (
    DIVERGENCE_MARGIN,
    Evaluation,
    diverged,
    divergence,
    divergence_step,
    perplexity,
)

DIVERGING = ("train.lr=30", "train.warmup_steps=0")  # the loss stays finite (about 1e5 nats), the model is lost


def cli(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def settings(corpus, out, *extra):
    sets = [f"data.path={corpus}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "train.max_steps=6",
            "train.eval_every=2", "train.log_every=2", f"train.out_dir={out}", f"search.out_dir={out}",
            "search.penalty_cost=flops", *extra]  # flops: no latency table is timed (a busy machine warns)
    return ["--config", "tiny", *[a for s in sets for a in ("--set", s)]]


def strict_json(path):
    """The file as a reader other than Python's takes it: no NaN or Infinity."""
    def refuse(name):
        raise AssertionError(f"{path} holds {name}, which is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def assert_diverged_line(code, err, lr="30", setting="train.lr"):
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "training diverged at step " in err and f"{setting}={lr}" in err and f"lower {setting}" in err, err


# --- the figures --------------------------------------------------------------------------------------------

def test_perplexity_of_a_huge_loss_is_inf_not_an_overflow_error():
    assert perplexity(1.0) == pytest.approx(math.e)
    assert perplexity(1e5) == math.inf
    assert math.isnan(perplexity(math.nan))
    assert Evaluation(nll=4e5 * 100, tokens=100, seconds=1.0).ppl == math.inf


def test_diverged_means_not_finite_or_clearly_worse_than_a_uniform_guess():
    V = 179
    assert not diverged(math.log(V) + 0.03, V)  # an untrained model sits a little above log(V)
    assert not diverged(3.0, V)
    assert diverged(math.log(V) + DIVERGENCE_MARGIN + 0.01, V)
    assert diverged(123.8, V) and diverged(math.inf, V) and diverged(math.nan, V) and diverged(None, V)


def test_the_step_named_is_where_validation_started_to_stay_diverged():
    V, ok, bad = 1000, 300.0, math.inf
    history = [{"step": 10, "val_ppl": ok}, {"step": 20, "val_ppl": bad}, {"step": 30, "val_ppl": None},
               {"step": 40, "val_ppl": 1e9}]
    assert divergence_step(history, 40, V) == 20
    assert divergence_step([{"step": 10, "val_ppl": bad}, {"step": 20, "val_ppl": ok}], 30, V) == 30  # recovered
    assert divergence_step([], 7, V) == 7


def test_the_line_names_step_reason_and_lr():
    line = str(divergence(123.8, 1000, 40, 3.0))
    assert line.startswith("training diverged at step 40 (the validation loss is 123.8 nats") and "train.lr=3" in line
    assert line.endswith("lower train.lr (or clip with train.clip) and start again")
    assert divergence(6.5, 1000, 40, 3.0) is None


def test_a_search_is_judged_by_its_supernet_and_its_exported_architecture():
    from parnas.strategies.search import search_divergence
    from parnas.strategies.supernet_export import Evaluated

    def result(exported, supernet):
        return Evaluated(6, 0.5, {}, ["attention"], exported, supernet, None, False)

    assert search_divergence(result(300.0, 250.0), 1000, 6, 0.1) is None
    line = str(search_divergence(result(300.0, math.inf), 1000, 6, 30.0))
    assert line.startswith("training diverged at step 6 (the supernet's validation perplexity is not finite")
    line = str(search_divergence(result(1e9, 300.0), 1000, 6, 30.0))
    assert "the exported architecture's validation loss is 20.72 nats" in line and "train.lr=30" in line


def test_the_campaign_tries_divergence():
    from tools.campaign import all_cases

    names = [c.name for c in all_cases() if c.name.startswith("diverged: ")]
    for what in ("train with", "no clipping", "retrain", "--resume", "evaluate", "search"):
        assert any(what in name for name in names), (what, names)


# --- the commands -------------------------------------------------------------------------------------------

def test_a_diverged_train_writes_its_metrics_and_ends_with_one_line_and_so_do_resume_and_evaluate(
        capsys, micro_corpus, tmp_path):
    run = tmp_path / "run"
    code, out, err = cli(capsys, "train", *settings(micro_corpus, run, *DIVERGING))
    assert_diverged_line(code, err)
    metrics = strict_json(run / "metrics.json")
    assert metrics["diverged"] is True and metrics["steps"] == 6
    assert f"at step {metrics['diverged_step']} " in err
    assert metrics["val_ppl"] is None or metrics["val_ppl"] > 1e6
    assert (run / "checkpoints" / "last.ckpt").is_file()

    code, _, again = cli(capsys, "train", *settings(micro_corpus, run, *DIVERGING), "--resume")
    assert_diverged_line(code, again)
    assert again.split(": error: ")[1] == err.split(": error: ")[1]  # the same line
    assert strict_json(run / "metrics.json")["diverged"] is True

    report = tmp_path / "eval.json"
    code, out, evaluated = cli(capsys, "evaluate", run / "checkpoints" / "last.ckpt", "--out", report)
    assert_diverged_line(code, evaluated)
    assert f"at step {metrics['diverged_step']} " in evaluated
    assert strict_json(report)["diverged"] is True


def test_exploding_without_clipping_is_no_silent_151_digit_perplexity(capsys, micro_corpus, tmp_path):
    run = tmp_path / "run"
    code, out, err = cli(capsys, "train", *settings(micro_corpus, run, "train.lr=3", "train.clip=0",
                                                    "train.warmup_steps=0", "train.max_steps=20",
                                                    "train.eval_every=20"))
    assert_diverged_line(code, err, lr="3")
    assert strict_json(run / "metrics.json")["diverged"] is True


def test_a_run_that_learns_is_not_diverged_even_before_it_learns(capsys, micro_corpus, tmp_path):
    """One step with a plain softmax: the untrained model's loss is a little above log(V), which is no divergence."""
    run = tmp_path / "run"
    code, out, err = cli(capsys, "train", *settings(micro_corpus, run, "model.cutoffs=[]", "train.max_steps=1"))
    assert code == 0, err
    metrics = strict_json(run / "metrics.json")
    assert metrics["diverged"] is False and "diverged_step" not in metrics
    report = tmp_path / "eval.json"
    code, out, err = cli(capsys, "evaluate", run / "checkpoints" / "last.ckpt", "--out", report)
    assert code == 0 and "perplexity" in out, err
    assert strict_json(report)["diverged"] is False


def test_retrain_of_a_diverging_layout_says_so(capsys, micro_corpus, tmp_path):
    run = tmp_path / "run"
    code, _, err = cli(capsys, "retrain", "--arch", "transformer-xl", *settings(micro_corpus, run, *DIVERGING))
    assert_diverged_line(code, err)
    assert strict_json(run / "metrics.json")["diverged"] is True


def test_a_diverged_search_exports_nothing_and_resume_says_the_same(capsys, micro_corpus, tmp_path):
    run = tmp_path / "search"
    code, _, err = cli(capsys, "search", *settings(micro_corpus, run, *DIVERGING))
    assert_diverged_line(code, err)
    assert not (run / "architecture.json").exists()
    assert (run / "checkpoints" / "last.ckpt").is_file()  # a run --resume takes up
    code, _, again = cli(capsys, "search", *settings(micro_corpus, run, *DIVERGING), "--resume")
    assert_diverged_line(code, again)
    assert not (run / "architecture.json").exists()


def test_a_search_whose_weights_diverge_at_search_weight_lr_names_that_setting(capsys, micro_corpus, tmp_path):
    """The supernet's weights train at ``search.weight_lr`` where it is set; ``train.lr`` (what the exported
    layout retrains with) is then not what to lower."""
    code, _, err = cli(capsys, "search", *settings(micro_corpus, tmp_path / "search", "search.weight_lr=30",
                                                   "train.warmup_steps=0"))
    assert_diverged_line(code, err, setting="search.weight_lr")
    assert "train.lr" not in err
