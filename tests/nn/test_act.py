"""The ``ut`` block kind: a Universal Transformer layer under adaptive computation time."""

import numpy as np
import pytest
import torch

from parnas.config import load_config
from parnas.errors import ConfigError
from parnas.nn.act import ACTBlock
from parnas.nn.blocks import sinusoid
from parnas.nn.model import build_fixed_model

B, L = 2, 8


def block(max_steps: int, halt_bias: float, tau: float = 0.1) -> ACTBlock:
    torch.manual_seed(0)
    cfg = load_config("tiny", [f"model.ut.max_steps={max_steps}", f"model.ut.tau={tau}", "model.dropout=0.0"])
    b = ACTBlock(cfg.model)
    torch.nn.init.zeros_(b.halt.weight)
    torch.nn.init.constant_(b.halt.bias, halt_bias)
    return b


def test_one_step_is_one_universal_transformer_layer_with_its_timestep_signal():
    b = block(1, 0.0)
    h, mem, pos = torch.randn(B, L, 32), torch.randn(B, 4, 32), sinusoid(4 + L, 32)
    s = b.signals[0]
    expected = b.transition(b.attention(h + s, mem + s, pos), mem, pos)
    torch.testing.assert_close(b(h, mem, pos), expected)
    assert b.metrics["act/steps"].item() == 1.0


@pytest.mark.parametrize("halt_bias, steps", [(8.0, 1), (0.0, 2), (-8.0, 5)])
def test_positions_ponder_as_long_as_their_halting_unit_says(halt_bias, steps):
    """p ~ 1: the first step passes 1 - eps; p = 1/2: the second does; p ~ 0: every position takes every step."""
    b = block(5, halt_bias)
    b(torch.randn(B, L, 32), torch.randn(B, 0, 32), sinusoid(L, 32))
    assert b.metrics["act/steps"].item() == steps


def test_the_output_is_the_halting_weighted_mean_of_the_states_and_the_ponder_cost_trains_the_halt():
    b = block(3, 0.0)  # p = 1/2: step 1 weighs 1/2, step 2 would pass 1 - eps: it halts with the remainder 1/2
    h, pos = torch.randn(B, L, 32), sinusoid(L, 32)
    states, x = [], h
    for t in range(3):
        s = b.signals[t]
        x = b.transition(b.attention(x + s, h[:, :0] + s, pos), h[:, :0], pos)
        states.append(x)
    out = b(h, h[:, :0], pos)
    torch.testing.assert_close(out, 0.5 * states[0] + 0.5 * states[1])
    assert b.aux_loss is not None and b.aux_loss.item() == pytest.approx(0.1 * (2 + 0.5))  # tau (N + R)
    b.aux_loss.backward()
    assert b.halt.bias.grad is not None
    b.eval()
    b(h, h[:, :0], pos)
    assert b.aux_loss is None  # no ponder cost outside training


def test_a_model_with_ut_blocks_adds_the_ponder_cost_keeps_memory_and_generates(run_layout):
    model, h, mems = run_layout("[ut, dense, attention, ut]", "model.ut.max_steps=3")
    model(torch.randint(0, 500, (4, 16)))
    assert isinstance(model.aux_loss, torch.Tensor) and model.aux_loss.item() > 0
    assert 1.0 <= model.block_metrics["act/steps"].item() <= 3.0
    assert mems[0].shape == (4, 16, 32) and mems[3].shape == (4, 16, 32)


def test_training_logs_the_mean_steps(tmp_path):
    from parnas.training.data_module import SegmentData
    from parnas.training.latency import zipf_ids
    from parnas.training.task import LanguageModelTask
    from parnas.training.trainer import build_trainer

    cfg = load_config("tiny", ["model.blocks=[ut, dense, attention, dense]", "train.accelerator=cpu",
                               "train.max_steps=2", "train.log_every=1", "train.eval_every=100"])
    ids = zipf_ids(8 * 16 * 6, 500).numpy().astype(np.int64)
    task = LanguageModelTask(cfg.train)
    task.set_model(build_fixed_model(cfg.model, 500))
    trainer = build_trainer(cfg.train, tmp_path, enable_progress_bar=False)
    trainer.fit(task, datamodule=SegmentData({"train": ids, "valid": ids[:256], "test": ids[:256]}, 8, 8, 16))
    assert 1.0 <= float(trainer.callback_metrics["act/steps"]) <= cfg.model.settings_of("ut").max_steps


@pytest.mark.parametrize("settings, needle", [(["model.ut.max_steps=0"], "model.ut.max_steps must be >= 1"),
                                              (["model.ut.tau=-0.1"], "model.ut.tau must be >= 0")])
def test_act_settings_that_cannot_work_are_refused(settings, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config("tiny", settings)


def test_each_ut_block_reports_its_own_steps(run_layout):
    model, _, _ = run_layout("[ut, dense, attention, ut]", "model.ut.max_steps=3")
    per_block = {k: v.item() for k, v in model.block_metrics.items() if k.startswith("act/steps/")}
    assert set(per_block) == {"act/steps/block_0", "act/steps/block_3"}
    assert model.block_metrics["act/steps"].item() == pytest.approx(sum(per_block.values()) / 2, rel=1e-6)


@pytest.mark.slow  # a search and its figure
def test_a_search_with_ut_logs_its_steps_per_block_and_the_figure_shows_them(tmp_path):
    from parnas.report.history import load_history
    from parnas.report.plots import architecture_figure
    from tests.strategies.test_search import run

    run(tmp_path, "search.candidates=[ut, dense]", "train.max_steps=4", "search.log_every=2",
        "model.ut.max_steps=3")
    history = load_history(tmp_path)
    assert set(history.act_steps) == {"block_0", "block_1"}
    assert all(1.0 <= s <= 3.0 for s in history.act_steps.values())
    record = {"architecture": {"block_0": "ut", "block_1": "dense"}, "search": {}}
    texts = [t.get_text() for t in architecture_figure(history, record).axes[0].texts]
    assert f"block 0: ut \u00b7 {history.act_steps['block_0']:.1f} steps" in texts, texts
    assert "block 1: dense" in texts
