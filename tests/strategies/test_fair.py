"""``forward: fair``: strict-fair supernet training: a step runs one sub-step per candidate on the same batch, each
running a single candidate per block, so every candidate of every block is run and trained exactly once a step;
one optimiser step follows; the logits move towards the candidates whose sub-step loss was lower."""

import pytest
import torch
from test_search import SPLITS, VOCAB, search_config

from parnas.config import load_config
from parnas.strategies.fair import fair_picks, fair_surrogate
from parnas.strategies.search import build_search

FAIR = "search.par-gumbel-darts.forward=fair"


@pytest.mark.parametrize("n_blocks, n_candidates", [(1, 2), (4, 3), (6, 5)])
def test_each_block_picks_each_candidate_exactly_once_a_step_and_a_seed_draws_the_same(n_blocks, n_candidates):
    picks = fair_picks(n_blocks, n_candidates, seed=7)
    assert len(picks) == n_candidates and all(len(row) == n_blocks for row in picks)
    for b in range(n_blocks):
        assert sorted(row[b] for row in picks) == list(range(n_candidates))
    assert fair_picks(n_blocks, n_candidates, seed=7) == picks
    if n_blocks * n_candidates > 4:  # the permutations follow the seed
        assert any(fair_picks(n_blocks, n_candidates, seed=s) != picks for s in range(8, 12))


class Block:
    def __init__(self, alpha):
        self._arch_alpha = torch.nn.Parameter(torch.tensor(alpha))


def test_the_surrogate_moves_each_blocks_logits_towards_its_candidates_with_the_lower_sub_step_loss():
    blocks = [Block([0.0, 0.0, 0.0]), Block([0.0, 0.0, 0.0])]
    picks = [[0, 2], [1, 0], [2, 1]]  # sub-step j runs candidate picks[j][b] in block b
    losses = torch.tensor([1.0, 2.0, 3.0])  # sub-step 0 did best
    fair_surrogate(blocks, picks, losses).backward()
    first, second = (b._arch_alpha.grad for b in blocks)
    assert first.argmin() == 0 and first.argmax() == 2  # descending the gradient raises candidate 0 of block 0
    assert second.argmin() == 2 and second.argmax() == 1  # and candidate 2 of block 1 (its pick in sub-step 0)
    assert torch.allclose(first.sum(), torch.tensor(0.0), atol=1e-7)  # only the odds move


def test_fair_is_a_forward_mode_of_the_search():
    assert load_config("tiny", [FAIR]).search.settings.forward == "fair"


def test_every_candidate_of_every_block_runs_alone_once_and_is_trained_every_step(tmp_path):
    steps = 2
    cfg = search_config(f"train.max_steps={steps}", FAIR, "search.candidates=[attention, dense, identity]",
                        "train.warmup_steps=0")
    search = build_search(cfg, SPLITS, VOCAB, tmp_path)
    choices = sorted((m for m in search.supernet.modules() if hasattr(m, "_arch_alpha")),
                     key=lambda m: int(m.label.rsplit("_", 1)[1]))
    names = choices[0].names
    calls: list[tuple[int, str]] = []
    for b, choice in enumerate(choices):
        for name in names:
            choice[name].register_forward_hook(
                lambda module, args, out, key=(b, name): calls.append(key) if module.training else None)
    weights = {(b, n): [p.detach().clone() for p in c[n].parameters()] for b, c in enumerate(choices) for n in names}
    alphas = [c._arch_alpha.detach().clone() for c in choices]
    search.run()

    per_forward = [calls[i:i + len(choices)] for i in range(0, len(calls), len(choices))]
    assert len(per_forward) == steps * len(names)  # K sub-steps a step
    assert all([b for b, _ in f] == list(range(len(choices))) for f in per_forward)  # one candidate a block each
    for s in range(steps):  # over a step's sub-steps, each candidate of each block once
        step_calls = sorted(k for f in per_forward[s * len(names):(s + 1) * len(names)] for k in f)
        assert step_calls == sorted((b, n) for b in range(len(choices)) for n in names)
    for (b, name), before in weights.items():  # every candidate with weights was trained
        after = list(choices[b][name].parameters())
        assert all(not torch.equal(x, y.detach()) for x, y in zip(before, after)), (b, name)
    assert all(not torch.equal(a, c._arch_alpha.detach()) for a, c in zip(alphas, choices))  # the logits learn
    assert search.trainer.global_step == steps  # one optimiser step per step, not one per sub-step


def test_fair_runs_in_one_process_and_is_refused_in_several():
    from parnas.errors import ConfigError

    with pytest.raises(ConfigError, match="forward=fair runs in one process, not 2"):
        load_config("tiny", ["train.accelerator=cpu", "train.devices=2", FAIR])
    assert load_config("tiny", ["train.accelerator=cpu", "train.devices=2"]).search.settings.forward == "gumbel"


def test_a_fair_supernets_weights_do_not_depend_on_what_the_logits_learn(tmp_path):
    """Strict fairness: every candidate is trained once a step whatever softmax(alpha) says, so two searches of
    one seed under different latency penalties train bit-identical weights; only the logits differ."""
    trained = []
    for run, penalty in enumerate(("0", "5")):
        torch.manual_seed(0)  # as parnas search seeds before it builds the supernet
        search = build_search(search_config("train.max_steps=6", "train.warmup_steps=0", "search.penalty_cost=flops",
                                            f"search.par-gumbel-darts.penalty_weight={penalty}", FAIR), SPLITS, VOCAB,
                              tmp_path / str(run))
        search.run()
        assert search.module.par.forward == "fair"
        trained.append({k: v.detach().clone() for k, v in search.supernet.state_dict().items()})
    logits = [k for k in trained[0] if k.endswith("_arch_alpha")]
    assert logits and all(not torch.equal(trained[0][k], trained[1][k]) for k in logits)
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0] if k not in logits)


@pytest.mark.parametrize("sets, unread", [
    ([FAIR, "search.par-gumbel-darts.tau_end=0.3", "search.par-gumbel-darts.tau_start=2"], "tau_start, tau_end"),
    (["search.par-gumbel-darts.forward=sampled", "search.par-gumbel-darts.tau_start=2"], "tau_start"),
])
def test_gumbel_settings_given_to_a_forward_that_draws_no_sample_are_refused_in_one_line(sets, unread):
    """A user who tunes tau under a forward that never reads it is told so, before anything runs."""
    from parnas.errors import ConfigError

    forward = sets[0].rsplit("=", 1)[1]
    with pytest.raises(ConfigError, match=f"^search.par-gumbel-darts.{unread} set, but forward={forward} draws no "
                                          "Gumbel sample and reads no tau: drop them, or use forward=gumbel$"):
        load_config("tiny", sets)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_fair_search_of_planers_kinds_trains_every_candidate_on_cuda(tmp_path, precision):
    """The fair forward on the GPU, in PLANER's space: every candidate of every block (attention with
    fewer heads, the wider and narrower dense blocks, the mixture of experts) is trained, the logits learn and stay
    finite, and the search's record says where and how it trained."""
    cfg = search_config("train.max_steps=3", "model.n_heads=4", "search.candidates=planer", "train.warmup_steps=0",
                        "search.penalty_cost=flops", "train.accelerator=gpu", f"train.precision={precision}", FAIR)
    search = build_search(cfg, SPLITS, VOCAB, tmp_path)
    assert search.module.par.forward == "fair"
    choices = [m for m in search.supernet.modules() if hasattr(m, "_arch_alpha")]
    weights = {(b, n): [p.detach().clone() for p in c[n].parameters()]
               for b, c in enumerate(choices) for n in c.names}
    before = [c._arch_alpha.detach().clone() for c in choices]
    ran_on = {}  # (block, candidate) -> where its training forwards ran (Lightning hands the model back on the CPU)
    for b, c in enumerate(choices):
        for n in c.names:
            c[n].register_forward_hook(lambda m, args, out, key=(b, n): m.training and ran_on.setdefault(
                key, set()).add(args[0].device.type))
    search.run()
    assert ran_on == {key: {"cuda"} for key in weights}
    for (b, name), old in weights.items():
        new = list(choices[b][name].parameters())
        assert all(not torch.equal(x.to(y.device), y.detach()) for x, y in zip(old, new)), (b, name)
    after = [c._arch_alpha.detach() for c in choices]
    assert all(torch.isfinite(a).all() and not torch.equal(x.to(a.device), a) for x, a in zip(before, after))
    assert search.trainer.global_step == 3
