"""The PAR space and the Gumbel-DARTS strategy: what a user relies on when searching."""

import atexit
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from nni.nas.nn.pytorch import LayerChoice

from parnas.config import BLOCK_KINDS, ModelConfig, load_config
from parnas.task import evaluate
from search_spaces import PARTransformerXLSpace, fixed_model
from strategies.gumbel_darts import PairedStreams, tau_at
from strategies.search import build_search

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


@pytest.mark.parametrize("schedule", ["exponential", "linear", "cosine"])
def test_tau_starts_ends_and_decreases_every_step(schedule):
    taus = [tau_at(step, 50, 1.0, 0.1, schedule) for step in range(50)]
    assert taus[0] == pytest.approx(1.0) and taus[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(taus, taus[1:]))
    if schedule == "exponential":
        assert taus[1] / taus[0] == pytest.approx(taus[-1] / taus[-2])


def test_paired_streams_cycle_the_architecture_stream_and_mark_restarts():
    pairs = PairedStreams(list(range(7)), ["a", "b", "c"])
    items = [pairs[t] for t in range(len(pairs))]
    assert [i["arch"] for i in items] == list("abcabca")
    assert [i["arch_restart"] for i in items] == [True, False, False, True, False, False, True]


def alphas(search):
    return {m.label: m._arch_alpha.detach().clone() for m in search.supernet.modules() if hasattr(m, "_arch_alpha")}


def test_joint_mode_moves_weights_and_logits_from_the_training_batch_alone(tmp_path):
    search = build_search(search_config("train.max_steps=1"), SPLITS, VOCAB, tmp_path)
    before_alpha = alphas(search)
    before_w = search.supernet.embed.weight.detach().clone()
    search.run()
    assert all(not torch.equal(before_alpha[k], a) for k, a in alphas(search).items())
    assert not torch.equal(before_w, search.supernet.embed.weight)
    assert set(search.module.training_module.mems) == {"train"}


def test_bilevel_reads_the_other_stream_and_keeps_two_memories(tmp_path):
    search = build_search(search_config("train.max_steps=2", "search.mode=bilevel"), SPLITS, VOCAB, tmp_path)
    before_alpha = alphas(search)
    search.run()
    mems = search.module.training_module.mems
    assert set(mems) == {"train", "arch"}
    assert mems["train"][0].shape[0] == 8 and mems["arch"][0].shape[0] == 4  # batch vs eval batch size
    assert all(not torch.equal(before_alpha[k], a) for k, a in alphas(search).items())


@pytest.mark.parametrize("mode", ["joint", "bilevel"])
def test_search_chooses_attention_where_the_task_needs_it(tmp_path, mode):
    search = run(tmp_path, "train.max_steps=600", "search.arch_warmup_steps=200", f"search.mode={mode}")
    attention = [p["attention"] for p in search.module.probabilities().values()]
    assert max(attention) > 0.8, search.module.probabilities()
    assert "attention" in search.module.export().values()


def test_compute_penalty_has_a_gradient_and_makes_identity_win(tmp_path):
    search = build_search(search_config("train.max_steps=300", "search.penalty_weight=5"), SPLITS, VOCAB, tmp_path)
    search.module.set_model(search.supernet)
    search.module.expected_cost().backward()
    assert all(m._arch_alpha.grad.abs().sum() > 0 for m in search.module.choices())
    for m in search.module.choices():
        m._arch_alpha.grad = None
    search.run()
    assert set(search.module.export().values()) == {"identity"}
    assert min(p["identity"] for p in search.module.probabilities().values()) > 0.9


def test_evaluation_uses_no_gumbel_noise_and_is_deterministic(tmp_path):
    search = run(tmp_path, "train.max_steps=20", "search.hard=true")
    batches = search.data.batches("valid")
    first, second = evaluate(search.supernet, batches), evaluate(search.supernet, batches)
    assert first.nll == second.nll and math.isfinite(first.ppl)


def test_history_logs_softmax_probabilities_tau_and_evaluations(tmp_path):
    import json

    run(tmp_path, "train.max_steps=20", "train.eval_every=10", "search.log_every=5")
    lines = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines if "val_ppl" not in line]
    assert steps == [0, 5, 10, 15]
    assert [line["step"] for line in lines if "val_ppl" in line] == [10, 20]
    for line in lines:
        for dist in line["probabilities"].values():
            assert set(dist) == set(BLOCK_KINDS) and sum(dist.values()) == pytest.approx(1.0, abs=1e-5)
    assert lines[0]["tau"] == pytest.approx(1.0)


@pytest.mark.parametrize("setting, needle", [
    ("search.nonsense=1", "unknown config key search.nonsense"),
    ("search.arch_lr=fast", "search.arch_lr must be float"),
    ("search.tau_end=2.0", "must not exceed search.tau_start"),
    ("search.candidates=[attention, convolution]", "unknown block kind 'convolution'"),
    ("search.penalty_weight=-0.1", "search.penalty_weight must be >= 0"),
])
def test_search_refuses_bad_settings_with_one_line(tmp_path, capsys, setting, needle):
    from parnas.cli import main

    code = main(["search", "--config", "tiny", "--set", setting, "--set", f"search.out_dir={tmp_path}/run"])
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
        code = main(["launch", "--config", str(Path(__file__).parents[1] / "search.yaml"), "--port", str(port)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and f"port {port} is already in use" in err, err


def test_usable_as_an_nni_nas_experiment(tmp_path):
    from nni.nas.evaluator.pytorch import Lightning, Trainer
    from nni.nas.experiment import NasExperiment

    from parnas.task import LanguageModelTask
    from parnas.train import SegmentData, build_trainer
    from strategies.gumbel_darts import PARGumbelDARTS

    cfg = search_config("train.max_steps=5", "train.eval_every=5")
    data = SegmentData(SPLITS, 8, 4, 16)
    trainer = build_trainer(cfg.train, tmp_path, trainer_cls=Trainer, gradient_clip_val=None)
    evaluator = Lightning(LanguageModelTask(cfg.train), trainer, datamodule=data)
    experiment = NasExperiment(PARTransformerXLSpace(cfg.model, VOCAB), evaluator,
                               PARGumbelDARTS(cfg.search, max_steps=5, gradient_clip_val=0.25))
    experiment.config.experiment_working_directory = str(tmp_path / "nni")
    experiment.run()
    experiment.stop()  # marks it stopped in nnictl's registry, now rather than at exit when streams are closed
    atexit.unregister(experiment.stop)
    (best,) = experiment.export_top_models(formatter="dict")
    assert list(best) == ["block_0", "block_1"] and set(best.values()) <= set(BLOCK_KINDS)


def test_resume_continues_an_interrupted_search(tmp_path, wt2_slice):
    import json

    from parnas.cli import main

    common = ["--config", "tiny", "--set", f"data.path={wt2_slice}", "--set", "data.vocab_size=300",
              "--set", "model.cutoffs=[100, 200]", "--set", f"search.out_dir={tmp_path}", "--set", "search.log_every=5",
              "--set", "train.ckpt_every=10", "--set", "train.eval_every=100"]
    assert main(["search", *common, "--set", "train.max_steps=10"]) == 0
    assert main(["search", *common, "--set", "train.max_steps=10"]) == 2  # a fresh search would overwrite it
    assert main(["search", *common, "--set", "train.max_steps=20", "--resume"]) == 0
    record = json.loads((tmp_path / "architecture.json").read_text())
    assert record["search"]["steps"] == 20
    steps = [json.loads(line)["step"] for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    logged = [s for s in steps if s % 5 == 0]
    assert logged == sorted(set(logged)) and logged[-1] >= 15
