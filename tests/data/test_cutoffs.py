"""Adaptive-softmax cutoffs: the fast method equals the exact DP, which equals brute force."""

import itertools
import time

import numpy as np
import pytest
from conftest import needs_wt2

from parnas.cli import main
from parnas.data.cutoffs import (
    PAPER_MIN_MACS,
    CutoffsError,
    SoftmaxCost,
    exact_cutoffs,
    load_tokenizer,
    optimal_cutoffs,
    probabilities,
    unigram_counts,
)

MODELS = [SoftmaxCost(), SoftmaxCost(min_macs=0), SoftmaxCost(projection=False), SoftmaxCost(tokens=64, d_model=512),
          SoftmaxCost(div_value=2.0, min_macs=1e5), SoftmaxCost(div_value=1.0, min_macs=0)]


def zipf(n, rng, noise=0.0, s=1.1):
    """Zipf-like unigram probabilities; ``noise`` breaks the frequency order, as SentencePiece ids do."""
    p = np.arange(1, n + 1) ** -s * np.exp(rng.normal(0.0, noise, n))
    return p / p.sum()


def test_exact_dp_is_the_brute_force_optimum():
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(4, 13))
        k = int(rng.integers(1, min(3, n - 1) + 1))
        probs = zipf(n, rng, noise=float(rng.choice([0.0, 1.0])))
        model = SoftmaxCost(tokens=float(rng.choice([32, 1024])), d_model=int(rng.choice([16, 128])),
                          div_value=float(rng.choice([1.0, 2.0, 4.0])), min_macs=float(rng.choice([0, 1e4, 1e6])))
        if model.hidden(k) < 1:
            continue
        best = min(model.cost(probs, c) for c in itertools.combinations(range(1, n), k))
        found = exact_cutoffs(probs, k, model)
        assert found.cost == pytest.approx(best, rel=1e-12)
        assert model.cost(probs, found.cutoffs) == pytest.approx(found.cost, rel=1e-12)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: f"B{m.tokens:g}-d{m.d_model}-div{m.div_value:g}-"
                         f"floor{m.min_macs:g}-{'proj' if m.projection else 'noproj'}")
def test_fast_method_matches_the_exact_dp(model):
    rng = np.random.default_rng(1)
    for n, k, noise in ((40, 1, 0.0), (300, 2, 0.0), (300, 2, 0.7), (800, 3, 0.3), (1500, 2, 0.0), (1500, 3, 1.0)):
        if model.projection and model.hidden(k) < 1:
            continue
        probs = zipf(n, rng, noise)
        fast, exact = optimal_cutoffs(probs, k, model), exact_cutoffs(probs, k, model)
        assert fast.cutoffs == exact.cutoffs, (n, k, noise)
        assert fast.cost == pytest.approx(exact.cost, rel=1e-12)
        cuts = fast.cutoffs
        assert len(cuts) == k and all(a < b for a, b in zip((0, *cuts), (*cuts, n)))  # monotone, inside (0, n)


def test_the_floor_ties_resolve_to_the_largest_cutoffs():
    """Under the floor every product costs the same: the head then keeps every id it can for free."""
    probs = zipf(5000, np.random.default_rng(2))
    found = optimal_cutoffs(probs, 2, SoftmaxCost())
    head_free = PAPER_MIN_MACS // (1024 * 128) - 2  # largest c1 with 1024 x 128 x (c1 + 2) under the floor
    assert found.cutoffs[0] == head_free
    assert exact_cutoffs(probs, 2, SoftmaxCost()).cutoffs == found.cutoffs


def test_fast_on_a_32k_vocabulary():
    probs = zipf(32000, np.random.default_rng(3))
    started = time.perf_counter()
    found = optimal_cutoffs(probs, 3, SoftmaxCost())
    took = time.perf_counter() - started
    print(f"optimal_cutoffs on 32,000 ids, K=3: {list(found.cutoffs)} in {took:.3f} s")
    assert len(found.cutoffs) == 3 and found.cutoffs[-1] < 32000
    assert found.cost < SoftmaxCost().cost(probs, [])


def test_cost_model_pieces():
    model = SoftmaxCost(tokens=100, d_model=64, div_value=4, min_macs=0)
    probs = np.full(10, 0.1)
    # head 100x64 by 64x(3+1); tail 1: 70 tokens through 64x16 then 16x7
    assert model.cost(probs, [3]) == pytest.approx(100 * 64 * 4 + 70 * 64 * 16 + 70 * 16 * 7)
    assert model.cost(probs, []) == pytest.approx(100 * 64 * 10)
    assert SoftmaxCost(min_macs=1e9).cost(probs, [3]) == pytest.approx(3e9)  # three products, all on the floor
    with pytest.raises(CutoffsError):
        model.cost(probs, [5, 3])


def test_counts_and_bad_requests():
    assert list(unigram_counts(np.array([0, 2, 2, 1, 2]), 4)) == [1, 1, 3, 0]
    with pytest.raises(CutoffsError, match="outside"):
        unigram_counts(np.array([0, 5]), 4)
    with pytest.raises(CutoffsError, match="not all zero"):
        probabilities(np.zeros(5))
    probs = zipf(5, np.random.default_rng(4))
    with pytest.raises(CutoffsError, match="at least 6 ids"):
        optimal_cutoffs(probs, 5, SoftmaxCost())
    assert optimal_cutoffs(probs, 4, SoftmaxCost(min_macs=0, div_value=2)).cutoffs == (1, 2, 3, 4)
    with pytest.raises(CutoffsError, match="no features"):
        optimal_cutoffs(zipf(100, np.random.default_rng(5)), 4, SoftmaxCost(d_model=128, div_value=4))
    with pytest.raises(CutoffsError, match=">= 1"):
        exact_cutoffs(probs, 0, SoftmaxCost())


def test_load_tokenizer_by_path(tmp_path):
    (tmp_path / "vocab.txt").write_text("<eos>\n<unk>\nthe\ncat\n")
    assert load_tokenizer(tmp_path).kind == "word"
    (tmp_path / "char").mkdir()
    (tmp_path / "char" / "vocab.txt").write_text("<eos>\n<unk>\n97\n98\n")
    assert load_tokenizer(tmp_path / "char" / "vocab.txt").kind == "char"
    with pytest.raises(CutoffsError, match="no tokenizer file"):
        load_tokenizer(tmp_path / "missing.model")


def one_line_error(capsys, *args):
    code = main(["cutoffs", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@needs_wt2
@pytest.mark.slow
def test_cli_on_a_wikitext_slice(capsys, wt2_slice):
    common = ["--config", "tiny", "--set", f"data.path={wt2_slice}", "--tokenizer", "word"]
    assert main(["cutoffs", *common, "--clusters", "2"]) == 0
    out = capsys.readouterr().out
    assert "optimal cutoffs for 2 tail cluster(s)" in out and "use: --set model.cutoffs=[" in out
    cuts = [int(c) for c in out.split("model.cutoffs=[")[1].split("]")[0].split(",")]
    assert main(["cutoffs", *common, "--clusters", "2", "--method", "exact"]) == 0
    assert f"model.cutoffs=[{','.join(map(str, cuts))}]" in capsys.readouterr().out
    err = one_line_error(capsys, *common, "--clusters", "99999", "--set", "model.div_value=1")
    assert "--clusters 99999" in err and "vocabulary" in err


def test_cli_bad_requests(capsys, tmp_path):
    assert "no tokenizer file" in one_line_error(capsys, "--tokenizer", str(tmp_path / "nope.model"), "--clusters", "2")
    assert "leaves tail cluster 9 no features" in one_line_error(capsys, "--config", "tiny", "--clusters", "9")
    assert "at least 12001 ids" in one_line_error(capsys, "--config", "wt2-seed", "--clusters", "12000",
                                                  "--set", "model.div_value=1")
