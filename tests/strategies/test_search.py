"""The PAR space and the Gumbel-DARTS strategy: what a user relies on when searching."""

import atexit
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from nni.nas.nn.pytorch import LayerChoice

from parnas.config import BLOCK_KINDS, ModelConfig, load_config
from parnas.search_spaces import PARTransformerXLSpace, fixed_model
from parnas.strategies.costs import CostModel
from parnas.strategies.gumbel_darts import tau_at
from parnas.strategies.search import build_search
from parnas.training.evaluation import evaluate

logging.getLogger("nni").setLevel(logging.WARNING)
VOCAB = 32


def copy_stream(n_chunks: int, period: int = 4, seed: int = 0) -> np.ndarray:
    """Chunks of `period` random tokens, each repeated once: half the tokens are predictable
    only by looking `period` positions back, which needs attention."""
    r = np.random.default_rng(seed).integers(0, VOCAB, size=(n_chunks, period))
    return np.concatenate([r, r], axis=1).reshape(-1).astype(np.int32)


SPLITS = {"train": copy_stream(3000), "valid": copy_stream(100, seed=1), "test": copy_stream(100, seed=2)}


def search_config(*overrides: str):
    return load_config("tiny", ["model.n_blocks=2", "model.cutoffs=[]", "model.mem_len=8", "data.batch_size=8",
                                "data.seg_len=16", "data.eval_batch_size=4", "train.eval_every=10000",
                                "train.warmup_steps=10", "train.lr=1e-2", "search.arch_lr=0.03", *overrides])


def run(tmp_path, *overrides: str):
    search = build_search(search_config(*overrides), SPLITS, VOCAB, tmp_path)
    search.run()
    return search


def test_space_has_one_labelled_choice_per_block_and_fixes_under_model_context():
    cfg = ModelConfig(n_blocks=5, d_model=16, n_heads=2, d_ff=32, cutoffs=())
    space = PARTransformerXLSpace(cfg, VOCAB, candidates=("attention", "dense"))
    choices = space.simplify()
    assert list(choices) == [f"block_{i}" for i in range(5)]
    assert all(list(c.values) == ["attention", "dense"] for c in choices.values())
    sample = {f"block_{i}": k for i, k in enumerate(["attention", "dense", "dense", "attention", "dense"])}
    model = fixed_model(cfg, VOCAB, sample, ("attention", "dense"))
    assert isinstance(model, PARTransformerXLSpace)
    assert not any(isinstance(m, LayerChoice) for m in model.modules())
    assert model.block_kinds == list(sample.values())
    _, mems = model(torch.randint(0, VOCAB, (2, 4)))
    assert [m is not None for m in mems] == [True, False, False, True, False]


def test_tau_starts_ends_and_decreases_exponentially_every_step():
    taus = [tau_at(step, 50, 1.0, 0.1) for step in range(50)]
    assert taus[0] == pytest.approx(1.0) and taus[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(taus, taus[1:]))
    assert taus[1] / taus[0] == pytest.approx(taus[-1] / taus[-2])


def alphas(search):
    return {m.label: m._arch_alpha.detach().clone() for m in search.supernet.modules() if hasattr(m, "_arch_alpha")}


def test_a_step_moves_weights_and_logits_from_the_training_batch_alone(tmp_path):
    search = build_search(search_config("train.max_steps=1"), SPLITS, VOCAB, tmp_path)
    before_alpha = alphas(search)
    before_w = search.supernet.embed.weight.detach().clone()
    search.run()
    assert all(not torch.equal(before_alpha[k], a) for k, a in alphas(search).items())
    assert not torch.equal(before_w, search.supernet.embed.weight)
    assert set(search.module.training_module.mems) == {"train"}


@pytest.mark.slow
def test_search_chooses_attention_where_the_task_needs_it(tmp_path):
    search = run(tmp_path, "train.max_steps=600", "search.par-gumbel-darts.arch_warmup_steps=200")
    attention = [p["attention"] for p in search.module.probabilities().values()]
    assert max(attention) > 0.8, search.module.probabilities()
    assert "attention" in search.module.export().values()


# Known costs instead of timed ones where a test is about the search, not the device: what a budget allows is
# then exact on every machine (II 0.2, DI 0.4, DD 0.6, AI 0.8, AD 1.0), where a timed table's ratios are the
# device's (a tiny all-identity model costs 0.3 of Transformer-XL's step on a CPU, 0.5 on an H100).
FIXED_COSTS = CostModel({"attention": 3.0, "dense": 1.0, "identity": 0.0}, 1.0, "ms/step", 2)  # TXL (AD): 5 ms


@pytest.mark.slow
def test_compute_penalty_has_a_gradient_and_makes_identity_win(tmp_path):
    search = build_search(search_config("train.max_steps=300", "search.par-gumbel-darts.penalty_weight=5"), SPLITS,
                          VOCAB, tmp_path,
                          costs=FIXED_COSTS)
    search.module.set_model(search.supernet)
    search.module.expected_ratio().backward()
    assert all(m._arch_alpha.grad.abs().sum() > 0 for m in search.module.choices())
    for m in search.module.choices():
        m._arch_alpha.grad = None
    search.run()
    assert set(search.module.export().values()) == {"identity"}
    assert min(p["identity"] for p in search.module.probabilities().values()) > 0.9


@pytest.mark.slow
@pytest.mark.parametrize("fixed_lambda", [None, 5.0])
def test_latency_budget_is_met_by_the_exported_architecture(tmp_path, fixed_lambda):
    """The task needs attention (a copy task); a budget of 0.45 allows at most one dense block, whether lambda
    is found or fixed."""
    weight = [f"search.par-gumbel-darts.penalty_weight={fixed_lambda}"] if fixed_lambda else []
    search = build_search(search_config("train.max_steps=300", "search.par-gumbel-darts.latency_budget=0.45",
                                        "train.eval_every=300",
                                        *weight),
                          SPLITS, VOCAB, tmp_path, costs=FIXED_COSTS)
    search.run()
    kinds, fitted = search.module.exported_kinds()
    assert FIXED_COSTS.ratio(kinds) <= 0.45, (kinds, search.module.probabilities())
    lambdas = [line["lambda"] for line in history(tmp_path) if "lambda" in line]
    if fixed_lambda:
        assert set(lambdas) == {fixed_lambda}
    else:
        assert max(lambdas) > 0  # the multiplier had to rise: unconstrained, this task keeps attention
    assert search.module.last_evaluation.kinds == kinds
    assert fitted == (FIXED_COSTS.ratio(search.module.argmax()) > 0.45)  # said, never silent


def test_a_budget_derived_from_the_measured_table_is_met_and_one_below_its_floor_is_refused(tmp_path):
    """The device's own table (timed here, whatever the device): a budget halfway between the cheapest layout
    and Transformer-XL is met by what is exported; one under the cheapest layout is refused before training."""
    from parnas.errors import ParnasError
    from parnas.strategies.pricing import cost_model

    cfg = search_config("train.max_steps=20", "train.eval_every=20")
    costs, _ = cost_model(cfg, VOCAB, torch.device("cpu"))  # cached: the search below reads the same table
    floor = costs.ratio(["identity"] * cfg.model.n_blocks)
    budget = round(floor + (1.0 - floor) / 2, 4) if floor < 1.0 else 1.0
    search = build_search(search_config("train.max_steps=20", "train.eval_every=20", "train.accelerator=cpu",
                                        f"search.par-gumbel-darts.latency_budget={budget}"), SPLITS, VOCAB, tmp_path)
    assert search.costs == costs
    search.run()
    kinds, _ = search.module.exported_kinds()
    assert costs.ratio(kinds) <= budget + 1e-9, (kinds, costs)
    with pytest.raises(ParnasError, match="out of reach"):
        build_search(search_config(f"search.par-gumbel-darts.latency_budget={round(floor * 0.9, 4)}",
                                   "train.accelerator=cpu"),
                     SPLITS, VOCAB, tmp_path / "low")


def test_the_budget_prices_the_argmax_on_the_device_as_the_exported_layout_is_priced(tmp_path):
    """The hinge and the dual step read the argmax's cost without a read-back; it must be the cost of the layout
    that is exported, whichever kind leads each block."""
    import itertools

    search = build_search(search_config("search.par-gumbel-darts.latency_budget=0.5"), SPLITS, VOCAB, tmp_path,
                          costs=FIXED_COSTS)
    search.module.set_model(search.supernet)
    choices = search.module.choices()
    for leaders in itertools.product(range(len(choices[0].names)), repeat=len(choices)):
        with torch.no_grad():
            for m, k in zip(choices, leaders):
                m._arch_alpha.zero_()[k] = 1.0
        device_ratio = search.module.exported_ratio()
        assert device_ratio.dim() == 0
        assert float(device_ratio) == pytest.approx(FIXED_COSTS.ratio(search.module.argmax()), rel=1e-12)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")  # the penalty alone, outside a Trainer
def test_the_budget_hinge_pushes_only_while_the_exported_cost_is_over_the_budget(tmp_path):
    """With a fixed lambda the penalty is lambda x max(0, cost - budget) of the argmax's cost: zero, and no
    gradient to the logits, under the budget; over it, the excess, with the expected cost's gradient."""
    search = build_search(search_config("search.par-gumbel-darts.latency_budget=0.5",
                                        "search.par-gumbel-darts.penalty_weight=2"), SPLITS, VOCAB,
                          tmp_path, costs=FIXED_COSTS)
    module = search.module
    module.set_model(search.supernet)
    choices = module.choices()

    def penalty(logits: list[list[float]]) -> tuple[float, bool]:
        with torch.no_grad():
            for m, row in zip(choices, logits):
                m._arch_alpha.copy_(torch.tensor([row[("attention", "dense", "identity").index(n)] for n in m.names]))
        for m in choices:
            m._arch_alpha.grad = None
        value = module._penalty()
        if torch.is_tensor(value) and value.requires_grad:
            value.backward()
        moved = any(m._arch_alpha.grad is not None and m._arch_alpha.grad.abs().sum() > 0 for m in choices)
        return float(value.detach() if torch.is_tensor(value) else value), moved

    assert penalty([[0.0, 0.0, 9.0], [0.0, 0.0, 9.0]]) == (0.0, False)  # II: 0.2, expected about 0.2
    value, moved = penalty([[9.0, 0.0, 0.0], [0.0, 9.0, 0.0]])  # AD: 1.0, expected just under
    assert moved and value == pytest.approx(2 * (1.0 - 0.5), rel=1e-6)
    # argmax II (0.2, under) but the distribution's mean over: what is exported is within, so nothing pushes
    value, moved = penalty([[1.0, 1.0, 1.3], [1.0, 1.0, 1.3]])
    assert float(module.expected_ratio().detach()) > 0.5
    assert not moved and value == 0


def test_fit_budget_takes_the_most_probable_layout_within_the_budget():
    from parnas.strategies.supernet_export import fit_budget

    probs = [{"attention": 0.6, "dense": 0.3, "identity": 0.1}, {"attention": 0.5, "dense": 0.1, "identity": 0.4}]
    assert fit_budget(probs, FIXED_COSTS, 1.4) == ["attention", "attention"]  # the argmax fits
    assert fit_budget(probs, FIXED_COSTS, 0.8) == ["attention", "identity"]  # 0.6 x 0.4 beats D,A's 0.3 x 0.5
    assert fit_budget(probs, FIXED_COSTS, 0.4) == ["dense", "identity"]
    assert fit_budget(probs, FIXED_COSTS, 0.1) is None  # even II (0.2) is over


@pytest.mark.slow
def test_without_a_budget_the_same_search_keeps_attention(tmp_path):
    search = build_search(search_config("train.max_steps=300", "train.eval_every=300"), SPLITS, VOCAB, tmp_path,
                          costs=FIXED_COSTS)
    search.run()
    assert "attention" in search.module.argmax() and FIXED_COSTS.ratio(search.module.argmax()) > 0.45


def test_exported_architecture_evaluates_as_the_fixed_model_with_the_same_weights(tmp_path):
    from nni.nas.space import model_context

    from parnas.strategies.supernet_export import exported_nll

    search = run(tmp_path, "train.max_steps=20")
    chosen = search.module.export()
    with model_context(chosen):
        fixed = PARTransformerXLSpace(search_config().model, VOCAB)
    state = {}
    for name, value in search.supernet.state_dict().items():  # blocks.i.<kind>.w -> blocks.i.w for the chosen kind
        parts = name.split(".")
        if parts[0] == "blocks" and parts[2] in BLOCK_KINDS:
            if chosen[f"block_{parts[1]}"] != parts[2]:
                continue
            name = ".".join(parts[:2] + parts[3:])
        if "_arch_alpha" not in name:
            state[name] = value
    fixed.load_state_dict(state)
    sums = exported_nll(search.supernet, search.module.choices(), list(chosen.values()), search.data.batches("valid"))
    reference = evaluate(fixed, search.data.batches("valid"))
    assert float(sums[0]) == pytest.approx(reference.nll, rel=1e-6) and int(sums[1]) == reference.tokens


def test_evaluation_uses_no_gumbel_noise_and_is_deterministic(tmp_path):
    search = run(tmp_path, "train.max_steps=20")
    batches = search.data.batches("valid")
    first, second = evaluate(search.supernet, batches), evaluate(search.supernet, batches)
    assert first.nll == second.nll and math.isfinite(first.ppl)


def history(run_dir):
    import json

    return [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]


def test_history_logs_softmax_probabilities_tau_and_both_perplexities(tmp_path):
    search = run(tmp_path, "train.max_steps=20", "train.eval_every=10", "search.log_every=5")
    lines = history(tmp_path)
    assert [line["step"] for line in lines if "val_ppl" not in line] == [5, 10, 15, 20]  # steps taken, as NNI counts
    evaluations = [line for line in lines if "val_ppl" in line]
    assert [line["step"] for line in evaluations] == [10, 20]
    for line in evaluations:
        assert math.isfinite(line["val_ppl"]) and math.isfinite(line["supernet_val_ppl"])
        assert len(line["architecture"]) == 2 and set(line["architecture"]) <= set("ADI")
    for line in lines:
        for dist in line["probabilities"].values():
            assert set(dist) == set(BLOCK_KINDS) and sum(dist.values()) == pytest.approx(1.0, abs=1e-5)
    last = search.module.last_evaluation
    assert last.step == 20 and last.val_ppl == evaluations[-1]["val_ppl"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    board = EventAccumulator(str(events))
    board.Reload()
    steps = {tag: [e.step for e in board.Scalars(tag)] for tag in ("prob/block_0/attention", "val/ppl_exported")}
    assert steps == {"prob/block_0/attention": [5, 10, 15, 20], "val/ppl_exported": [10, 20]}  # as history counts


@pytest.mark.parametrize("setting, needle", [
    ("search.nonsense=1", "unknown config key search.nonsense"),
    ("search.arch_lr=fast", "search.arch_lr must be float"),
    ("search.par-gumbel-darts.tau_end=2.0", "search.par-gumbel-darts.tau_end (2.0) must not exceed tau_start"),
    ("search.candidates=[attention, convolution]", "unknown block kind 'convolution'"),
    ("search.par-gumbel-darts.penalty_weight=-0.1", "search.par-gumbel-darts.penalty_weight must be >= 0"),
    ("search.par-gumbel-darts.latency_budget=0", "search.par-gumbel-darts.latency_budget must be in (0, 1]"),
    ("search.par-gumbel-darts.latency_budget=1.5", "search.par-gumbel-darts.latency_budget must be in (0, 1]"),
    ("search.par-gumbel-darts.latency_budget=.nan", "search.par-gumbel-darts.latency_budget must be a finite number"),
    ("search.par-gumbel-darts.latency_budget=fast", "search.par-gumbel-darts.latency_budget must be float"),
    ("search.par-gumbel-darts.forward=fair --set search.par-gumbel-darts.tau_end=0.2",
     "search.par-gumbel-darts.tau_end set, but forward=fair draws no Gumbel sample and reads no tau"),
    ("search.par-gumbel-darts.forward=mixed", "forward must be one of gumbel, fair, sampled, not 'mixed' (mixed is "
     "now called gumbel)"),
    ("search.par-gumbel-darts.budget_hinge=expected", "search.par-gumbel-darts.budget_hinge was removed"),
    ("search.par-gumbel-darts.latency_budget=0.65 --set search.penalty_cost=flops", "set search.penalty_cost=latency"),
])
def test_search_refuses_bad_settings_with_one_line(tmp_path, capsys, setting, needle):
    from parnas.cli import main

    sets = [item for part in setting.split(" --set ") for item in ("--set", part)]
    code = main(["search", "--config", "tiny", *sets, "--set", f"search.out_dir={tmp_path}/run"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "run").exists()


def test_launch_refuses_a_port_in_use(capsys):
    import socket

    from parnas.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code = main(["launch", "--config", str(Path(__file__).parents[2] / "search.yaml"), "--port", str(port)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and f"port {port} is already in use" in err, err


def test_usable_as_an_nni_nas_experiment(tmp_path):
    from nni.nas.evaluator.pytorch import Lightning, Trainer
    from nni.nas.experiment import NasExperiment

    from parnas.strategies.gumbel_darts import PARGumbelDARTS
    from parnas.training.data_module import SegmentData
    from parnas.training.task import LanguageModelTask
    from parnas.training.trainer import build_trainer

    cfg = search_config("train.max_steps=5", "train.eval_every=5")
    data = SegmentData(SPLITS, 8, 4, 16)
    trainer = build_trainer(cfg.train, tmp_path, trainer_cls=Trainer, gradient_clip_val=None)
    evaluator = Lightning(LanguageModelTask(cfg.train), trainer, datamodule=data)
    experiment = NasExperiment(PARTransformerXLSpace(cfg.model, VOCAB), evaluator,
                               PARGumbelDARTS(cfg.search, cfg.search.settings, max_steps=5, gradient_clip_val=0.25))
    experiment.config.experiment_working_directory = str(tmp_path / "nni")
    experiment.run()
    experiment.stop()  # marks it stopped in nnictl's registry, now rather than at exit when streams are closed
    atexit.unregister(experiment.stop)
    (best,) = experiment.export_top_models(formatter="dict")
    assert list(best) == ["block_0", "block_1"] and set(best.values()) <= set(BLOCK_KINDS)


@pytest.mark.slow
def test_resume_continues_an_interrupted_search(tmp_path, wt2_slice):
    import json

    from parnas.cli import main

    common = ["--config", "tiny", "--set", f"data.path={wt2_slice}", "--set", "data.vocab_size=300",
              "--set", "model.cutoffs=[100, 200]", "--set", f"search.out_dir={tmp_path}", "--set", "search.log_every=5",
              "--set", "train.ckpt_every=10", "--set", "train.eval_every=100"]
    assert main(["search", *common, "--set", "train.max_steps=20", "--set", "train.stop_at=10"]) == 0
    assert main(["search", *common, "--set", "train.max_steps=20"]) == 2  # a fresh search would overwrite it
    assert main(["search", *common, "--set", "train.max_steps=20", "--resume"]) == 0
    record = json.loads((tmp_path / "architecture.json").read_text())
    assert record["search"]["steps"] == 20
    lines = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    logged = [line["step"] for line in lines if "val_ppl" not in line]  # each logged step once: none redone
    assert logged == [5, 10, 15, 20]
    # each run ends with its final evaluation (eval_every is beyond both)
    assert [line["step"] for line in lines if "val_ppl" in line] == [10, 20]


@pytest.mark.parametrize("forward", ["gumbel", *(pytest.param(f, marks=pytest.mark.slow) for f in ("sampled", "fair"))])
def test_a_killed_search_resumes_to_the_same_logits_architecture_and_history(tmp_path, forward):
    """Stopped at step 10 (checkpoint taken at an evaluation) and resumed to 20 == 20 steps straight through;
    also when each step runs only the candidates sampled (the same draws after the resume), and strictly fair
    (the same permutations, the same dropout of every sub-step, the training memory restored where the step
    starts: the sub-steps share it)."""
    from parnas.strategies.search_folder import prepare_run_dir
    from parnas.training import checkpoint

    common = ("train.max_steps=20", "train.eval_every=10", "train.ckpt_every=10", "search.log_every=5",
              "model.dropout=0.1", "search.par-gumbel-darts.latency_budget=0.5",
              f"search.par-gumbel-darts.forward={forward}")

    def search(run_dir, *extra, ckpt=None):
        torch.manual_seed(0)
        cfg = search_config(*common, *extra)
        meta = {"config": cfg.to_dict(), "architecture": {}, "tokenizer": {}}
        s = build_search(cfg, SPLITS, VOCAB, run_dir, ckpt=ckpt, meta=meta, costs=FIXED_COSTS)
        s.run()
        return s

    straight = search(tmp_path / "straight")
    search(tmp_path / "killed", "train.stop_at=10")
    ckpt = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    prepare_run_dir(tmp_path / "killed", checkpoint.load(ckpt)["global_step"])
    resumed = search(tmp_path / "killed", ckpt=ckpt)

    for a, b in zip(alphas(straight).values(), alphas(resumed).values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert straight.module.argmax() == resumed.module.argmax() and straight.module.dual == resumed.module.dual
    assert resumed.module.last_evaluation.val_ppl == straight.module.last_evaluation.val_ppl
    assert history(tmp_path / "killed") == history(tmp_path / "straight")  # each step once, evaluations kept


def test_mid_search_evaluations_read_a_fixed_part_of_the_validation_split_and_the_last_all_of_it(tmp_path, capsys,
                                                                                                  monkeypatch):
    """The evaluations before the last step only show progress: they read EARLY_VALID_FRACTION of the split (its
    first segments, supernet and exported architecture alike); the last, which the pick and the export read, all."""
    from parnas.pick_config import EARLY_VALID_FRACTION
    from parnas.strategies import gumbel_darts
    from parnas.training.evaluation import segments_read

    read: list[tuple[str, int]] = []
    original = gumbel_darts.exported_nll
    monkeypatch.setattr(gumbel_darts, "exported_nll",
                        lambda model, choices, kinds, batches: original(model, choices, kinds, counted(batches)))

    def counted(batches):
        batches = list(batches)
        read.append(("exported", len(batches)))
        yield from batches

    search = build_search(search_config("train.max_steps=4", "train.eval_every=2"), SPLITS, VOCAB, tmp_path)
    task, supernet_batches = search.module.training_module, []
    step_of = task.validation_step
    monkeypatch.setattr(task, "validation_step", lambda batch, i: (supernet_batches.append(i), step_of(batch, i))[1])
    search.run()
    n = len(search.data.batches("valid"))
    part = segments_read(n, EARLY_VALID_FRACTION)
    assert 1 <= part < n
    assert read == [("exported", part), ("exported", n)]
    assert supernet_batches == [*range(part), *range(n)]
    history = [line for line in map(json.loads, (tmp_path / "history.jsonl").read_text().splitlines())
               if "val_ppl" in line]
    assert [(h["step"], h.get("valid_fraction", 1.0)) for h in history] == [(2, EARLY_VALID_FRACTION), (4, 1.0)]
    lines = [line for line in capsys.readouterr().out.splitlines() if ": validation perplexity" in line]
    assert [line.endswith(f"supernet ({EARLY_VALID_FRACTION:g} of the split)") for line in lines] == [True, False]


def test_a_search_stopped_at_a_mid_search_evaluation_ends_with_one_on_the_whole_split(tmp_path):
    """The evaluation the export reads is always of the whole validation split: a search stopped early
    (``train.stop_at``) right after an evaluation of a part of it evaluates again."""
    from parnas.pick_config import EARLY_VALID_FRACTION
    from parnas.strategies.search import final_evaluation

    search = run(tmp_path, "train.max_steps=6", "train.eval_every=2", "train.stop_at=2")
    assert search.module.last_evaluation.step == 2
    assert search.module.last_evaluation.valid_fraction == EARLY_VALID_FRACTION
    result = final_evaluation(search)
    assert (result.step, result.valid_fraction) == (2, 1.0)
    whole = evaluate(search.supernet, search.data.batches("valid")).ppl
    assert result.supernet_val_ppl == pytest.approx(whole)
