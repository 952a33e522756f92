"""``parnas study``: the claim checked end to end on ``tiny``; a rerun skips finished work; bad arguments exit 2."""

import csv
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from parnas import architecture
from parnas.cli import build_parser, main
from parnas.config import load_config
from parnas.config import transformer_xl_layout as transformer_xl
from parnas.nn.model import blocks_run as network
from parnas.nn.model import build_fixed_model
from parnas.study.orderings import random_orderings, sandwich
from parnas.study.plan import make_plan, search_config, settings_record
from parnas.study.verdicts import summarise, verdicts
from tests.nni_stall import STALLED, rerun_on_stall
from tests.study.studies import RANDOM, SEEDS, front_rows, study_args


def letters(kinds):
    return architecture.layout_string(kinds)


def networks_of(layout: str) -> int:
    """How many distinct networks the orderings of ``layout``'s letters make (identity blocks are not run)."""
    rest = layout.replace("I", "")
    return math.factorial(len(rest)) // math.prod(math.factorial(c) for c in Counter(rest).values())


def orderings_of(layout: str) -> int:
    return math.factorial(len(layout)) // math.prod(math.factorial(c) for c in Counter(layout).values())


# --- the layouts a study compares ---------------------------------------------------------------------

def test_sandwich_puts_attention_first_then_dense_then_identity():
    assert letters(sandwich(["identity", "dense", "attention", "dense", "attention"])) == "AADDI"
    assert letters(transformer_xl(5)) == "ADADA"


def test_sandwich_puts_other_mixers_after_attention_and_other_feed_forwards_after_dense():
    kinds = ["identity", "glu", "sqrelu", "dense", "compressive", "conv", "attention", "glu"]
    assert letters(sandwich(kinds)) == "AMCDGGSI"  # compressive, conv: by name


def test_random_orderings_keep_the_counts_avoid_the_found_ones_and_depend_only_on_the_counts():
    found = ("attention", "dense", "identity", "attention", "dense", "dense")
    shuffled = tuple(reversed(found))
    picks = random_orderings(found, 3, exclude=[found, sandwich(found)])
    assert len(set(picks)) == 3 and all(Counter(p) == Counter(found) for p in picks)
    assert found not in picks and sandwich(found) not in picks
    assert random_orderings(shuffled, 3, exclude=[found, sandwich(found)]) == picks  # seeded by the counts
    assert random_orderings(["dense", "dense"], 3, exclude=[["dense", "dense"]]) == [("dense", "dense")]


def test_random_orderings_are_other_networks_not_the_same_one_with_its_identity_blocks_moved():
    """A fixed model does not run its identity blocks: DAIIDD and DAIDID are one network, trained to the same
    loss, so a random ordering must differ from the found one, the sandwich and each other without them
    (under reversible pairs, where a block's place decides its pair, every place counts)."""
    found = ("dense", "attention", "identity", "identity", "dense", "dense")
    picks = random_orderings(found, 2, exclude=[found, sandwich(found)])  # 4 networks, 2 of them excluded
    nets = [network(p) for p in picks]
    assert len(set(nets)) == 2 and not set(nets) & {network(found), network(sandwich(found))}
    assert len(random_orderings(found, 30)) == networks_of(letters(found)) == 4
    assert len(random_orderings(found, 90, reversible=True)) == orderings_of(letters(found)) == 60

    losses, kind = [], {"A": "attention", "D": "dense", "I": "identity"}
    for layout in ("DAIIDD", "DAIDID"):
        torch.manual_seed(0)
        model = build_fixed_model(load_config("tiny").model, 1000, [kind[c] for c in layout])
        x = torch.randint(0, 1000, (2, 9))
        losses.append(model.nll(model(x[:, :-1])[0], x[:, 1:]))
    assert torch.equal(*losses)


# --- end to end -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_study_runs_end_to_end_writes_its_files_and_a_rerun_skips_finished_work(small_corpus, tmp_path, capsys):
    out = tmp_path / "study"
    assert main(study_args(small_corpus, out, "--widths", "16")) == 0
    first = capsys.readouterr().out
    assert "[search 2/2]" in first and "[retrain 1/" in first and "[timing 3/3]" in first

    study = json.loads((out / "study.json").read_text())
    rows = study["rows"]
    found = {s: letters(architecture.layout(architecture.read(out / "search" / f"bnone-s{s}" / "architecture.json")))
             for s in range(SEEDS)}
    txl = [r for r in rows if r["role"] == "transformer-xl"]
    assert len(txl) == 1 and txl[0]["layout"] == "ADAD" and txl[0]["latency_ratio"] == 1.0
    for seed, layout in found.items():
        mine = {role: [r for r in rows if r["seed"] == seed and r["role"] == role] for role in ("found", "sandwich",
                                                                                               "random")}
        assert [r["layout"] for r in mine["found"]] == [layout] and mine["found"][0]["budget"] == "none"
        assert [r["layout"] for r in mine["sandwich"]] == [letters(sandwich(architecture.layout(
            architecture.read(out / "search" / f"bnone-s{seed}" / "architecture.json"))))]
        assert len(mine["random"]) == RANDOM and all(sorted(r["layout"]) == sorted(layout) for r in mine["random"])
        if networks_of(layout) > 2:
            assert not {r["layout"] for r in mine["random"]} & {layout, mine["sandwich"][0]["layout"]}
        assert mine["found"][0]["search_val_ppl"] is not None
    # the front: the shallower Transformer-XL and the narrower one (d_model 16, d_ff 32), retrained and timed
    assert [r["layout"] for r in rows if r["role"] == "front"] == ["AD", "ADAD-d16"]
    narrow = architecture.read(out / "layouts" / "ADAD-d16.json")["model"]
    assert (narrow["d_model"], narrow["d_ff"], narrow["n_heads"]) == (16, 32, 2)
    assert len(rows) == 1 + 2 + SEEDS * (2 + RANDOM)
    assert all(r["network"] == r["layout"].split("-")[0].replace("I", "") for r in rows)  # identities not run
    for seed in range(SEEDS):  # each search's supernet read every retrained layout of its depth
        ranking = study["ranking"][f"budget none, seed {seed}"]
        assert set(ranking["inherited"]) == {r["layout"] for r in rows if r["role"] in ("transformer-xl", "front")
                                             or r["seed"] == seed} - {"ADAD-d16"}  # the supernet has one width
        assert all(p > 1 for p in ranking["inherited"].values())
        assert ranking["tau"] is None or -1 <= ranking["tau"] <= 1
    assert sum("ranking fidelity" in line for line in study["verdicts"]) == SEEDS
    assert sum("Transformer-XL front" in line for line in study["verdicts"]) == 1

    layouts = {r["layout"] for r in rows}
    runs = {p.name: p / "metrics.json" for p in (out / "retrain").iterdir()}
    assert set(runs) == layouts  # every layout trained, each once
    for row in rows:
        metrics = json.loads(runs[row["layout"]].read_text())
        layout, _, width = row["layout"].partition("-d")
        assert metrics["steps"] == 10 and metrics["architecture"] == layout
        assert metrics["config"]["model"]["d_model"] == (int(width) if width else 32)
        assert row["val_ppl"] == metrics["val_ppl"] and row["test_ppl"] == metrics["test_ppl"] > 1
        assert row["train_tokens_per_s"] > 0 and row["inference_tokens_per_s"] > 0 and row["train_step_ms"] > 0
        assert row["generate_token_ms"] > 0 and row["latency_target"] == "train"
        assert row["target_ms"] == row["train_step_ms"]
        assert row["attention"] == row["layout"].count("A")

    with open(out / "study.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["role"], r["layout"]) for r in table] == [(r["role"], r["layout"]) for r in rows]
    assert (out / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "study.md").read_text()
    assert text.count("- budget none:") == 4 and all(r["layout"] in text for r in rows)
    assert study["summary"][0]["seeds"] == SEEDS

    # a rerun skips finished work and resumes what was interrupted after its last checkpoint
    interrupted = [out / "search" / "bnone-s1" / "architecture.json", runs["ADAD"]]
    for path in interrupted:
        path.unlink()
    finished = {p: p.stat().st_mtime_ns for p in [*runs.values(), *(out / "search").glob("*/architecture.json")]
                if p not in interrupted}
    assert main(study_args(small_corpus, out, "--widths", "16")) == 0
    again = capsys.readouterr().out
    assert again.count("done already") == len(finished) and again.count("(resumed)") == 2
    assert {p: p.stat().st_mtime_ns for p in finished} == finished and all(p.is_file() for p in interrupted)
    rerun = json.loads((out / "study.json").read_text())["rows"]
    assert [(r["role"], r["layout"], r["val_ppl"]) for r in rerun] == [(r["role"], r["layout"], r["val_ppl"])
                                                                        for r in rows]


@pytest.mark.slow
def test_candidate_sets_are_searched_side_by_side_against_one_transformer_xl(small_corpus, tmp_path, capsys):
    out = tmp_path / "study"
    sets = ["attention,dense,identity", "attention,conv,dense,glu,identity"]
    args = [a if a != str(SEEDS) else "1" for a in study_args(small_corpus, out)]  # one seed per set
    assert main([*args, *(a for c in sets for a in ("--candidates", c))]) == 0
    assert "[search 2/2] candidates ACDGI, budget none, seed 0: found" in capsys.readouterr().out
    study = json.loads((out / "study.json").read_text())
    assert study["candidate_sets"] == [c.split(",") for c in sets]
    for label, kinds in (("ADI", {"attention", "dense", "identity"}),
                         ("ACDGI", {"attention", "conv", "dense", "glu", "identity"})):
        record = architecture.read(out / "search" / f"{label}-bnone-s0" / "architecture.json")
        assert set(record["search"]["candidates"]) == kinds
        found = [r for r in study["rows"] if r["role"] == "found" and r["candidates"] == label]
        assert [r["layout"] for r in found] == [letters(architecture.layout(record))]
    assert [r["layout"] for r in study["rows"] if r["role"] == "transformer-xl"] == ["ADAD"]
    assert [(s["candidates"], s["budget"]) for s in study["summary"]] == [("ADI", "none"), ("ACDGI", "none")]
    text = (out / "study.md").read_text()
    assert text.count("- candidates ACDGI, budget none:") == 4 and "| candidates | budget |" in text


def test_verdicts_follow_the_numbers():
    def row(role, layout, ppl, ratio, seed=None):
        return {"role": role, "budget": None if seed is None else "0.65", "seed": seed, "layout": layout,
                "val_ppl": ppl, "latency_ratio": ratio, "train_step_ms": 10 * ratio}

    rows = [row("transformer-xl", "ADADAD", 50.0, 1.0)]
    for seed, (layout, ppl) in enumerate([("AAADDI", 50.3), ("AADADI", 50.4)]):
        rows += [row("found", layout, ppl, 0.6, seed), row("sandwich", "AAADDI", 50.3, 0.6, seed),
                 row("random", "DIAADA", 52.0, 0.6, seed), row("random", "IDADAA", 53.0, 0.6, seed)]
    claim, orders, depth, front = verdicts(rows, summarise(rows))
    assert "below the front's costs" in front  # no shallower Transformer-XL was trained: no front to read
    assert "2 of 2 seeds reach" in claim and claim.endswith("-> yes.")
    assert "random orderings in 2 of 2 seeds" in orders and "sandwich ordering in 0 of 1 seeds" in orders
    assert "in 2 of 2 seeds" in depth and "the seeds agree" in depth and "same kind at 4 of 6 depths" in depth
    rows[0]["val_ppl"] = 49.0  # a better Transformer-XL: the claim no longer holds
    claim = verdicts(rows, summarise(rows))[0]
    assert "0 of 2 seeds reach" in claim and "perplexity not within 1%" in claim and "step" not in claim[-30:]
    rows[0]["val_ppl"] = 50.0
    for r in rows:  # judged by the generated token: 1.5x faster is the bar, which 0.7x does not clear
        r.update(latency_target="generate", latency_ratio=0.7 if r["role"] != "transformer-xl" else 1.0)
    claim = verdicts(rows, summarise(rows))[0]
    assert "generated token >= 33% shorter (1.5x faster)" in claim and claim.endswith("not 33% shorter.")
    for r in rows[1:]:
        r["latency_ratio"] = 0.66
    assert verdicts(rows, summarise(rows))[0].endswith("-> yes.")


def test_an_ordering_that_runs_the_found_network_is_not_counted_against_it():
    """IAIIDD and its sandwich ADDIII run one network (A, D, D) and retrain to the same perplexity: that is not a
    sandwich the found order failed to beat."""
    def row(role, layout, ppl):
        return {"role": role, "budget": None if role == "transformer-xl" else "0.65",
                "seed": None if role == "transformer-xl" else 0, "layout": layout,
                "network": layout.replace("I", ""), "val_ppl": ppl, "latency_ratio": 1.0, "train_step_ms": 10.0}

    rows = [row("transformer-xl", "ADADAD", 53.45), row("found", "IAIIDD", 54.88), row("sandwich", "ADDIII", 54.88),
            row("random", "DDIAII", 55.54)]
    orders = verdicts(rows, summarise(rows))[1]
    assert "random orderings in 1 of 1 seeds" in orders, orders
    assert "runs the network of its sandwich ordering in every seed (identity blocks moved: not compared)" in orders
    assert "0 of 0" not in orders, orders


def test_a_rerun_with_other_settings_is_refused(small_corpus, tmp_path, capsys):
    out = tmp_path / "study"
    args = study_args(small_corpus, out)
    overrides = [value for key, value in zip(args, args[1:]) if key == "--set"]
    plan = make_plan("tiny", overrides, SEEDS, "none", out, search_steps=12, retrain_steps=10)
    record = settings_record(plan)
    record["settings"]["train.lr"] = 1.0
    out.mkdir()
    (out / "settings.json").write_text(json.dumps(record))
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.lr=1.0" in err[0] and "another --out" in err[0]


@pytest.mark.slow
def test_a_study_with_a_budget_runs_to_its_ranking(small_corpus, tmp_path):
    """The supernet read back for the ranking is priced by nothing (no budget), and must still build."""
    out = tmp_path / "study"
    args = study_args(small_corpus, out, "--budgets", "0.9", "--seeds", "1", "--random-orderings", "0")
    assert main(args) == 0
    study = json.loads((out / "study.json").read_text())
    assert study["ranking"]["budget 0.9, seed 0"]["inherited"]


def test_the_budgets_of_a_study_are_its_searches_budgets(tmp_path):
    plan = make_plan("tiny", [], 1, "0.6,0.8", tmp_path / "study")
    assert plan.budgets == (0.6, 0.8)
    assert [search_config(plan, s).search.settings.latency_budget for s in plan.searches] == [0.6, 0.8]
    assert not (tmp_path / "study").exists()


def test_a_studys_final_pick_judges_its_finalists_at_the_length_the_study_retrains_them(tmp_path):
    plan = make_plan("wt2-cpu", [], 1, "0.6", tmp_path / "study", search_steps=900, retrain_steps=400)
    assert search_config(plan, plan.searches[0]).search.settings.select.steps == (200, 400)  # not the search's 900
    given = make_plan("wt2-cpu", ["search.par-gumbel-darts.select.steps=[50, 100]"], 1, "0.6", tmp_path / "s",
                      search_steps=900)
    assert search_config(given, given.searches[0]).search.settings.select.steps == (50, 100)  # as given


# --- bad arguments: exit 2, one line, nothing written --------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--budgets", "0"], "(0, 1]"), (["--budgets", "-0.5"], "(0, 1]"), (["--budgets", "1.5"], "(0, 1]"),
    (["--budgets", "fast"], "not a number"), (["--budgets", "nan"], "(0, 1]"), (["--seeds", "0"], "--seeds"),
    (["--config", "no-such-preset"], "no config file or preset"),
    (["--candidates", "attention"], "at least two kinds"),
    (["--candidates", "attention,dense", "--candidates", "attention, dense"], "a set twice"),
    (["--candidates", "attention,warp_drive"], "warp_drive"),
    (["--candidates", "attention,dense", "--set", "search.candidates=[attention,identity]"], "--candidates alone"),
    (["--seeds", "2,0"], "--seeds takes whole numbers >= 1"), (["--steps", "5,x"], "--steps takes whole numbers"),
    (["--widths", "33"], "divisible by model.n_heads"), (["--widths", "16,33"], "divisible by model.n_heads"),
    (["--widths", "wide"], "--widths takes d_model values"), (["--widths", "32"], "model.d_model itself"),
    (["--widths", "0"], "model.d_model must be > 0"),
    (["--set", "search.par-gumbel-darts.budget_hinge=expected"], "search.par-gumbel-darts.budget_hinge was removed"),
    (["--space", "all", "--set", "model.n_blocks=12"], "make 8,191 networks; at most 1000"),
    (["--space", "200", "--set", "model.n_blocks=6"], "--space 200: 6 blocks over attention, dense, identity make "
                                                       "only 127 networks"),
    (["--space", "every"], "--space must be all or a number of networks"), (["--space", "0"], "--space must be >= 1"),
    (["--space", "5", "--candidates", "attention,dense", "--candidates", "attention,identity"], "one search space"),
    (["--set", "model.eval_mem_len=-8"], "model.eval_mem_len must be >= 0"),
])
def test_bad_arguments_exit_2_with_one_line_and_write_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "study"
    assert main(["study", "--config", "tiny", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("parnas study: error:") and message in err[0]
    assert not out.exists()


@pytest.mark.parametrize("given, seeds, steps", [
    ([], (3, 1), (None, None)), (["--seeds", "2,3", "--steps", "600"], (2, 3), (600, 600)),
    (["--steps", "900,600"], (3, 1), (900, 600)), (["--steps", ",600"], (3, 1), (None, 600)),
    (["--steps", "900,"], (3, 1), (900, None)),
])
def test_seeds_and_steps_give_the_searches_and_the_retrains_as_one_pair(given, seeds, steps):
    """One number of --steps is both lengths; an empty side keeps the config's train.max_steps (None)."""
    args = build_parser().parse_args(["study", *given])
    assert args.seeds == seeds and args.steps == steps


def test_verdicts_of_one_seed_without_random_orderings_claim_no_agreement_and_no_random_comparison():
    rows = [{"role": "transformer-xl", "budget": None, "seed": None, "layout": "ADAD", "val_ppl": 50.0,
             "latency_ratio": 1.0, "train_step_ms": 10.0},
            {"role": "found", "candidates": "ACD", "budget": "none", "seed": 0, "layout": "ADCD", "val_ppl": 49.0,
             "latency_ratio": 0.9, "train_step_ms": 9.0},
            {"role": "sandwich", "candidates": "ACD", "budget": "none", "seed": 0, "layout": "ACDD",
             "val_ppl": 49.0, "latency_ratio": 0.9, "train_step_ms": 9.0}]
    claim, orders, depth, _ = verdicts(rows, summarise(rows))
    assert claim.startswith("candidates ACD, budget none: 0 of 1 seeds")
    assert "sandwich ordering in 0 of 1 seeds (random orderings: none trained)" in orders and "0 of 0" not in orders
    assert depth.endswith("-> yes; one seed: agreement across seeds not measured.")


def test_coincident_points_of_the_study_figure_share_one_label():
    from parnas.study.report import _label_groups

    points = {"AIAIAIIIIADD": (163.6, 64.54), "AAAADDIIIIII": (162.7, 64.54), "ADADADADADAD": (286.6, 63.27)}
    assert _label_groups(points) == [(["AIAIAIIIIADD", "AAAADDIIIIII"], (163.6, 64.54)),
                                     (["ADADADADADAD"], (286.6, 63.27))]


# --- the front and ranking fidelity -------------------------------------------------------------------------------

def test_the_front_is_its_pareto_optimal_points_a_worse_costlier_one_is_not_on_it():
    from parnas.study.front import front_points

    rows, _ = front_rows([[42.0]])
    rows.append({"role": "front", "layout": "ADADADADADAD-d64", "latency_ratio": 0.7, "val_ppl": 47.0})  # dominated
    rows.append({"role": "front", "layout": "ADADADADADAD-d96", "latency_ratio": 0.5, "val_ppl": 48.0})
    assert [(x, y) for x, y, _ in front_points(rows)] == [(0.4, 55.0), (0.5, 48.0), (0.6, 46.0), (0.8, 42.0),
                                                           (1.0, 40.0)]


def test_the_front_is_read_at_the_found_models_cost_and_judged_against_the_seed_spread():
    from parnas.study.front import at_cost, front_points, front_verdict

    rows, found = front_rows([[42.0, 42.4]])
    assert at_cost(front_points(rows), 0.7) == (pytest.approx(44.0), None)  # halfway between ADAD and ADADAD
    assert at_cost(front_points(rows), 0.3) is None  # cheaper than the cheapest Transformer-XL: no verdict
    rows.append({"role": "front", "layout": "ADADADADAD", "latency_ratio": 0.9, "val_ppl": 39.0})  # TXL off the front
    assert at_cost(front_points(rows), 0.95) == (39.0, None)  # a costlier budget still buys the 0.9x model
    rows, found = front_rows([[42.0, 42.4]], front_std=0.2)
    assert "below the front (better)" in front_verdict("budget 0.7", found, rows)  # 42.2 vs 44.0, spread ~0.35
    rows, found = front_rows([[43.0, 45.0]], front_std=0.2)
    assert "not distinguishable" in front_verdict("budget 0.7", found, rows)  # 44.0 vs 44.0
    rows, found = front_rows([[47.0, 47.2]], front_std=0.2)
    assert "above the front (worse)" in front_verdict("budget 0.7", found, rows)
    rows, found = front_rows([[42.0]])
    assert "no seed spread" in front_verdict("budget 0.7", found, rows)


def test_kendall_tau_ranks_layouts_and_needs_three():
    from parnas.study.ranking import kendall_tau, padded, ranking_verdict

    retrained = {"ADAD": 40.0, "AADD": 41.0, "DDAA": 45.0, "IIAD": 50.0}
    assert kendall_tau({k: v * 3 for k, v in retrained.items()}, retrained) == pytest.approx(1.0)
    assert kendall_tau(dict(zip(retrained, [4.0, 3.0, 2.0, 1.0])), retrained) == pytest.approx(-1.0)
    assert kendall_tau({"ADAD": 1.0, "AADD": 2.0}, retrained) is None
    assert padded(("attention", "dense"), 4) == ("attention", "dense", "identity", "identity")
    assert "below 0.5" in ranking_verdict("s", {"tau": 0.2, "inherited": retrained})
    assert "below" not in ranking_verdict("s", {"tau": 0.8, "inherited": retrained})
    assert "below" not in ranking_verdict("s", {"tau": 0.4999999999999999, "inherited": retrained})  # 14 of 28 pairs


def test_retrain_seeds_average_the_perplexities_and_keep_each_seeds():
    from parnas.study.measure import over_seeds

    merged = over_seeds([{"val_ppl": 40.0, "test_ppl": 41.0, "steps": 10}, {"val_ppl": 42.0, "test_ppl": None}])
    assert merged["val_ppl"] == 41.0 and merged["val_ppl_seeds"] == [40.0, 42.0] and merged["steps"] == 10
    assert merged["val_ppl_std"] == pytest.approx(2 ** 0.5) and merged["test_ppl"] == 41.0
    assert over_seeds([{"val_ppl": 40.0, "test_ppl": 41.0}])["val_ppl_std"] is None


# --- parnas strategies --------------------------------------------------------------------------------------------

@pytest.mark.slow
@rerun_on_stall
def test_strategies_are_compared_at_an_equal_budget_and_their_finds_retrained(micro, tmp_path, capfd):
    out = tmp_path / "strategies"
    sets = [f"data.path={micro}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "model.n_blocks=2"]
    code = main(["strategies", "par-gumbel-darts,random-oneshot,random", "--config", "tiny",
                 *(a for s in sets for a in ("--set", s)), "--seeds", "1", "--steps", "4,2", "--trials", "2",
                 "--out", str(out)])
    printed = "".join(capfd.readouterr())  # the searches run in processes of their own
    if "search stops there" in printed or "was stopped" in printed:
        pytest.fail(STALLED + printed[-3000:])
    assert code == 0
    study = json.loads((out / "strategies.json").read_text())
    assert [s["strategy"] for s in study["summary"]] == ["par-gumbel-darts", "random-oneshot", "random"]
    for run in study["runs"]:
        record = json.loads(Path(run["record"]).read_text())
        assert record["search"]["strategy"] == run["strategy"] and run["val_ppl"] > 1 and run["cost_ratio"] > 0
        assert (out / "retrain" / run["layout"] / "metrics.json").is_file()
    random = json.loads((out / "search" / "random-s0" / "architecture.json").read_text())["search"]
    assert random["trials"] == 2 and random["steps"] == 2  # 2 trials of 4 // 2 steps: the same 4 steps in all
    assert study["verdicts"][0].startswith("best retrained val ppl:") and (out / "strategies.md").is_file()


def test_strategies_must_be_known_and_at_least_two(tmp_path, capsys):
    for given, needle in (("par-gumbel-darts", "give two or more"), ("darts,nasnet", "unknown: nasnet")):
        assert main(["strategies", given, "--config", "tiny", "--out", str(tmp_path / "s")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err and not (tmp_path / "s").exists()


@pytest.mark.slow
def test_a_study_given_a_latency_table_prices_every_layout_by_it_and_says_whose_costs(small_corpus, tmp_path, capsys):
    """The target device's costs, as the searches had them: each row's ratio is the table's prediction."""
    base = study_args(small_corpus, tmp_path / "unused")
    settings = base[base.index("--config"):base.index("--seeds")]
    table_path = tmp_path / "table.json"
    assert main(["latency", *settings, "--out", str(table_path)]) == 0
    table = json.loads(table_path.read_text())
    table["key"].update(device="Elsewhere GPU", device_type="cuda")
    table["constant_ms"] = {"train": 4.0, "inference": 1.0, "generate": 0.5}
    table["kinds_ms"] = {"attention": {"train": 3.0, "inference": 1.0, "generate": 0.8},
                         "dense": {"train": 1.0, "inference": 0.5, "generate": 0.1},
                         "identity": {"train": 0.0, "inference": 0.0, "generate": 0.0}}
    table_path.write_text(json.dumps(table))
    out = tmp_path / "study"
    args = [a if a != str(SEEDS) else "1" for a in study_args(small_corpus, out)]
    assert main([*args, "--set", f"search.latency_table={table_path}"]) == 0
    capsys.readouterr()
    study = json.loads((out / "study.json").read_text())

    def predicted(layout: str) -> float:
        return 4.0 + 3.0 * layout.count("A") + 1.0 * layout.count("D")

    for row in study["rows"]:
        assert row["latency_ratio"] == pytest.approx(predicted(row["layout"]) / predicted("ADAD"))
        assert row["costs"] == "predicted for Elsewhere GPU"
    timing = study["timing"]
    assert timing["priced_by"]["device"] == "Elsewhere GPU" and set(timing["measured"]) == {"train", "inference",
                                                                                            "generate"}
    assert "predicted for Elsewhere GPU" in study["verdicts"][0]
    assert "timed on Elsewhere GPU" in (out / "study.md").read_text()
    assert main([*args[:-4], "--set", f"search.latency_table={table_path}", "--widths", "16", "--out",
                 str(tmp_path / "other")]) == 2
    assert "--widths cannot be priced" in capsys.readouterr().err
