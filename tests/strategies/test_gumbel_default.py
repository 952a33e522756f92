"""The default search is Gumbel-DARTS: each block mixes its candidates by a Gumbel-softmax sample of its logits at a
temperature tau annealed as configured, the logits learn through that sample, and the probabilities sharpen as tau
falls; a forward that draws no sample records no tau."""

import json
import math

import torch
from test_search import SPLITS, VOCAB, search_config

from parnas.config import load_config
from parnas.strategies.search import build_search
from parnas.strategies.temperature import GumbelSoftmax


def entropy(probabilities: dict[str, dict[str, float]]) -> float:
    """Mean entropy (nats) of the blocks' distributions."""
    return sum(-sum(p * math.log(p) for p in d.values() if p > 0) for d in probabilities.values()) / len(probabilities)


def test_the_default_forward_is_gumbel_in_one_process_and_in_several():
    assert load_config("tiny").search.settings.forward == "gumbel"
    assert load_config("wt2-cpu").search.settings.forward == "gumbel"
    assert load_config("tiny", ["train.accelerator=cpu", "train.devices=2"]).search.settings.forward == "gumbel"


def test_the_default_search_draws_gumbel_samples_at_an_annealed_tau_and_its_probabilities_sharpen(tmp_path):
    steps = 60
    search = build_search(search_config(f"train.max_steps={steps}", "search.log_every=5", "train.eval_every=10000",
                                        "search.par-gumbel-darts.tau_end=0.2"), SPLITS, VOCAB, tmp_path)
    assert search.module.par.forward == "gumbel" and search.module.par.tau_end == 0.2
    softmaxes = [m for m in search.supernet.modules() if isinstance(m, GumbelSoftmax)]
    assert softmaxes  # the blocks mix their candidates by a Gumbel softmax
    drawn: list[tuple[float, torch.Tensor]] = []  # (tau, block 0's mixing weights), each training forward
    softmaxes[0].register_forward_hook(
        lambda m, args, out: drawn.append((m.tau, out.detach().clone())) if m.training else None)
    before = [m._arch_alpha.detach().clone() for m in search.supernet.modules() if hasattr(m, "_arch_alpha")]
    search.run()

    after = [m._arch_alpha.detach() for m in search.supernet.modules() if hasattr(m, "_arch_alpha")]
    assert all(not torch.equal(a, b) for a, b in zip(before, after))  # the logits learned
    taus = [tau for tau, _ in drawn]
    assert len(drawn) == steps and taus[0] == 1.0 and math.isclose(taus[-1], 0.2)  # tau read, annealed as configured
    assert all(a > b for a, b in zip(taus, taus[1:]))
    first, second = drawn[0][1], drawn[1][1]
    assert not torch.allclose(first, second)  # a fresh sample each step, not the softmax of (barely moved) logits
    assert torch.allclose(first.sum(), torch.tensor(1.0)) and (first > 0).all()  # soft: every candidate weighted

    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    logged = [line for line in history if "val_ppl" not in line]
    assert [line["tau"] for line in logged] == sorted((line["tau"] for line in logged), reverse=True)
    assert entropy(logged[-1]["probabilities"]) < entropy(logged[0]["probabilities"]) - 0.01  # sharpening


def test_a_fair_search_reads_and_records_no_tau(tmp_path):
    search = build_search(search_config("train.max_steps=4", "search.log_every=2", "train.eval_every=10000",
                                        "search.par-gumbel-darts.forward=fair"), SPLITS, VOCAB, tmp_path)
    search.run()
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert history and not any("tau" in line for line in history)
    assert "tau_start" not in search.module.par.read() and "forward" in search.module.par.read()
