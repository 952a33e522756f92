"""The optimiser step: fused Adam wherever no gradient scaler needs to unscale first, and gradient clipping that
still holds the global norm to ``train.clip`` (the task clips for Lightning where Lightning refuses to)."""

import numpy as np
import pytest
import torch

from parnas.config import load_config
from parnas.nn.model import build_fixed_model
from parnas.training.latency import zipf_ids
from parnas.training.task import LanguageModelTask, adam

VOCAB = 1000


@pytest.mark.parametrize("precision, fused", [("32-true", True), ("bf16-mixed", True), ("16-mixed", None)])
def test_adam_is_fused_unless_a_gradient_scaler_must_unscale_first(precision, fused):
    model = build_fixed_model(load_config("tiny").model, VOCAB)
    assert adam(model.parameters(), 1e-3, precision=precision).defaults["fused"] is fused


def test_the_task_clips_the_global_gradient_norm_to_the_clip_value():
    task = LanguageModelTask(load_config("tiny", ["train.precision=bf16-mixed"]).train)
    task.set_model(build_fixed_model(load_config("tiny").model, VOCAB))
    params = list(task.model.parameters())
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    optimizer = adam(params, 1e-3, precision="bf16-mixed")
    task.configure_gradient_clipping(optimizer, 0.25, "norm")
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    assert norm.item() == pytest.approx(0.25, rel=1e-4)
    task.configure_gradient_clipping(optimizer, 10.0, "norm")  # under the clip value: left as it is
    assert torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])).item() \
        == pytest.approx(0.25, rel=1e-4)


def fit_weights(tmp_path, monkeypatch, fused: bool) -> tuple[dict[str, torch.Tensor], bool]:
    from parnas.training import task as task_module
    from parnas.training.data_module import SegmentData
    from parnas.training.trainer import build_trainer

    cfg = load_config("tiny", ["train.accelerator=cpu", "train.max_steps=4", "train.precision=bf16-mixed",
                               "train.clip=0.05", "train.eval_every=100"])
    if not fused:  # the previous path: unfused Adam, clipped by Lightning's precision plugin
        monkeypatch.setattr(task_module, "SCALED_PRECISIONS", ("16-mixed", "16", "bf16-mixed"))
    B, L = cfg.data.batch_size, cfg.data.seg_len
    ids = zipf_ids(B * L * 8, VOCAB, seed=1).numpy().astype(np.int64)
    torch.manual_seed(0)
    task = LanguageModelTask(cfg.train)
    task.set_model(build_fixed_model(cfg.model, VOCAB))
    trainer = build_trainer(cfg.train, tmp_path / ("fused" if fused else "plain"), enable_progress_bar=False)
    trainer.fit(task, datamodule=SegmentData({"train": ids, "valid": ids[:B * L * 2], "test": ids[:B * L * 2]},
                                             B, B, L))
    monkeypatch.undo()
    return {k: v.clone() for k, v in task.model.state_dict().items()}, bool(trainer.optimizers[0].defaults["fused"])


def test_bf16_mixed_training_with_clipping_runs_fused_adam_and_matches_the_unfused_path(tmp_path, monkeypatch):
    fused_weights, was_fused = fit_weights(tmp_path, monkeypatch, fused=True)
    plain_weights, plain_was_fused = fit_weights(tmp_path, monkeypatch, fused=False)
    assert was_fused and not plain_was_fused
    for key, value in fused_weights.items():
        torch.testing.assert_close(value, plain_weights[key], rtol=1e-4, atol=1e-5, msg=key)
