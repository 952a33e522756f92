"""End to end through Lightning: it learns, and it writes what a user keeps."""

import json

import numpy as np
import pytest

from parnas.cli import main
from parnas.config import DataConfig
from parnas.data.corpora import load_splits


def unigram_perplexity(ids: np.ndarray) -> float:
    """exp(entropy) of the split's own unigram distribution: the best context-free model of it, which a trained
    model must beat."""
    counts = np.bincount(np.asarray(ids).ravel())
    p = counts[counts > 0] / counts.sum()
    return float(np.exp(-(p * np.log(p)).sum()))


@pytest.mark.slow
def test_it_learns_far_below_the_unigram_perplexity(wt2_slice, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--config", "tiny", "--set", f"data.path={wt2_slice}", "--set", "data.vocab_size=500",
                 "--set", "model.cutoffs=[100, 250]", "--set", "train.max_steps=300",
                 "--set", "train.eval_every=150", "--set", f"train.out_dir={out}"])
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    _, splits = load_splits(DataConfig(path=str(wt2_slice), vocab_size=500))
    unigram = unigram_perplexity(splits["valid"])
    assert metrics["steps"] == 300
    assert metrics["val_ppl"] < 0.6 * unigram, (metrics["val_ppl"], unigram)
    assert metrics["val_tokens"] + metrics["val_untargeted_tokens"] == len(splits["valid"])
    assert "validation perplexity" in capsys.readouterr().out
    assert (out / "checkpoints" / "last.ckpt").is_file()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_tensorboard_and_the_progress_lines_get_the_training_scalars_at_their_steps(small_corpus, tmp_path, capsys):
    """A step whose scalars nothing reads logs none: TensorBoard still gets the training loss, perplexity and
    learning rate every ``train.log_every`` steps (counted as steps taken), the progress lines the loss after the
    first step and every ``train.log_every``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    code = main(["train", "--config", "tiny", "--set", f"data.path={small_corpus}", "--set", "data.vocab_size=500",
                 "--set", "model.cutoffs=[100, 250]", "--set", "train.max_steps=12", "--set", "train.log_every=5",
                 "--set", "train.eval_every=100", "--set", f"train.out_dir={out}"])
    assert code == 0
    progress = [line for line in capsys.readouterr().out.splitlines() if ", train loss " in line]
    assert [line.split("/")[0] for line in progress] == ["step 1", "step 5", "step 10"]
    (events,) = (out / "tensorboard").glob("events.out.tfevents.*")
    board = EventAccumulator(str(events))
    board.Reload()
    for tag in ("train/loss", "train/ppl", "train/lr"):
        assert [e.step for e in board.Scalars(tag)] == [5, 10], tag


def test_throughput_on_cuda_never_waits_for_the_gpu_inside_a_step(monkeypatch):
    """A synchronize around every batch would stop the host from queuing the next step: on CUDA the batches
    are bracketed by events, read back once per Throughput.FOLD_EVERY batches and at the end. A mocked CUDA
    device shows it without a GPU."""
    from types import SimpleNamespace

    import torch

    from parnas.training.trainer import Throughput

    waits = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing

        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            waits.append(1)

        def elapsed_time(self, end: "Event") -> float:
            return 10.0  # ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (_ for _ in ()).throw(AssertionError("synchronize")))
    throughput, trainer = Throughput(), SimpleNamespace(world_size=2)
    module = SimpleNamespace(device=torch.device("cuda", 0))
    batch = (torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))
    steps = 2 * Throughput.FOLD_EVERY + 50
    for _ in range(steps):
        throughput.on_train_batch_start(trainer, module, batch, 0)
        throughput.on_train_batch_end(trainer, module, None, batch, 0)
    assert len(waits) == 2  # one read-back per FOLD_EVERY batches, none per step
    assert throughput.state_dict() == {"tokens": steps * 32 * 2, "seconds": pytest.approx(steps * 0.010)}
    assert len(waits) == 3 and throughput.tokens_per_s == pytest.approx(64 / 0.010)
