"""``parnas table score RUN --table FILE``: a search judged against a ranking table without retraining: the
correlations, the top-5 overlap and the regret at each budget follow the numbers; a table of another space,
vocabulary or model, and a run without a supernet checkpoint, are refused in one line with nothing written."""

import json

import pytest

from parnas import architecture
from parnas.cli import main
from parnas.study.score import (
    BUDGETS,
    VALID_FRACTION,
    correlations,
    exported_pick,
    ranked_pick,
    regret,
    score,
    score_lines,
    top_overlap,
)
from parnas.study.table import config_section, load_table, table_record
from parnas.training import checkpoint


def refusal(err: str) -> str:
    """The one line a refused command prints (a deprecated setting's note aside); fails on more."""
    lines = [line for line in err.strip().splitlines() if "deprecated" not in line]
    assert len(lines) == 1, err
    return lines[0]

CANDIDATES = ("attention", "dense", "identity")
MODES = ("train", "inference", "generate")


def test_regret_is_the_gap_to_the_best_layout_no_costlier_in_perplexity_percent_and_seed_spreads():
    ppl = {"a": 10.0, "b": 12.0, "c": 11.0, "d": 9.0}
    costs = {"a": 0.5, "b": 0.6, "c": 0.4, "d": 0.9}
    spreads = {"a": 0.3, "b": 0.4, "c": None, "d": 0.1}
    r = regret("b", ppl, costs, spreads)
    assert (r["best"], r["regret"]) == ("a", 2.0)  # d is better but costlier: not counted
    assert r["regret_percent"] == pytest.approx(20.0) and r["regret_spreads"] == pytest.approx(2.0 / 0.5)
    assert regret("c", ppl, costs, spreads)["regret"] == 0.0 == regret("c", ppl, costs, spreads)["regret_spreads"]
    assert regret("zz", ppl, costs, spreads) is None and regret(None, ppl, costs, spreads) is None
    assert r["within_budget"] is None  # no budget given: only the figure at its own cost


def test_a_cheap_export_beaten_by_a_network_within_the_budget_has_regret_within_it_though_none_at_its_cost():
    """The issue's case: at budget 0.65 the export ADD (cheaper) lies above AAD, the best within the budget."""
    ppl = {"ADD": 50.5, "AAD": 50.0, "ADA": 52.0, "AAA": 48.0}
    costs = {"ADD": 0.5, "AAD": 0.62, "ADA": 0.62, "AAA": 1.0}
    spreads = {"ADD": 0.3, "AAD": 0.4, "ADA": 0.2, "AAA": 0.1}
    r = regret("ADD", ppl, costs, spreads, budget=0.65)
    assert (r["best"], r["regret"]) == ("ADD", 0.0)  # nothing cheaper beats it: today's figure says 0
    w = r["within_budget"]
    assert (w["budget"], w["best"], w["regret"]) == (0.65, "AAD", 0.5)  # AAA is better but over the budget
    assert w["regret_percent"] == pytest.approx(1.0) and w["regret_spreads"] == pytest.approx(0.5 / 0.5)
    assert regret("AAD", ppl, costs, spreads, budget=0.65)["within_budget"]["regret"] == 0.0
    line = score_lines({**BASE, "budgets": {"0.65": {"ranked": regret("AAD", ppl, costs, spreads, 0.65),
                                                     "exported": r, "exported_layout": "ADD"}}})[-1]
    assert line == ("t: budget 0.65 (train step), exported ADD (0.50x, val ppl 50.50): regret within budget 0.65 "
                    "+0.50 (+1.0%, 1.0 seed spreads) against AAD (0.62x, val ppl 50.00); regret at its own cost "
                    "+0.00 (+0.0%, 0.0 seed spreads) against ADD (0.50x, val ppl 50.50)")
    assert regret("AAA", ppl, costs, spreads, budget=0.65)["within_budget"]["regret"] == -2.0  # over it, better


BASE = {"table": "t", "layouts": 3, "top": 5, "top_overlap": 1, "kendall_tau": 0.35, "spearman_rho": 0.6,
        "noise_ceiling": 0.7, "seeds": 5, "valid_fraction": 0.125, "target": "train", "exports": True,
        "budgets": {}, "run_budget": 0.65}


def test_kendall_tau_is_printed_beside_the_tables_noise_ceiling_and_its_share_of_it():
    (line, _) = score_lines(BASE)
    assert line == ("t: Kendall tau 0.35, Spearman rho 0.60 between inherited-weight val ppl (first 1/8 of the "
                    "validation split) and retrained val ppl over 3 layouts; noise ceiling 0.70, the Kendall tau "
                    "between the means of the table's even- and odd-numbered retrain seeds (up to 5 a layout), "
                    "0.50 of it")
    assert score_lines({**BASE, "noise_ceiling": None})[0].endswith(
        "no noise ceiling: the table has too few layouts with two or more retrain seeds")


def test_the_layout_a_final_pick_exported_is_scored_in_one_line_and_one_the_table_lacks_said():
    base = BASE
    final = regret("b", {"a": 10.0, "b": 12.0, "c": 9.0}, {"a": 0.5, "b": 0.6, "c": 0.65}, {"a": 0.3, "b": 0.4,
                                                                                         "c": None}, 0.65)
    (line,) = score_lines({**base, "final_layout": "IB", "final": final})[2:]
    assert line == ("t: exported after the final pick (the run's budget 0.65) b (0.60x, val ppl 12.00): regret "
                    "within budget 0.65 +3.00 (+33.3%, 7.5 seed spreads) against c (0.65x, val ppl 9.00); regret "
                    "at its own cost +2.00 (+20.0%, 4.0 seed spreads) against a (0.50x, val ppl 10.00)")
    assert score_lines({**base, "final_layout": "ZZ", "final": None})[2:] == [
        "t: exported after the final pick ZZ: not in the table"]
    assert len(score_lines({**base, "final_layout": None, "final": None})) == 2  # no pick: no line


def test_the_ranked_pick_is_the_supernets_best_within_the_budget_and_the_top_overlap_counts_shared_bests():
    inherited = {"a": 3.0, "b": 1.0, "c": 2.0}
    costs = {"a": 0.4, "b": 0.9, "c": 0.6}
    assert [ranked_pick(inherited, costs, b) for b in (0.3, 0.5, 0.65, 1.0)] == [None, "a", "c", "b"]
    assert top_overlap(inherited, {"a": 1.0, "b": 2.0, "c": 3.0}, top=1) == 0
    assert top_overlap(inherited, {"a": 1.0, "b": 2.0, "c": 3.0}, top=2) == 1
    assert correlations(inherited, {"a": 30.0, "b": 10.0, "c": 20.0}) == pytest.approx((1.0, 1.0))
    assert correlations(inherited, {"a": 10.0, "b": 30.0, "c": 20.0}) == pytest.approx((-1.0, -1.0))
    assert correlations(inherited, {"a": 1.0, "b": 2.0}) == (None, None)


class Priced:
    """A table's latency part: attention 3 ms a block, dense 1, identity 0, 2 ms constant."""

    n_blocks = 2
    modes = MODES
    latency = None

    def __init__(self):
        from parnas.training.latency_table import LatencyTable

        self.latency = LatencyTable({"device": "x", "model": {}}, dict.fromkeys(MODES, 2.0),
                                    {"attention": dict.fromkeys(MODES, 3.0), "dense": dict.fromkeys(MODES, 1.0),
                                     "identity": dict.fromkeys(MODES, 0.0)}, 2)


def test_the_exported_pick_is_the_argmax_or_the_most_probable_layout_within_the_budget():
    probabilities = [{"attention": 0.6, "dense": 0.3, "identity": 0.1}, {"attention": 0.5, "dense": 0.4,
                                                                        "identity": 0.1}]
    table = Priced()  # Transformer-XL (AD) costs 6; AA 8, DA 6, DD 4, DI 3
    assert exported_pick(probabilities, table, "train", 1.5) == ["attention", "attention"]
    assert exported_pick(probabilities, table, "train", 0.8) == ["dense", "dense"]  # AI costs 5/6: over it
    assert exported_pick(probabilities, table, "train", 0.3) is None  # nothing costs less than the constant


# --- a tiny search, scored ------------------------------------------------------------------------------------

SETTINGS = ["model.cutoffs=[20, 40]", "model.n_blocks=2", "data.tokenizer=char", "search.penalty_cost=flops",
            "train.max_steps=4", "data.eval_batch_size=16"]
LAYOUTS = ["II", "AI", "DI", "AA", "AD", "DA", "DD"]  # every network of 2 blocks, shallower ones padded


@pytest.fixture(scope="module")
def searched(micro, tmp_path_factory):
    """A finished 4-step search of 2 blocks over attention, dense and identity, and its supernet's inherited val
    ppl of every layout of the space."""
    from parnas.config import Config
    from parnas.overrides import from_dict
    from parnas.strategies.search import inherited_perplexities

    run = tmp_path_factory.mktemp("search") / "run"
    args = [a for s in [f"data.path={micro}", *SETTINGS, f"search.out_dir={run}"] for a in ("--set", s)]
    assert main(["search", "--config", "tiny", *args]) == 0
    meta = checkpoint.load(run / "checkpoints" / "last.ckpt")["parnas"]
    cfg = from_dict(Config, meta["config"])
    kinds = {"A": "attention", "D": "dense", "I": "identity"}
    inherited = inherited_perplexities(run, cfg, [[kinds[c] for c in k] for k in LAYOUTS], fraction=VALID_FRACTION)
    vocab = {k: meta["tokenizer"][k] for k in ("kind", "vocab_size", "sha256")}  # the tokenizer's identity
    return run, cfg, vocab, inherited


def make_table(tmp_path, searched, ppl, name="table.json", **changes):
    """A table of the searched space whose layouts' val ppl are ``ppl`` (two seeds, 1% apart)."""
    run, cfg, vocab, _ = searched
    latency = Priced().latency.to_dict()
    seeds = {k: [p, p * 1.01] for k, p in ppl.items()}
    data = table_record("tiny-adi2", CANDIDATES, cfg, config_section(cfg, "tiny", SETTINGS, vocab), latency, seeds)
    for key, value in changes.items():
        section, _, field = key.partition(".")
        if field:
            data[section] = {**data[section], field: value}
        else:
            data[key] = value
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


@pytest.mark.slow
def test_a_table_ranked_as_the_supernet_ranks_scores_a_perfect_ranking_and_no_regret(searched, tmp_path, capsys):
    run, _, _, inherited = searched
    agreeing = make_table(tmp_path, searched, {k: 2 * inherited[k] for k in LAYOUTS})
    before = set(run.rglob("*"))
    said = []
    result = score(run, agreeing, log=said.append, progress_every_s=0)  # a progress line after every layout
    assert [line.split(" layouts")[0].strip() for line in said if "layouts evaluated" in line] == [
        f"{k}/{len(LAYOUTS)}" for k in range(1, len(LAYOUTS))]  # none after the last: the figures follow
    assert result["kendall_tau"] == pytest.approx(1.0) and result["spearman_rho"] == pytest.approx(1.0)
    assert result["top_overlap"] == 5 and result["noise_ceiling"] == pytest.approx(1.0)
    assert set(result["budgets"]) == {f"{b:g}" for b in BUDGETS}
    table = load_table(agreeing)
    for budget, picks in result["budgets"].items():
        ranked = picks["ranked"]
        assert ranked["within_budget"]["regret"] == pytest.approx(0.0)  # the best within it, as the table says
        assert ranked["regret"] == pytest.approx(0.0) and table.cost_ratio(ranked["layout"], "train") <= float(budget)
        exported = picks["exported"]  # the run wrote architecture.json: its softmax(alpha) exports a layout
        assert exported is None or exported["regret"] >= 0
    (cache,) = set(run.rglob("*")) - before  # nothing written but the perplexities' cache
    assert cache.parent == run and cache.name.startswith("inherited-ppl-")
    said.clear()
    again = score(run, agreeing, log=said.append, progress_every_s=0)  # the same checkpoint: nothing evaluated
    assert f"{len(LAYOUTS)} from {cache.name}, 0 to evaluate" in said[0] and not any("evaluated (" in x for x in said)
    assert again["inherited"] == result["inherited"]
    cache.write_text(cache.read_text().replace(str(result["inherited"]["AD"]), "1.5"))  # an edited figure
    said.clear()
    assert score(run, agreeing, log=said.append)["inherited"] == result["inherited"]  # not read: evaluated again
    assert said[0] == f"warning: {cache} failed its checks: not read, written anew" and "0 from" in said[1]

    reversed_ = make_table(tmp_path, searched, {k: 1000 / inherited[k] for k in LAYOUTS}, name="reversed.json")
    assert main(["table", "score", str(run), "--table", str(reversed_), "--set", "train.threads=1"]) == 0
    out = capsys.readouterr().out
    assert "threads: 1 (train.threads=1)" in out  # it runs models: as many threads as the run's config says
    assert "Kendall tau -1.00, Spearman rho -1.00" in out and "over 7 layouts" in out
    assert "budget 0.65 (train step), ranked" in out and "budget 0.65 (train step), exported" in out
    ranked = sorted(LAYOUTS, key=inherited.get)  # the table's 5 best are the supernet's 5 worst: 3 of 7 are both
    assert len(set(ranked[:5]) & set(ranked[-5:])) == 3 and "top 5: 3 of the table's 5 best" in out


@pytest.mark.slow
@pytest.mark.parametrize("change, message", [
    ({"space.n_blocks": 3}, "searched 2 blocks over attention, dense, identity; the table's space is 3 blocks"),
    ({"config.vocab": {"kind": "char", "vocab_size": 88, "sha256": "0" * 64}}, "has another vocabulary"),
    ({"config.seg_len": 999}, "data.seg_len"),
])
def test_a_table_of_another_space_vocabulary_or_model_is_refused_in_one_line(searched, tmp_path, capsys, change,
                                                                           message):
    run = searched[0]
    table = make_table(tmp_path, searched, {k: 10.0 + i for i, k in enumerate(LAYOUTS)}, **change)
    if "space.n_blocks" in change:  # a deeper space's layouts
        data = json.loads(table.read_text())
        data["layouts"] = {k + "I": v for k, v in data["layouts"].items()}
        table.write_text(json.dumps(data))
    assert main(["table", "score", str(run), "--table", str(table)]) == 2
    assert message in refusal(capsys.readouterr().err)


@pytest.mark.slow
def test_a_table_of_another_model_and_a_run_without_a_supernet_are_refused(searched, tmp_path, capsys):
    run, cfg, _, _ = searched
    model = {**config_section(cfg, None, [], {})["model"], "d_model": 64, "mem_len": 99}
    table = make_table(tmp_path, searched, {k: 10.0 + i for i, k in enumerate(LAYOUTS)}, **{"config.model": model})
    assert main(["table", "score", str(run), "--table", str(table)]) == 2
    assert "another model than the table's: model.d_model 64 (table) vs 32 (run)" in refusal(capsys.readouterr().err)
    empty = tmp_path / "no-run"
    empty.mkdir()
    good = make_table(tmp_path, searched, {k: 10.0 + i for i, k in enumerate(LAYOUTS)}, name="good.json")
    assert main(["table", "score", str(empty), "--table", str(good)]) == 2
    assert "holds no supernet checkpoint" in refusal(capsys.readouterr().err) and not any(empty.iterdir())
    assert architecture.read(run / "architecture.json")  # the scored run is left as it was


def test_an_exported_layout_is_found_in_the_table_as_the_network_it_runs():
    """A fixed model skips identity blocks, so IAID is the network the table keeps as ADII."""
    from parnas.study.score import table_layout

    layouts = ["AIII", "ADII", "DAII", "DIDD", "DDDI"]
    assert table_layout("IAID", layouts) == "ADII"
    assert table_layout("DIDD", layouts) == "DIDD"  # the table's own key first
    assert table_layout("IIID", layouts) == "IIID"  # a network the table lacks stays itself (no regret)
