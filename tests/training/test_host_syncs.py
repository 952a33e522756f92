"""Host syncs in a training step, found on the CPU (benchmarks/host_syncs.py's recorder): which of parnas's own
lines read a device value back, per step. On a GPU each one stops the host until the queue has run, so none may
creep into the step unnoticed; tests/gpu/test_gpu_compile.py checks the recorder against CUDA's own sync counter."""

import numpy as np
import pytest
import torch

from parnas.config import load_config
from parnas.nn.model import build_fixed_model
from parnas.training.latency import zipf_ids

VOCAB = 1000


@pytest.fixture
def host_syncs(benchmark_script):
    return benchmark_script("host_syncs")


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
HEADS = [("[]", []), ("[100, 400]", []), ("[50, 100, 400]", []), ("[50, 100, 400]", TIED),
         ("[50, 100, 400]", ["model.adaptive_input=true"]), ("[50, 100, 400]", ["model.adaptive_input=true", *TIED])]


@pytest.mark.parametrize("cutoffs, extra", HEADS)
def test_the_model_step_reads_nothing_back_when_its_targets_are_grouped_on_the_host(host_syncs, cutoffs, extra):
    """Forward, loss, backward, clipping, fused Adam, with the targets grouped on the host as the training loop
    groups them: nothing is read back, whatever the output head (full softmax, torch's adaptive softmax, the
    projected one, tied or not) and whether the input is adaptive (its clusters are looked up masked)."""
    cfg = load_config("tiny", [f"model.cutoffs={cutoffs}", "model.div_value=2", "model.dropout=0.1", *extra])
    model = build_fixed_model(cfg.model, VOCAB)
    B, L = cfg.data.batch_size, cfg.data.seg_len
    rec = host_syncs.model_step_sites(model, zipf_ids(B * (2 * L + 1), VOCAB).view(B, -1))
    assert rec.total == 0, rec.sites


@pytest.mark.parametrize("cutoffs, extra", HEADS[1:])
def test_targets_not_grouped_on_the_host_cost_the_adaptive_softmax_one_read_back(host_syncs, cutoffs, extra):
    """Without host groups (an NNI one-shot strategy's loop, which forwards no batch hook), the adaptive softmax
    reads its clusters' row counts in one copy, however many tail clusters it has."""
    cfg = load_config("tiny", [f"model.cutoffs={cutoffs}", "model.div_value=2", "model.dropout=0.1", *extra])
    model = build_fixed_model(cfg.model, VOCAB)
    B, L = cfg.data.batch_size, cfg.data.seg_len
    rec = host_syncs.model_step_sites(model, zipf_ids(B * (2 * L + 1), VOCAB).view(B, -1), host_groups=False)
    assert rec.total == 1 and all("(group_by_cluster)" in site for site in rec.sites), rec.sites


def test_a_lightning_training_and_search_step_read_nothing_back(host_syncs, tmp_path):
    """One whole loop iteration (batch start to the next), without a progress bar (a log, an NNI trial), reads
    nothing back, in a plain step and in a search under a latency budget alike, whichever cost its hinge is on,
    whether its multiplier is found or fixed and whether its step is fair or mixed: the adaptive softmax's
    targets are grouped on the host before the batch moves, the finite-loss check, the budget's argmax and its
    multiplier stay on the device, a fair step's picks are drawn on the host, and no metric is read back for a
    progress bar."""
    from parnas.strategies.costs import CostModel
    from parnas.strategies.search import build_search
    from parnas.training.data_module import SegmentData
    from parnas.training.task import LanguageModelTask
    from parnas.training.trainer import build_trainer

    cfg_overrides = ["train.accelerator=cpu", "train.max_steps=5", "train.log_every=5",
                     "search.par-gumbel-darts.latency_budget=0.9"]
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
    assert record.recorder.total == 0, record.recorder.sites  # nothing in parnas, Lightning or NNI

    costs = CostModel({"attention": 3.0, "dense": 1.0, "identity": 0.0}, 1.0, "ms/step", cfg.model.n_blocks)
    for run, hinge in enumerate(([], ["search.par-gumbel-darts.penalty_weight=2"],
                                  # the default (gumbel): every candidate mixed
                                 ["search.par-gumbel-darts.forward=fair"])):
        search = build_search(load_config("tiny", [*cfg_overrides, *hinge]), splits, VOCAB,
                              tmp_path / "search" / str(run), costs=costs)
        record = host_syncs.RecordStep(3)
        search.trainer.callbacks.append(record)
        search.run()
        assert record.recorder.total == 0, (hinge, record.recorder.sites)  # nothing in parnas, Lightning or NNI
