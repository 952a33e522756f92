"""``search.par-gumbel-darts.export_samples``: the exported architecture is the best, by inherited-weight validation
perplexity, of the argmax and layouts drawn from softmax(alpha)."""

import json

import pytest

from parnas.cli import main
from parnas.strategies.supernet_export import sample_layouts

PROBS = [{"attention": 0.5, "dense": 0.3, "identity": 0.2}] * 4


def test_drawn_layouts_are_distinct_reproducible_and_skip_the_excluded():
    argmax = ["attention"] * 4
    drawn = sample_layouts(PROBS, 6, seed=0, exclude=[argmax])
    assert len(drawn) == 6 and len({tuple(d) for d in drawn}) == 6 and argmax not in drawn
    assert sample_layouts(PROBS, 6, seed=0, exclude=[argmax]) == drawn
    assert sample_layouts(PROBS, 6, seed=1, exclude=[argmax]) != drawn
    peaked = [{"attention": 1.0, "dense": 0.0}, {"attention": 0.0, "dense": 1.0}]
    assert sample_layouts(peaked, 5, seed=0) == [["attention", "dense"]]  # only one layout can be drawn


@pytest.mark.slow
def test_a_search_exports_the_best_of_its_argmax_and_the_drawn_layouts(micro, tmp_path, capsys):
    sets = [f"data.path={micro}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "model.n_blocks=3",
            "train.max_steps=6", "train.eval_every=6", "search.log_every=3", "search.penalty_cost=flops",
            "search.par-gumbel-darts.export_samples=5", f"search.out_dir={tmp_path / 'search'}"]
    assert main(["search", "--config", "tiny", *(a for s in sets for a in ("--set", s))]) == 0
    capsys.readouterr()
    record = json.loads((tmp_path / "search" / "architecture.json").read_text())
    search, exported = record["search"], "".join(k[0].upper() for k in record["architecture"].values())
    tried = search["sampled"]
    assert tried[0]["architecture"] == search["argmax"] and not tried[0]["drawn"]
    assert 2 <= len(tried) <= 6 and all(t["drawn"] for t in tried[1:])
    assert len({t["architecture"] for t in tried}) == len(tried)
    best = min(tried, key=lambda t: t["val_ppl"])
    assert exported == best["architecture"] and search["val_ppl"] == pytest.approx(best["val_ppl"], abs=1e-3)
    last = json.loads((tmp_path / "search" / "history.jsonl").read_text().splitlines()[-1])
    assert last["architecture"] == exported  # the history ends with what was exported


def test_export_samples_must_not_be_negative_and_nni_strategies_refuse_it(tmp_path, capsys):
    for args, needle in ((["--set", "search.par-gumbel-darts.export_samples=-1"],
                          "search.par-gumbel-darts.export_samples must be >= 0"),
                         (["--strategy", "darts", "--set", "search.par-gumbel-darts.export_samples=3"],
                          "exports its own choice")):
        out = tmp_path / "search"
        assert main(["search", "--config", "tiny", "--set", f"search.out_dir={out}", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
        assert not out.exists()
