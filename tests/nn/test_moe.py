"""The ``moe`` kind: a switch-style mixture of experts that routes each token to its top-k experts within their
capacity, with no loop over tokens and nothing read back, trains its router by the load-balancing loss, shows its
load to TensorBoard, and pays top-k experts, not all, for a generated token."""

import numpy as np
import pytest
import torch

from parnas.config import load_config
from parnas.kinds.builtin import MoESettings
from parnas.nn.model import build_fixed_model
from parnas.nn.moe import MoEBlock

VOCAB = 500


def block(**settings) -> MoEBlock:
    torch.manual_seed(0)
    cfg = load_config("tiny", ["model.dropout=0", *(f"model.moe.{k}={v}" for k, v in settings.items())]).model
    with torch.no_grad():
        moe = MoEBlock(cfg).eval()
        moe.b_in.normal_(std=0.1), moe.b_out.normal_(std=0.1), moe.router.weight.normal_(std=1.0)
    return moe


def reference(moe: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """The definition, a token and a choice at a time: queue position by position, choice by choice, row by row;
    an expert's C first routings pass. x (L, B, D) -> (L, B, D)"""
    s, (L, B, _) = moe.settings, x.shape
    probs = moe.router(x).softmax(-1)
    gate, expert = probs.topk(s.top_k, -1)
    C, taken, y = s.capacity(L * B), [0] * s.n_experts, torch.zeros_like(x)
    for t in range(L):
        for r in range(s.top_k):
            for b in range(B):
                e = int(expert[t, b, r])
                if taken[e] < C:
                    taken[e] += 1
                    hidden = torch.relu(x[t, b] @ moe.w_in[e] + moe.b_in[e])
                    y[t, b] += gate[t, b, r] * (hidden @ moe.w_out[e] + moe.b_out[e])
    return y


@pytest.mark.parametrize("settings", [dict(), dict(top_k=2), dict(n_experts=3, capacity_factor=0.5),
                                      dict(n_experts=8, top_k=3, capacity_factor=2.0)])
def test_routing_within_capacity_is_the_definition(settings):
    moe = block(**settings)
    x = torch.randn(7, 3, 32)
    with torch.no_grad():
        torch.testing.assert_close(moe.experts(x), reference(moe, x), atol=1e-5, rtol=1e-5)


def test_a_generated_token_runs_its_top_k_experts_gathered_and_agrees_with_the_dispatch():
    moe = block(n_experts=4, top_k=2, capacity_factor=4.0)
    x = torch.randn(1, 1, 32)  # N * k <= E: the gathered path
    with torch.no_grad():
        torch.testing.assert_close(moe.experts(x), reference(moe, x), atol=1e-5, rtol=1e-5)
        wide = torch.cat([x, torch.randn(5, 1, 32)])  # the same token among others, nothing dropped
        torch.testing.assert_close(moe.experts(wide)[:1], moe.experts(x), atol=1e-5, rtol=1e-5)


def test_the_load_balancing_loss_joins_the_loss_and_trains_the_router():
    cfg = load_config("tiny", ["model.blocks=[moe, attention, moe, dense]", "model.moe.aux_weight=0.5"]).model
    model = build_fixed_model(cfg, VOCAB).train()
    model(torch.randint(0, VOCAB, (4, 8)))
    balance = model.block_metrics["moe/balance_loss"]
    assert torch.allclose(model.aux_loss, 0.5 * 2 * balance.detach(), rtol=1e-5) and balance >= 0.99  # 1: balanced
    model.aux_loss.backward()
    assert model.blocks[0].router.weight.grad.abs().sum() > 0
    assert {"moe/max_load", "moe/dropped", "moe/max_load/block_2"} <= set(model.block_metrics)
    model.eval()
    model(torch.randint(0, VOCAB, (4, 8)))
    assert model.aux_loss == 0.0 and model.block_metrics == {}


def test_training_logs_the_experts_load(tmp_path):
    from parnas.training.data_module import SegmentData
    from parnas.training.latency import zipf_ids
    from parnas.training.task import LanguageModelTask
    from parnas.training.trainer import build_trainer

    cfg = load_config("tiny", ["model.blocks=[moe, dense, attention, dense]", "train.accelerator=cpu",
                               "train.max_steps=2", "train.log_every=1", "train.eval_every=100"])
    ids = zipf_ids(8 * 16 * 6, VOCAB).numpy().astype(np.int64)
    task = LanguageModelTask(cfg.train)
    task.set_model(build_fixed_model(cfg.model, VOCAB))
    trainer = build_trainer(cfg.train, tmp_path, enable_progress_bar=False)
    trainer.fit(task, datamodule=SegmentData({"train": ids, "valid": ids[:256], "test": ids[:256]}, 8, 8, 16))
    assert 1.0 <= float(trainer.callback_metrics["moe/max_load"]) <= 4.0
    assert {"moe/balance_loss", "moe/dropped"} <= set(trainer.callback_metrics)


def test_the_step_reads_nothing_back(benchmark_script):
    host_syncs = benchmark_script("host_syncs")
    cfg = load_config("tiny", ["model.blocks=[moe, attention, moe, dense]", "model.moe.top_k=2"])
    model = build_fixed_model(cfg.model, VOCAB)
    B, L = cfg.data.batch_size, cfg.data.seg_len
    from parnas.training.latency import zipf_ids

    rec = host_syncs.model_step_sites(model, zipf_ids(B * (2 * L + 1), VOCAB).view(B, -1))
    assert rec.total == 0, rec.sites


def test_the_block_compiles_to_one_graph():
    moe = block(top_k=2)
    out = torch._dynamo.explain(moe.experts)(torch.randn(6, 4, 32))
    assert out.graph_break_count == 0, out.break_reasons


def test_more_experts_more_weights_and_the_same_flops_per_token():
    from parnas.strategies.costs import flops_per_token

    small = load_config("tiny", ["model.moe.n_experts=2"]).model
    large = load_config("tiny", ["model.moe.n_experts=8"]).model
    weights = [sum(p.numel() for p in MoEBlock(cfg).parameters()) for cfg in (small, large)]
    assert weights[1] > 3 * weights[0]
    dense = flops_per_token("dense", small, 16, 8)
    for cfg in (small, large):
        assert dense < flops_per_token("moe", cfg, 16, 8) < 1.3 * dense  # the router, and at most capacity
    assert MoESettings(n_experts=4, top_k=1, capacity_factor=1.25).capacity(128) == 40
