"""``parnas study`` over every network of a search space, or a census of one too large for that: each network
listed once, a census seeded and spread over the cost range, and the verdicts on the space."""

import json
from itertools import combinations_with_replacement

import pytest

from parnas.cli import main
from parnas.nn.model import blocks_run as network
from tests.study.studies import SEEDS, front_rows, study_args

# --- every network of the space ---------------------------------------------------------------------------------

@pytest.mark.parametrize("candidates, n_blocks, reversible, count", [
    (("attention", "dense", "identity"), 4, False, 1 + 2 + 4 + 8 + 16),
    (("attention", "dense"), 4, False, 16), (("attention", "dense", "identity"), 3, True, 27),
    (("attention", "conv", "dense", "identity"), 3, False, 1 + 3 + 9 + 27)])
def test_every_network_of_a_space_is_listed_once(candidates, n_blocks, reversible, count):
    from itertools import product

    from parnas.study.space import count_networks, space_networks

    listed = space_networks(candidates, n_blocks, reversible)
    assert count_networks(candidates, n_blocks, reversible) == len(listed) == count
    every_layout = {network(kinds, reversible) for kinds in product(candidates, repeat=n_blocks)}
    assert sorted(network(kinds, reversible) for kinds in listed) == sorted(every_layout)  # each exactly once
    assert all(len(kinds) <= n_blocks and set(kinds) <= set(candidates) for kinds in listed)
    assert [len(network(kinds, reversible)) for kinds in listed] == sorted(len(network(k, reversible)) for k in listed)


def space_rows(found_ppls, space):
    rows, found = front_rows(found_ppls, front_std=0.2)
    rows += [{"role": "space", "layout": layout, "latency_ratio": ratio, "val_ppl": ppl, "val_ppl_std": 0.2}
             for layout, ratio, ppl in space]
    return rows, found


def test_the_space_verdicts_rank_the_found_models_and_name_the_network_furthest_below_the_front():
    from parnas.study.space import found_in_space_verdict, space_claim_verdict, space_front_verdict
    from parnas.study.verdicts import _reaches

    space = [("AD", 0.4, 55.0), ("ADD", 0.5, 49.0), ("AAD", 0.6, 43.0), ("ADAD", 0.6, 46.0), ("AADD", 0.7, 43.5),
             ("ADADADAD", 1.0, 40.0), ("D", 0.2, 90.0)]
    rows, found = space_rows([[44.0, 44.4]], space)  # the found models: 44.2 at 0.7x; the front there: 44.0
    line = found_in_space_verdict("budget 0.7", found, rows)
    # no costlier than 0.7x: D, AD, ADD, AAD, ADAD, AADD; AAD (43.0) and AADD (43.5) are better than 44.2
    assert ("2 of the 6 networks no costlier have a lower val ppl; "
            "the best of those is AAD at 0.60x, val ppl 43.00") in line
    assert "+2.8% for the found, beyond the seed spread" in line
    line = space_front_verdict(rows)
    # AAD at 0.6x: 43.0 against ADAD's 46.0 on the front, -6.5%; D is cheaper than the front: not judged
    assert "6 within the front's costs" in line and "furthest below the Transformer-XL front is AAD" in line
    assert "(-6.5%, beyond the seed spread" in line
    assert "3 of 6 lie below the front beyond the seed spread" in line  # ADD, AAD, AADD
    # the claim (TXL's 40.0 within 1% at a step >= 30% shorter): ADADADAD itself is the only one within 1%
    def reaches(ppl, ratio):
        return _reaches(ppl, ratio, 40.0, 0.30)

    line = space_claim_verdict(rows, reaches, 0.01, "at a train step >= 30% shorter")
    assert "0 of 7 reach Transformer-XL's val ppl (40.00) within 1%" in line
    assert line.endswith("the cheapest within 1% is ADADADAD at 1.00x")
    rows.append({"role": "space", "layout": "AADDD", "latency_ratio": 0.65, "val_ppl": 40.3, "val_ppl_std": 0.2})
    line = space_claim_verdict(rows, reaches, 0.01, "at a train step >= 30% shorter")
    assert line.endswith("1 of 8 reach Transformer-XL's val ppl (40.00) within 1% at a train step >= 30% shorter: "
                         "AADDD (40.30 at 0.65x)")
    assert found_in_space_verdict("budget 0.7", found, front_rows([[44.0]])[0]) is None  # no space retrained
    assert space_front_verdict(front_rows([[44.0]])[0]) is None
    rows, found = space_rows([[44.0]], [("D", 0.9, 90.0)])
    assert "none is as cheap as the found models (0.70x)" in found_in_space_verdict("b", found, rows)


@pytest.mark.slow
def test_a_study_of_every_network_retrains_each_once_and_ranks_them_on_each_supernet(small_corpus, tmp_path, capsys):
    out = tmp_path / "study"
    args = [a if a != str(SEEDS) else "1" for a in study_args(small_corpus, out)]  # one search
    assert main([*args, "--set", "model.n_blocks=2", "--space", "all"]) == 0
    capsys.readouterr()
    study = json.loads((out / "study.json").read_text())
    space = [r["layout"] for r in study["rows"] if r["role"] == "space"]
    assert space == ["II", "A", "D", "AA", "AD", "DA", "DD"]  # the space's 7 networks, shallowest first
    runs = {p.name for p in (out / "retrain").iterdir()}
    assert set(space) <= runs and len(runs) == len({r["layout"] for r in study["rows"]})  # each trained once
    ranking = study["ranking"]["budget none, seed 0"]
    assert {"II", "A", "D", "AA", "AD", "DA", "DD"} <= set(ranking["inherited"])  # read off the supernet too
    lines = study["verdicts"]
    assert any(line.startswith("budget none: against every network of the space (7 retrained)") for line in lines)
    assert any(line.startswith("every network of the space (7 retrained") for line in lines)
    assert any(line.startswith("every network of the space: ") and "of 7 reach Transformer-XL's" in line
               for line in lines)


# --- a census of a space too large for every network ------------------------------------------------------------

COSTS = {"attention": 1.0, "dense": 0.3, "conv": 0.5, "identity": 0.0}


def cost_of(kinds):
    return sum(COSTS[k] for k in kinds)


@pytest.mark.parametrize("candidates, n_blocks, reversible", [
    (("attention", "dense", "identity"), 12, False), (("attention", "conv", "dense", "identity"), 10, False),
    (("attention", "dense"), 11, False), (("attention", "dense", "identity"), 9, True)])
def test_a_census_is_seeded_draws_each_network_once_and_spans_the_cost_range(candidates, n_blocks, reversible):
    from parnas.study.space import census_networks, count_networks

    size = 40
    sample = census_networks(candidates, n_blocks, size, COSTS, seed=0, reversible=reversible)
    assert len(sample) == size and len({network(k, reversible) for k in sample}) == size  # distinct networks
    assert all(set(k) <= set(candidates) and len(k) <= n_blocks for k in sample)
    assert not reversible or all(len(k) == n_blocks for k in sample)
    assert census_networks(candidates, n_blocks, size, COSTS, seed=0, reversible=reversible) == sample
    assert census_networks(candidates, n_blocks, size, COSTS, seed=1, reversible=reversible) != sample
    assert count_networks(candidates, n_blocks, reversible) > 1000  # too large for --every-network
    # the space's cost range cut into 40 strata, each that holds networks drawn from: every cost the space holds
    # has a sampled network within a stratum's width (a uniform draw would crowd into the middle costs)
    running = [k for k in candidates if k != "identity" or reversible]
    depths = range(n_blocks + 1) if len(running) < len(candidates) else [n_blocks]
    space = {round(cost_of(c), 9) for d in depths for c in combinations_with_replacement(running, d)}
    width = (max(space) - min(space)) / size
    drawn = [cost_of(k) for k in sample]
    assert all(min(abs(c - d) for d in drawn) <= width + 1e-9 for c in space)


def test_a_census_of_the_whole_space_is_every_network_and_strata_share_the_sample_equally():
    from parnas.study.space import _shares, census_networks, space_networks

    candidates = ("attention", "dense", "identity")
    every = space_networks(candidates, 4)
    assert census_networks(candidates, 4, len(every), COSTS, seed=5) == every  # listed as --every-network lists
    import random

    assert _shares([5, 0, 1, 9], 7, random.Random(0)) == [3, 0, 1, 3]  # equal, none over what it holds
    assert sum(_shares([2, 2, 2], 4, random.Random(0))) == 4


def test_the_space_verdicts_say_they_judge_a_sample():
    from parnas.study.space import EVERY, found_in_space_verdict, space_claim_verdict, space_front_verdict, space_name
    from parnas.study.verdicts import _reaches

    assert space_name(0, 127) == EVERY
    name = space_name(40, 8191)
    assert name == "a sample of 40 of the space's 8,191 networks"
    rows, found = space_rows([[44.0, 44.4]], [("AD", 0.4, 55.0), ("AAD", 0.6, 43.0), ("AADD", 0.7, 43.5)])
    assert found_in_space_verdict("budget 0.7", found, rows, name).startswith(
        f"budget 0.7: against {name} (3 retrained): the found models (val ppl 44.20 at 0.70x): "
        "2 of the 3 networks no costlier have a lower val ppl")
    assert space_front_verdict(rows, name).startswith(f"{name} (3 retrained, 3 within the front's costs)")
    line = space_claim_verdict(rows, lambda p, r: _reaches(p, r, 40.0, 0.3), 0.01, "faster", name)
    assert line.startswith(f"{name}: 0 of 3 reach Transformer-XL's val ppl")


@pytest.mark.slow
def test_a_study_with_a_census_retrains_a_sample_and_says_so(small_corpus, tmp_path, capsys):
    out = tmp_path / "study"
    args = [a if a != str(SEEDS) else "1" for a in study_args(small_corpus, out)]  # one search
    assert main([*args, "--set", "model.n_blocks=2", "--space", "3"]) == 0
    capsys.readouterr()
    study = json.loads((out / "study.json").read_text())
    space = [r["layout"] for r in study["rows"] if r["role"] == "space"]
    assert len(space) == 3 and set(space) <= {"II", "A", "D", "AA", "AD", "DA", "DD"}
    assert {k: study["census"][k] for k in ("networks", "of", "seed")} == {"networks": 3, "of": 7, "seed": 0}
    name = "a sample of 3 of the space's 7 networks"
    assert any(line.startswith(f"budget none: against {name} (3 retrained)") for line in study["verdicts"])
    assert study["val_mem_len"] == 16 and "Val and test ppl at memory 16" in (out / "study.md").read_text()
