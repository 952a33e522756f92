"""``model.reversible``: reversible residual pairs whose activations are recomputed in the backward pass."""

import numpy as np
import pytest
import torch

from parnas.config import load_config
from parnas.errors import ConfigError
from parnas.nn import model as model_module
from parnas.nn.model import build_fixed_model

VOCAB = 500


def reversible(*settings):
    cfg = load_config("tiny", ["model.reversible=true", "model.lsh.chunk_len=8", *settings])
    torch.manual_seed(0)
    return build_fixed_model(cfg.model, VOCAB).double()


def step_gradients(model, x, mems, monkeypatch=None, recompute=True):
    if not recompute:
        original = model_module.reversible_stack
        monkeypatch.setattr(model_module, "reversible_stack", lambda *a, **k: original(*a, recompute=False))
    torch.manual_seed(5)  # dropout and lsh rotations draw the same in both runs
    h, new = model(x, mems)
    model.nll(h, x).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    if not recompute:
        monkeypatch.undo()
    return h, new, grads


@pytest.mark.parametrize("layout", ["[attention, dense, identity, lsh]", "[attention, dense, attention, dense]"])
def test_recomputed_gradients_equal_those_of_ordinary_autograd_in_float64(monkeypatch, layout):
    """Dropout and lsh's rotations on, two segments with memory: the backward that rebuilds each pair's inputs
    from its outputs gives the gradients autograd gives when it keeps every activation."""
    model = reversible(f"model.blocks={layout}", "model.dropout=0.2", "model.dropatt=0.1")
    x = torch.randint(0, VOCAB, (4, 16))
    mems = None
    for _ in range(2):
        h, new, recomputed = step_gradients(model, x, mems)
        h_ref, _, kept = step_gradients(model, x, mems, monkeypatch, recompute=False)
        torch.testing.assert_close(h, h_ref, rtol=0, atol=1e-12)
        for name, grad in kept.items():
            torch.testing.assert_close(recomputed[name], grad, rtol=1e-10, atol=1e-12, msg=name)
        assert [m is None for m in new] == [False, True, True, False] if "identity" in layout else True
        mems = new


def saved_bytes(model, x):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h, _ = model(x)
        loss = model.nll(h, x).sum()
    loss.backward()
    return total


def test_the_activations_kept_for_backward_do_not_grow_with_depth():
    x = torch.randint(0, VOCAB, (4, 16))
    kept = {}
    for rev in (True, False):
        for n in (4, 16):
            cfg = load_config("tiny", [f"model.reversible={str(rev).lower()}", f"model.n_blocks={n}",
                                       "model.dropout=0.1"])
            torch.manual_seed(0)
            kept[rev, n] = saved_bytes(build_fixed_model(cfg.model, VOCAB), x)
    assert kept[False, 16] > 3 * kept[False, 4]  # ordinary residuals keep each block's activations
    assert kept[True, 16] < 1.05 * kept[True, 4], kept  # reversible pairs keep the top of the stack only


def test_a_reversible_model_trains_through_lightning(tmp_path):
    from parnas.training.data_module import SegmentData
    from parnas.training.latency import zipf_ids
    from parnas.training.task import LanguageModelTask
    from parnas.training.trainer import build_trainer

    cfg = load_config("tiny", ["model.reversible=true", "train.accelerator=cpu", "train.max_steps=3",
                               "train.eval_every=3"])
    ids = zipf_ids(8 * 16 * 6, VOCAB).numpy().astype(np.int64)
    task = LanguageModelTask(cfg.train)
    task.set_model(build_fixed_model(cfg.model, VOCAB))
    before = {n: p.detach().clone() for n, p in task.model.named_parameters()}
    trainer = build_trainer(cfg.train, tmp_path, enable_progress_bar=False)
    trainer.fit(task, datamodule=SegmentData({"train": ids, "valid": ids[:256], "test": ids[:256]}, 8, 8, 16))
    assert all(not torch.equal(p, before[n]) for n, p in task.model.named_parameters() if n.startswith("blocks"))
    assert task.val_history and np.isfinite(task.val_history[-1]["val_ppl"])


@pytest.mark.parametrize("settings, needle", [
    (["model.n_blocks=3"], "model.n_blocks must be even"),
    (["model.blocks=[attention, compressive, dense, dense]"], "cannot recompute compressive"),
    (["model.blocks=[ut, dense, attention, dense]"], "cannot recompute ut"),
])
def test_what_reversible_pairs_cannot_run_is_refused(settings, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config("tiny", ["model.reversible=true", *settings])


def test_search_refuses_reversible_pairs(capsys, tmp_path):
    from parnas.cli import main

    out = tmp_path / "search"
    assert main(["search", "--config", "tiny", "--set", "model.reversible=true", "--set",
                 f"search.out_dir={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.reversible" in err and not out.exists()
