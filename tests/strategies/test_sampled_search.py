"""``search.par-gumbel-darts.forward: sampled``: a search step runs one sampled candidate per block, not all of them,
and the logits learn from the loss (REINFORCE); evaluation still mixes every candidate; the step reads back the
picks and nothing else."""

import numpy as np
import pytest
import torch
from nni.nas.nn.pytorch import LayerChoice, ModelSpace
from test_search import SPLITS, VOCAB, alphas, search_config
from torch import nn

from parnas.config import load_config
from parnas.errors import ConfigError
from parnas.strategies.gumbel_darts import PARGumbelDARTS
from parnas.strategies.sampled import BASELINE_DECAY, RoutedMixedLayer, clear_picks, draw_picks, reinforce
from parnas.strategies.search import build_search


class Counted(nn.Linear):
    calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


class OneChoice(ModelSpace):
    def __init__(self, n: int, width: int) -> None:
        super().__init__()
        self.block = LayerChoice([Counted(width, width) for _ in range(n)], label="block_0")


def mixed_layer(n=3, width=4) -> RoutedMixedLayer:
    """One block of n candidates, mutated by the search's strategy."""
    torch.manual_seed(0)
    search = load_config("tiny").search
    return PARGumbelDARTS(search, search.settings, max_steps=1).mutate_model(OneChoice(n, width)).block


def test_a_sampled_block_runs_only_its_pick_and_evaluation_mixes_every_candidate():
    layer = mixed_layer()
    x = torch.randn(5, 4)
    (pick,) = draw_picks([layer], seed=1)
    out = layer(x)
    candidates = [layer[name] for name in layer.names]
    assert [c.calls for c in candidates] == [int(i == pick) for i in range(3)]
    picked = candidates[pick]
    torch.testing.assert_close(out, nn.functional.linear(x, picked.weight, picked.bias))
    out.square().sum().backward()
    assert [c.weight.grad is not None for c in candidates] == [i == pick for i in range(3)]

    clear_picks([layer])
    layer(x)
    assert [c.calls for c in candidates] == [1 + int(i == pick) for i in range(3)]  # no pick: all, mixed
    draw_picks([layer], seed=1)
    layer.eval()
    layer(x)
    assert [c.calls for c in candidates] == [2 + int(i == pick) for i in range(3)]  # evaluation: all, mixed


def test_the_picks_follow_the_logits_and_repeat_for_a_seed():
    """A pick is a draw from softmax(alpha): frequencies follow the probabilities; one seed, one draw."""
    layer = mixed_layer()
    with torch.no_grad():
        layer._arch_alpha.copy_(torch.tensor([2.0, 0.0, -1.0]))
    picks = [draw_picks([layer], seed=s)[0] for s in range(3000)]
    freq = np.bincount(picks, minlength=3) / len(picks)
    np.testing.assert_allclose(freq, torch.tensor([2.0, 0.0, -1.0]).softmax(-1).numpy(), atol=0.03)
    assert draw_picks([layer], seed=7) == draw_picks([layer], seed=7)


def test_reinforce_raises_the_odds_of_picks_that_did_better_than_usual_and_lowers_the_others():
    """(L - b) d log p(pick) / d alpha: a loss below the moving average makes the pick likelier in every block,
    one above makes it less likely; at the baseline nothing moves. The baseline follows the loss."""
    layers = [mixed_layer(), mixed_layer()]
    picks = [0, 2]
    for loss, baseline, direction in [(3.0, 3.5, +1), (4.0, 3.5, -1), (3.5, 3.5, 0)]:
        for layer in layers:
            layer._arch_alpha.grad = None
        surrogate, following = reinforce(layers, picks, torch.tensor(loss), torch.tensor(baseline))
        surrogate.backward()
        for layer, pick in zip(layers, picks):
            stepped = layer._arch_alpha.detach() - 0.1 * layer._arch_alpha.grad  # one gradient step
            change = stepped.softmax(-1)[pick] - layer._arch_alpha.detach().softmax(-1)[pick]
            assert torch.sign(change) == direction, (loss, baseline, change)
        assert following.item() == pytest.approx(BASELINE_DECAY * baseline + (1 - BASELINE_DECAY) * loss)
    _, first = reinforce(layers, picks, torch.tensor(3.2), None)
    assert first.item() == pytest.approx(3.2)  # the first step's baseline is its own loss


def test_a_sampled_search_steps_weights_and_logits_running_one_candidate_per_block(tmp_path):
    search = build_search(search_config("train.max_steps=3", "search.par-gumbel-darts.forward=sampled"), SPLITS,
                          VOCAB, tmp_path)
    training = {}  # (block, candidate) -> forwards in training

    def count(module, args, out, key):
        if module.training:
            training[key] = training.get(key, 0) + 1

    layers = [m for m in search.supernet.modules() if isinstance(m, RoutedMixedLayer)]
    for layer in layers:
        for name in layer.names:
            layer[name].register_forward_hook(lambda *a, key=(layer.label, name): count(*a, key=key))
    before = alphas(search)
    search.run()
    assert all(not torch.equal(before[k], a) for k, a in alphas(search).items())
    assert len(layers) == 2 and all(layer.pick is None for layer in layers)  # nothing kept past the step
    forwards = 3  # 3 steps
    for layer in layers:  # one candidate a forward, where a gumbel step runs all three
        assert sum(training.get((layer.label, name), 0) for name in layer.names) == forwards, training


@pytest.mark.slow
def test_a_sampled_search_over_kinds_with_a_loss_of_their_own_steps(tmp_path):
    """A moe or ut candidate left out of a step keeps no loss from its last run: the step would otherwise
    backpropagate through a graph already freed."""
    cfg = search_config("train.max_steps=6", "search.par-gumbel-darts.forward=sampled", "model.n_heads=2",
                        "search.candidates=[attention, moe, ut, identity]")
    search = build_search(cfg, SPLITS, VOCAB, tmp_path)
    before = alphas(search)
    search.run()
    assert all(not torch.equal(before[k], a) for k, a in alphas(search).items())


@pytest.mark.slow
def test_a_sampled_search_chooses_attention_where_the_task_needs_it(tmp_path):
    search = build_search(search_config("train.max_steps=600", "search.par-gumbel-darts.arch_warmup_steps=200",
                                        "search.par-gumbel-darts.forward=sampled"), SPLITS, VOCAB, tmp_path)
    search.run()
    attention = [p["attention"] for p in search.module.probabilities().values()]
    assert max(attention) > 0.8, search.module.probabilities()
    assert "attention" in search.module.export().values()


def test_a_sampled_search_step_reads_back_its_picks_and_nothing_else(tmp_path, benchmark_script):
    from parnas.strategies.costs import CostModel

    cfg = load_config("tiny", ["train.accelerator=cpu", "train.max_steps=5", "train.log_every=5",
                               "search.par-gumbel-darts.latency_budget=0.9", "search.par-gumbel-darts.forward=sampled"])
    B, L = cfg.data.batch_size, cfg.data.seg_len
    ids = np.random.default_rng(0).integers(0, 1000, B * L * 20).astype(np.int64)
    costs = CostModel({"attention": 3.0, "dense": 1.0, "identity": 0.0}, 1.0, "ms/step", cfg.model.n_blocks)
    search = build_search(cfg, {"train": ids, "valid": ids[:B * L * 4], "test": ids[:B * L * 4]}, 1000,
                          tmp_path, costs=costs)
    record = benchmark_script("host_syncs").RecordStep(3)
    search.trainer.callbacks.append(record)
    search.run()
    assert record.recorder.total == 1 and all("draw_picks" in site for site in record.recorder.sites), \
        record.recorder.sites


@pytest.mark.parametrize("settings, needle", [
    (["search.par-gumbel-darts.forward=all"],
     "search.par-gumbel-darts.forward must be one of gumbel, fair, sampled, not 'all'"),
    (["search.par-gumbel-darts.forward=sampled", "train.devices=2", "data.batch_size=8", "data.eval_batch_size=8"],
     "search.par-gumbel-darts.forward=sampled runs in one process, not 2"),
])
def test_settings_a_sampled_search_cannot_honour_are_refused(settings, needle):
    with pytest.raises(ConfigError, match=f"^{needle}"):
        load_config("tiny", settings)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_sampled_search_runs_on_cuda_and_draws_as_on_the_cpu(tmp_path):
    """On the GPU the picks come from a CUDA generator: the search runs, the logits move, and a second run with
    the same seed draws the same (the resume test's premise)."""
    def search(out):
        torch.manual_seed(0)
        s = build_search(search_config("train.max_steps=4", "search.par-gumbel-darts.forward=sampled",
                                       "train.accelerator=gpu"),
                         SPLITS, VOCAB, out)
        before = alphas(s)
        s.run()
        return before, {k: a.cpu() for k, a in alphas(s).items()}  # wherever Lightning left the model

    (start, first), (_, second) = search(tmp_path / "a"), search(tmp_path / "b")
    for a, b in zip(first.values(), second.values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(not torch.equal(start[k].cpu(), a) for k, a in first.items())
