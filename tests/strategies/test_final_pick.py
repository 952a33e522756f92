"""The search's final pick: short retrains of the supernet's best layouts against the shallower Transformer-XL."""

import itertools
import json
import math
import re
import signal

import pytest
import torch

from parnas.cli import main
from parnas.errors import Interrupted, ParnasError
from parnas.nn.model import blocks_run
from parnas.pick_config import EARLY_VALID_FRACTION
from parnas.strategies import final_pick as pick
from parnas.strategies.costs import CostModel

COSTS = CostModel({"attention": 3.0, "dense": 1.0, "identity": 0.0}, 0.0, "ms", 4)  # Transformer-XL: 8


def micro_search(corpus, *extra: str) -> list[str]:
    """A search of 3 steps on a few kB (char tokenizer), priced by FLOPs (nothing timed)."""
    sets = [f"data.path={corpus}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "train.max_steps=3",
            "search.penalty_cost=flops", *extra]
    return ["search", "--config", "tiny", *[a for s in sets for a in ("--set", s)]]


def test_the_entrants_are_the_most_probable_networks_within_the_budget_each_once():
    blocks = [{"attention": 0.6, "dense": 0.3, "identity": 0.1}] * 2 + [{"attention": 0.1, "dense": 0.5,
                                                                          "identity": 0.4}] * 2

    def logp(kinds):
        return sum(math.log(p[k]) for p, k in zip(blocks, kinds))

    found = pick.most_probable(blocks, COSTS, 0.5, 4)
    assert len(found) == 4 and all(COSTS.ratio(kinds) <= 0.5 for kinds in found)
    networks = [tuple(k for k in kinds if k != "identity") for kinds in found]
    assert len(set(networks)) == len(networks)  # identity blocks elsewhere: the same network, entered once
    best: dict[tuple, float] = {}  # every network within the budget, at its most probable layout
    for kinds in itertools.product(*blocks):
        network = tuple(k for k in kinds if k != "identity")
        if COSTS.ratio(kinds) <= 0.5:
            best[network] = max(best.get(network, -math.inf), logp(kinds))
    assert [logp(kinds) for kinds in found] == pytest.approx(sorted(best.values(), reverse=True)[:4])


@pytest.mark.parametrize("setting, needle", [
    ("search.par-gumbel-darts.select.k=0", "search.par-gumbel-darts.select.k must be >= 1"),
    ("search.par-gumbel-darts.select.steps=[4, 2]",
     "search.par-gumbel-darts.select.steps must be positive and strictly increasing"),
    ("search.par-gumbel-darts.select.rank=inherited", "search.par-gumbel-darts.select.rank was removed"),
    ("search.par-gumbel-darts.select.budget=1.5", "search.par-gumbel-darts.select.budget must be in (0, 1]"),
])
def test_bad_selection_settings_are_refused_in_one_line_with_nothing_written(capsys, tmp_path, setting, needle):
    code = main(["search", "--config", "tiny", "--set", setting, "--set", f"search.out_dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_selection_budget_below_the_cheapest_layout_is_refused_before_anything_is_written(capsys, tmp_path, micro):
    code = main(micro_search(micro, "search.candidates=[attention, dense]",
                             "search.par-gumbel-darts.select.steps=[1, 3]",
                             "search.par-gumbel-darts.select.budget=0.05",
                             f"search.out_dir={tmp_path}/run"))
    err = capsys.readouterr().err
    assert code == 2 and "search.par-gumbel-darts.select.budget 0.05 is out of reach" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_the_early_rounds_judge_by_part_of_the_validation_split_and_the_last_by_all_of_it(tmp_path, micro,
                                                                                         monkeypatch):
    """The last round is judged as ``parnas retrain`` judges the exported layout; the rounds before it, which
    only drop trailing entrants, read a fixed part of the split (``EARLY_VALID_FRACTION``)."""
    import parnas.training.fit

    read = []

    def fit(cfg, model, tokenizer, splits, record, *, resume=False, test=True, valid_fraction=1.0):
        read.append((cfg.train.stop_at or cfg.train.max_steps, test, valid_fraction))
        return {"val_ppl": 100.0 + len(read), "steps": cfg.train.stop_at or cfg.train.max_steps}

    monkeypatch.setattr(parnas.training.fit, "fit", fit)
    assert main(micro_search(micro, "search.par-gumbel-darts.select.k=2",
                             "search.par-gumbel-darts.select.steps=[2, 4]", "search.par-gumbel-darts.select.budget=0.6",
                             f"search.out_dir={tmp_path}")) == 0
    assert {r for r in read if r[0] == 2} == {(2, False, EARLY_VALID_FRACTION)}
    assert {r for r in read if r[0] == 4} == {(4, False, 1.0)}
    assert len(read) >= 4
    selection = json.loads((tmp_path / "architecture.json").read_text())["search"]["selection"]
    assert f"earlier ones on {EARLY_VALID_FRACTION:g} of it" in selection["val_ppl_is"]


def picks_without(guard):
    """``pick.most_probable`` with the networks ``guard`` runs left out (whatever blocks it idles): the
    supernet's picks, for the guard to beat or lose to."""
    most_probable = pick.most_probable
    return lambda probabilities, costs, budget, count: [
        k for k in most_probable(probabilities, costs, budget, count + 1) if blocks_run(k) != blocks_run(guard)][:count]


@pytest.mark.slow
def test_a_better_shallower_transformer_xl_is_exported_and_said(capsys, tmp_path, micro, monkeypatch):
    trained = []

    def retrain(cfg, kinds, round_index, folder, tokenizer, splits):  # the guard trains best
        trained.append((tuple(kinds), round_index))
        return 100.0 if blocks_run(kinds) == blocks_run(guard) else 200.0 + len(trained)

    guard = ["attention", "dense", "identity", "identity"]  # at 0.5 of Transformer-XL's FLOPs
    monkeypatch.setattr(pick, "short_retrain", retrain)
    monkeypatch.setattr(pick, "most_probable", picks_without(guard))
    code = main(micro_search(micro, "search.par-gumbel-darts.select.k=2",
                             "search.par-gumbel-darts.select.steps=[2, 4]", "search.par-gumbel-darts.select.budget=0.6",
                             f"search.out_dir={tmp_path}"))
    out = capsys.readouterr().out
    assert code == 0, out
    record = json.loads((tmp_path / "architecture.json").read_text())
    assert list(record["architecture"].values()) == guard  # exported
    # each rival's perplexity at the round it reached: the finalist's beside the guard's, the first round's apart
    assert re.search(r"^the shallower Transformer-XL ADII beat the search's picks after 4 steps of retraining \(val "
                     r"ppl [A-Z]{4} 20\d\.00 against 100\.00; out after 2 steps \(0\.25 of the validation split\): "
                     r"[A-Z]{4} 20\d\.00\): exported it$",
                     out, flags=re.M), out
    selection = record["search"]["selection"]
    assert selection["verdict"] == "guard" and selection["winner"] == "ADII" and selection["guard"]["val_ppl"][0] == 100
    runners = [e for e in selection["entrants"] if e["role"] != "guard"]
    assert len(runners) == 2 and all(e["val_ppl"] and e["cost_ratio"] <= 0.6 for e in runners)  # recorded
    assert {r for _, r in trained} == {0, 1} and len(trained) == 3 + 2  # three entrants, then the better two
    last = json.loads((tmp_path / "history.jsonl").read_text().splitlines()[-1])
    assert last["architecture"] == "ADII"  # the history ends with what is exported


@pytest.mark.slow
def test_the_guard_goes_on_to_the_last_round_however_its_first_went(capsys, tmp_path, micro, monkeypatch):
    """An early round is a poor judge of the shallower Transformer-XL: it is judged at the longest retrain."""
    trained = []

    def retrain(cfg, kinds, round_index, folder, tokenizer, splits):  # the guard: last at first, then first
        trained.append((folder.name, round_index))
        if blocks_run(kinds) == blocks_run(guard):
            return 300.0 if round_index == 0 else 100.0
        return 200.0 + len(trained)

    guard = ["attention", "dense", "identity", "identity"]
    monkeypatch.setattr(pick, "short_retrain", retrain)
    monkeypatch.setattr(pick, "most_probable", picks_without(guard))
    assert main(micro_search(micro, "search.par-gumbel-darts.select.k=3",
                             "search.par-gumbel-darts.select.steps=[2, 4, 6]",
                             "search.par-gumbel-darts.select.budget=0.6",
                             f"search.out_dir={tmp_path}")) == 0
    selection = json.loads((tmp_path / "architecture.json").read_text())["search"]["selection"]
    assert [r for name, r in trained if name == "ADII"] == [0, 1, 2]  # never cut, though last in the first round
    assert len(trained) == 4 + 3 + 2  # 3 entrants and the guard; the better 2 and the guard; 1 and the guard
    assert selection["verdict"] == "guard" and selection["winner"] == "ADII"


@pytest.mark.slow
def test_an_interrupted_pick_resumes_skipping_finished_retrains_in_an_nnictl_trial(capsys, tmp_path, micro,
                                                                                   monkeypatch):
    import nni

    from parnas.training import fit as fitting

    final = []
    monkeypatch.setenv("NNI_PLATFORM", "local")
    monkeypatch.setenv("NNI_OUTPUT_DIR", str(tmp_path / "trial"))
    monkeypatch.setattr(nni, "get_next_parameter", lambda: {})
    monkeypatch.setattr(nni, "report_intermediate_result", lambda metric: None)
    monkeypatch.setattr(nni, "report_final_result", final.append)
    real, calls = pick.short_retrain, []

    def stopped_at_the_second(*args):
        calls.append(args[3].name)
        if len(calls) == 2:
            raise Interrupted(signal.SIGTERM)
        return real(*args)

    command = micro_search(micro, "search.par-gumbel-darts.select.k=2", "search.par-gumbel-darts.select.steps=[2, 4]",
                           "search.par-gumbel-darts.select.budget=0.6")
    monkeypatch.setattr(pick, "short_retrain", stopped_at_the_second)
    assert main(command) == 128 + signal.SIGTERM
    run = tmp_path / "trial"
    assert not (run / "architecture.json").exists()
    first = calls[0]
    done = json.loads((run / "select" / first / "rounds.json").read_text())

    monkeypatch.setattr(pick, "short_retrain", real)
    trained = []
    real_fit = fitting.fit
    monkeypatch.setattr(fitting, "fit", lambda cfg, *a, **k: trained.append(
        (cfg.train.out_dir.rsplit("/", 1)[-1], cfg.train.stop_at)) or real_fit(cfg, *a, **k))
    capsys.readouterr()
    assert main([*command, "--resume"]) == 0
    assert (first, 2) not in trained  # its first round was read back, not trained again
    record = json.loads((run / "architecture.json").read_text())
    selection = record["search"]["selection"]
    (entry,) = [e for e in selection["entrants"] if e["architecture"] == first]
    assert entry["val_ppl"][0] == round(done["2"], 4)
    assert selection["winner"] == "".join(k[0].upper() for k in record["architecture"].values())
    assert final and final[-1]["architecture"] == selection["winner"]  # what the trial reports is what it exported


@pytest.mark.slow
def test_a_search_resumed_with_the_pick_turned_on_runs_it(tmp_path, micro):
    command = micro_search(micro, "train.max_steps=6", f"search.out_dir={tmp_path}")
    assert main([*command, "--set", "train.stop_at=3"]) == 0  # the pick off (the tiny preset's)
    assert main([*command, "--set", "search.par-gumbel-darts.select.k=1", "--set",
                 "search.par-gumbel-darts.select.steps=[2]", "--resume"]) == 0
    record = json.loads((tmp_path / "architecture.json").read_text())
    assert record["search"]["steps"] == 6 and record["search"]["selection"]["steps"] == [2]


@pytest.mark.slow
def test_an_entrant_whose_training_diverges_is_out_and_the_pick_goes_on(capsys, tmp_path, micro, monkeypatch):
    from parnas.training import fit as fitting

    real_fit, failed = fitting.fit, []

    def first_diverges(cfg, *args, **kwargs):
        if not failed:
            failed.append(cfg.train.out_dir.rsplit("/", 1)[-1])
            raise ParnasError("training diverged at step 2 (the training loss is not finite, train.lr=0.003)")
        return real_fit(cfg, *args, **kwargs)

    monkeypatch.setattr(fitting, "fit", first_diverges)
    code = main(micro_search(micro, "search.par-gumbel-darts.select.k=2", "search.par-gumbel-darts.select.steps=[2]",
                             "search.par-gumbel-darts.select.budget=0.6",
                             f"search.out_dir={tmp_path}"))
    out = capsys.readouterr().out
    assert code == 0, out
    selection = json.loads((tmp_path / "architecture.json").read_text())["search"]["selection"]
    (out_entrant,) = [e for e in selection["entrants"] if e["architecture"] == failed[0]]
    assert out_entrant["val_ppl"] == [None] and selection["winner"] != failed[0]
    assert f"final pick: {failed[0]} diverged" in out


@pytest.mark.slow
def test_a_finished_search_resumed_with_another_pick_replans_it_and_never_follows_a_link(tmp_path, micro, capsys):
    """The supernet is trained once; the pick may be rerun with another ``k``, its old pick discarded. A ``select``
    folder that is a link is refused in one line before any work, and what it points to is kept."""
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    command = micro_search(micro, "train.max_steps=4", "search.par-gumbel-darts.select.k=1",
                           "search.par-gumbel-darts.select.steps=[2]",
                           f"search.out_dir={run}")
    assert main(command) == 0
    (run / "select").rename(elsewhere)
    (run / "select").symlink_to(elsewhere, target_is_directory=True)
    kept = sorted(p.relative_to(elsewhere) for p in elsewhere.rglob("*"))
    (run / "architecture.json").unlink()
    capsys.readouterr()
    assert main([*command, "--set", "search.par-gumbel-darts.select.k=2", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "select: it is a symbolic link" in err[0], err
    assert sorted(p.relative_to(elsewhere) for p in elsewhere.rglob("*")) == kept
    (run / "select").unlink()
    assert main([*command, "--set", "search.par-gumbel-darts.select.k=2", "--resume"]) == 0
    selection = json.loads((run / "architecture.json").read_text())["search"]["selection"]
    assert selection["k"] == 2 and json.loads((run / "select" / "plan.json").read_text())["entrants"]
    ranked = [e for e in selection["entrants"] if e["role"].startswith("supernet")]
    assert 1 <= len(ranked) <= 2


def test_a_guard_the_supernet_picked_too_is_said_to_be_both_when_it_wins():
    from parnas.config import load_config

    cfg = load_config("tiny", ["model.n_blocks=4", "search.par-gumbel-darts.select.steps=[2, 4]"])
    guard = ["attention", "dense", "identity", "identity"]
    both = {**pick._entrant(guard, "supernet #1, guard", COSTS, []), "val_ppl": [60.0, 50.0]}
    other = {**pick._entrant(["dense"] * 4, "supernet #2", COSTS, []), "val_ppl": [70.0, 55.0]}
    record = pick._record(cfg, [both, other], both, 0.6, "search.par-gumbel-darts.latency_budget", 1.0)
    assert record["winner"] == "ADII" and record["verdict"] == "search"
    assert record["verdict_line"] == ("final pick: ADII (val ppl 50.00 after 4 steps of retraining), the shallower "
                                      "Transformer-XL, which the supernet picked too")


@pytest.mark.slow
def test_the_supernet_trains_at_search_weight_lr_and_the_pick_at_train_lr(tmp_path, micro):
    """``search.weight_lr`` is the supernet's; the pick's retrains train as ``parnas retrain`` will, at
    ``train.lr``. Read from the checkpoints' own optimisers."""
    assert main(micro_search(micro, "search.weight_lr=0.02", "train.lr=0.003", "search.par-gumbel-darts.select.k=1",
                             "search.par-gumbel-darts.select.steps=[2]", "search.par-gumbel-darts.select.budget=1.0",
                             f"search.out_dir={tmp_path}")) == 0  # a budget the guard fits: something is retrained

    def peak_lr(path):
        states = torch.load(path, map_location="cpu", weights_only=False)["optimizer_states"]
        return states[0]["param_groups"][0]["initial_lr"]  # the weights' optimiser (the logits' is second)

    assert peak_lr(tmp_path / "checkpoints" / "last.ckpt") == 0.02
    entrants = sorted((tmp_path / "select").glob("*/checkpoints/last.ckpt"))
    assert entrants and all(peak_lr(path) == 0.003 for path in entrants)
    record = json.loads((tmp_path / "architecture.json").read_text())["search"]
    assert record["weight_lr"] == 0.02


@pytest.mark.slow
@pytest.mark.parametrize("confirmed", [True, False])
def test_a_win_over_the_guard_is_confirmed_on_a_further_seed(capsys, tmp_path, micro, monkeypatch, confirmed):
    """One seed is a noisy judge (a layout's seeds spread by up to 3% in PLANER's space): a supernet's layout that
    beats the guard in the last round is exported only if it also does on the mean over a further seed."""
    trained = []

    def retrain(cfg, kinds, round_index, folder, tokenizer, splits):  # entrants beat the guard on the search's seed
        trained.append((folder.name, cfg.train.seed, round_index))
        if blocks_run(kinds) == blocks_run(guard):
            return 100.0
        return 90.0 + len(trained) if cfg.train.seed == 0 else (105.0 if confirmed else 120.0)

    guard = ["attention", "dense", "identity", "identity"]
    monkeypatch.setattr(pick, "short_retrain", retrain)
    monkeypatch.setattr(pick, "most_probable", picks_without(guard))
    code = main(micro_search(micro, "search.par-gumbel-darts.select.k=2",
                             "search.par-gumbel-darts.select.steps=[2, 4]", "search.par-gumbel-darts.select.budget=0.6",
                             "train.seed=0", f"search.out_dir={tmp_path}"))
    out = capsys.readouterr().out
    assert code == 0, out
    selection = json.loads((tmp_path / "architecture.json").read_text())["search"]["selection"]
    finalist = [e for e in selection["entrants"] if e["role"] != "guard" and "confirm_val_ppl" in e]  # the best
    assert len(finalist) == 1 and finalist[0]["confirm_val_ppl"] == [105.0 if confirmed else 120.0]
    assert [e["confirm_val_ppl"] for e in selection["entrants"] if e["role"] == "guard"] == [[100.0]]
    assert sorted(name for name, seed, _ in trained if seed == 1) == sorted([f"{finalist[0]['architecture']}-seed1",
                                                                           "ADII-seed1"])
    assert all(r == 1 for _, seed, r in trained if seed == 1)  # to the last round's steps
    mean = (finalist[0]["val_ppl"][-1] + finalist[0]["confirm_val_ppl"][0]) / 2
    assert f"mean over seeds 0-1: {finalist[0]['architecture']} {mean:.2f} against 100.00" in out
    assert selection["winner"] == (finalist[0]["architecture"] if confirmed else "ADII")
    assert selection["verdict"] == ("search" if confirmed else "guard")


@pytest.mark.slow
def test_no_further_seed_runs_when_the_guard_wins_or_confirm_seeds_is_0(tmp_path, micro, monkeypatch):
    trained = []

    def retrain(cfg, kinds, round_index, folder, tokenizer, splits):
        trained.append(cfg.train.seed)
        return 90.0 if blocks_run(kinds) != blocks_run(guard) else 100.0

    guard = ["attention", "dense", "identity", "identity"]
    monkeypatch.setattr(pick, "short_retrain", retrain)
    monkeypatch.setattr(pick, "most_probable", picks_without(guard))
    assert main(micro_search(micro, "search.par-gumbel-darts.select.k=2",
                             "search.par-gumbel-darts.select.steps=[2, 4]", "search.par-gumbel-darts.select.budget=0.6",
                             "search.par-gumbel-darts.select.confirm_seeds=0", f"search.out_dir={tmp_path}")) == 0
    assert set(trained) == {0}
    selection = json.loads((tmp_path / "architecture.json").read_text())["search"]["selection"]
    assert selection["verdict"] == "search" and selection["confirm_seeds"] == 0


def test_the_guard_is_named_transformer_xl_when_it_keeps_every_block():
    """The full network is Transformer-XL, not "the shallower" one; the record's verdict names it so."""
    from parnas.config import load_config

    assert pick.guard_name(["attention", "dense", "attention", "dense"]) == "Transformer-XL"
    assert pick.guard_name(["attention", "dense", "identity", "identity"]) == "the shallower Transformer-XL ADII"
    cfg = load_config("tiny", ["model.n_blocks=4", "search.par-gumbel-darts.select.steps=[2, 4]"])
    full = {**pick._entrant(["attention", "dense"] * 2, "guard", COSTS, []), "val_ppl": [60.0, 50.0]}
    other = {**pick._entrant(["dense"] * 4, "supernet #1", COSTS, []), "val_ppl": [70.0, 55.0]}
    record = pick._record(cfg, [other, full], full, 1.0, "search.par-gumbel-darts.latency_budget", 1.0)
    assert record["verdict"] == "guard" and record["guard"]["name"] == "Transformer-XL"
    assert record["verdict_line"].startswith("Transformer-XL beat the search's picks")
    assert "shallower" not in record["verdict_line"]


def test_without_a_budget_or_a_penalty_the_prices_still_choose_the_pick_so_the_table_is_timed():
    """A search with no latency budget and no penalty still times its latency table (pricing.cost_model): the final
    pick admits entrants within the exported layout's cost and guards with the deepest Transformer-XL within it, so
    the prices change what is exported (all-equal prices would guard with the full Transformer-XL)."""
    from parnas.config import load_config
    from parnas.strategies.par_settings import par_settings

    cfg = load_config("tiny", ["search.par-gumbel-darts.select.steps=[2, 4]"])
    assert par_settings(cfg.search).latency_budget is None and par_settings(cfg.search).penalty_weight == 0
    exported = ["attention", "dense", "dense", "identity"]  # (3 + 1 + 1) / 8 of Transformer-XL's cost
    budget, source = pick.selection_budget(cfg, COSTS, exported)
    assert budget == pytest.approx(5 / 8) and source == "the cost of the layout the supernet exports"
    candidates = ["attention", "dense", "identity"]
    assert pick.guard_layout(COSTS, 4, candidates, budget) == ["attention", "dense", "identity", "identity"]
    unpriced = CostModel(dict.fromkeys(candidates, 1.0), 0.0, "unit", 4)
    free_budget, _ = pick.selection_budget(cfg, unpriced, exported)
    assert pick.guard_layout(unpriced, 4, candidates, free_budget) == ["attention", "dense"] * 2
