"""Host syncs in a training step, found on the CPU (benchmarks/host_syncs.py's recorder): which of parnas's own
lines read a device value back, per step. On a GPU each one stops the host until the queue has run, so none may
creep into the step unnoticed; tests/test_gpu.py checks the recorder against CUDA's own sync counter."""

import numpy as np
import pytest
import torch

from parnas.config import load_config
from parnas.nn.model import build_fixed_model
from parnas.training.latency import zipf_ids

VOCAB = 1000


@pytest.fixture
def host_syncs(benchmark):
    return benchmark("host_syncs")


def test_the_recorder_sees_reads_back_and_uploads_and_nothing_else(host_syncs):
    """Read-backs, and tensors made from Python numbers on a named device (on a GPU an upload that waits for the
    stream); not device work, fills, a move to the step's device or a tensor made on the host."""
    t = torch.tensor([1.0, 0.0, 2.0])
    with host_syncs.SyncRecorder() as rec:
        t.sum().item(), bool(t[0]), int(t[2]), t.nonzero(), t[t > 0], t.tolist(), t.cpu(), t.to("cpu")
        torch.tensor(0.5, device=t.device), t.new_tensor([1, 2]), torch.as_tensor([3.0], device=t.device)
        (t * 2).exp().sum(), t.to(torch.device("cpu")), t[1:]  # device work and a move to the step's device
        torch.tensor(0.5), t.new_full((), 2.0), torch.as_tensor(t, device=t.device)  # host-made, a fill, no copy
    assert sorted(site.split(" at ")[0] for site in rec.sites.elements()) == [
        "__bool__", "__getitem__", "__int__", "as_tensor", "cpu", "item", "new_tensor", "nonzero", "tensor", "to",
        "tolist"]
    assert all("test_host_syncs.py" in site for site in rec.sites)


TIED = ["model.tie_weights=true", "model.div_value=1"]


@pytest.mark.parametrize("cutoffs, syncs, extra", [("[]", 0, []), ("[100, 400]", 1, []), ("[50, 100, 400]", 1, []),
                                                   ("[50, 100, 400]", 1, TIED),
                                                   ("[50, 100, 400]", 2, ["model.adaptive_input=true"])])
def test_the_model_step_syncs_only_once_for_the_adaptive_softmax(host_syncs, cutoffs, syncs, extra):
    """Forward, loss, backward, clipping, fused Adam: a full softmax reads nothing back; the adaptive softmax
    reads its clusters' row counts in one copy, however many tail clusters it has (torch's or the projected
    one); an adaptive input reads its own ids' counts once more."""
    cfg = load_config("tiny", [f"model.cutoffs={cutoffs}", "model.div_value=2", "model.dropout=0.1", *extra])
    model = build_fixed_model(cfg.model, VOCAB)
    B, L = cfg.data.batch_size, cfg.data.seg_len
    rec = host_syncs.model_step_sites(model, zipf_ids(B * (2 * L + 1), VOCAB).view(B, -1))
    assert rec.total == syncs and all("(group_by_cluster)" in site or "(_adaptive_nll)" in site
                                      for site in rec.sites), rec.sites


def own(sites):
    """The sites in parnas's own code (the first frame outside torch is one of its packages)."""
    return {site.split(" at ")[1].split(":")[0] + " " + site.split("(")[-1].rstrip(")"): n
            for site, n in sites.items()
            if site.split(" at ")[1].startswith(("parnas/", "strategies/", "retrain/", "study/"))}


def test_a_lightning_training_and_search_step_read_back_only_these_values(host_syncs, tmp_path):
    """One whole loop iteration (batch start to the next), without a progress bar (a log, an NNI trial): the only
    read is the adaptive softmax's cluster sizes, in a plain step and in a search under a latency budget alike,
    whichever cost its hinge is on and whether its multiplier is found or fixed (the finite-loss check, the
    budget's argmax and its multiplier stay on the device, and no metric is read back for a progress bar)."""
    from parnas.training.fit import SegmentData, build_trainer
    from parnas.training.task import LanguageModelTask
    from strategies.costs import CostModel
    from strategies.search import build_search

    cfg_overrides = ["train.accelerator=cpu", "train.max_steps=5", "train.log_every=5", "search.latency_budget=0.9"]
    cfg = load_config("tiny", cfg_overrides)
    B, L = cfg.data.batch_size, cfg.data.seg_len
    ids = zipf_ids(B * L * 20, VOCAB).numpy().astype(np.int64)
    splits = {"train": ids, "valid": ids[:B * L * 4], "test": ids[:B * L * 4]}
    task = LanguageModelTask(cfg.train)
    task.set_model(build_fixed_model(cfg.model, VOCAB))
    record = host_syncs.RecordStep(3)
    trainer = build_trainer(cfg.train, tmp_path / "train", enable_progress_bar=False)
    trainer.callbacks = [*trainer.callbacks, record]
    trainer.fit(task, datamodule=SegmentData(splits, B, B, L))
    assert own(record.recorder.sites) == {"parnas/nn/model.py _adaptive_nll": 1}
    assert record.recorder.total == 1, record.recorder.sites  # nothing in Lightning or NNI either

    costs = CostModel({"attention": 3.0, "dense": 1.0, "identity": 0.0}, 1.0, "ms/step", cfg.model.n_blocks)
    for hinge in ([], ["search.budget_hinge=expected"], ["search.budget_hinge=expected", "search.penalty_weight=2"]):
        search = build_search(load_config("tiny", [*cfg_overrides, *hinge]), splits, VOCAB,
                              tmp_path / "search" / str(len(hinge)), costs=costs)
        record = host_syncs.RecordStep(3)
        search.trainer.callbacks.append(record)
        search.run()
        assert own(record.recorder.sites) == {"parnas/nn/model.py _adaptive_nll": 1}, hinge
        assert record.recorder.total == 1, (hinge, record.recorder.sites)  # nothing in Lightning or NNI either
