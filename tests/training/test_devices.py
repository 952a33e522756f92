"""Devices: every step runs where the weights are, and a device this machine lacks is refused before any file.

Without a GPU, a model on the ``meta`` device stands for one: a tensor sent anywhere else would meet it
in its first layer. A GPU that lacks something (bfloat16, a second card) is mocked.
"""

import pytest
import torch

from parnas.cli import main
from parnas.config import ModelConfig, load_config
from parnas.errors import ConfigError
from parnas.nn.model import build_fixed_model
from parnas.training.devices import check_devices, training_device
from parnas.training.task import LanguageModelTask


class _Stop(Exception):
    pass


def meta_model() -> torch.nn.Module:
    return build_fixed_model(ModelConfig(n_blocks=2, d_model=16, n_heads=2, d_ff=32, mem_len=4, cutoffs=()),
                             50).to("meta")


def test_restored_memory_goes_to_the_device_of_the_batch():
    """A resumed run's memory (saved on the CPU) must join the batch where the step runs, whatever device the
    Lightning module believes it is on (it says cpu here; the batch is on meta)."""
    task = LanguageModelTask(load_config("tiny").train)
    saved = [torch.arange(4 * 3 * 2.0).view(4, 3, 2), None]  # 4 streams, memory 3, width 2
    x = torch.empty(4, 8, dtype=torch.long, device="meta")
    local = task.local_memory(saved, x)
    assert task.device == torch.device("cpu") and local[0].device == torch.device("meta") and local[1] is None
    assert local[0].shape == (4, 3, 2)


class _Tokenizer:
    eos_id = 0

    def encode(self, line: str) -> list[int]:
        return [1 + ord(c) % 40 for c in line]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_runs_and_samples_where_the_weights_are(monkeypatch, temperature):
    from parnas.retrain.evaluate import Sampling, generate
    from parnas.retrain.load import TrainedModel

    model, seen = meta_model(), []

    def record(module, args):
        seen.append(("prompt", args[0].device))
        raise _Stop

    def generator(device=None):
        seen.append(("generator", torch.device(device)))
        return real_generator()

    real_generator = torch.Generator
    monkeypatch.setattr(torch, "Generator", generator)
    model.register_forward_pre_hook(record)
    trained = TrainedModel(model, load_config("tiny"), _Tokenizer(), 0)
    with pytest.raises(_Stop):
        generate(trained, "ab", Sampling(tokens=3, temperature=temperature))
    assert seen[-1] == ("prompt", torch.device("meta"))
    assert [d for what, d in seen if what == "generator"] == ([torch.device("meta")] if temperature else [])


# --- devices this machine lacks: one line, exit 2, nothing written -----------------------------------------

@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


@pytest.fixture
def old_gpu(monkeypatch):
    """One CUDA card without bfloat16 (a T4)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "Tesla T4")


def run(capsys, command, tmp_path, *settings):
    """``parnas COMMAND`` on tiny with ``settings``; returns (status, stderr)."""
    extra = {"retrain": ["--arch", "transformer-xl"], "study": ["--out", str(tmp_path / "run"), "--seeds", "1"]}
    sets = [f"train.out_dir={tmp_path}/run", f"search.out_dir={tmp_path}/run", *settings]
    code = main([command, *extra.get(command, []), "--config", "tiny", *[a for s in sets for a in ("--set", s)]])
    return code, capsys.readouterr().err.strip()


COMMANDS = ["train", "retrain", "search", "study"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
def test_a_gpu_asked_for_without_one_is_refused_before_anything_is_written(capsys, tmp_path, no_gpu, command,
                                                                           accelerator):
    code, err = run(capsys, command, tmp_path, f"train.accelerator={accelerator}")
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"train.accelerator={accelerator}" in err and "sees no CUDA device" in err and "accelerator=cpu" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bfloat16_on_a_gpu_without_it_is_refused(capsys, tmp_path, old_gpu, command, precision):
    code, err = run(capsys, command, tmp_path, "train.accelerator=auto", f"train.precision={precision}")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"train.precision={precision} needs bfloat16" in err and "Tesla T4 (compute capability 7.5)" in err
    assert not (tmp_path / "run").exists()


def test_more_processes_than_gpus_is_refused(capsys, tmp_path, old_gpu):
    code, err = run(capsys, "train", tmp_path, "train.accelerator=gpu", "train.devices=2")
    assert code == 2 and "train.devices=2" in err and "1 CUDA device;" in err, err
    assert not (tmp_path / "run").exists()


def test_what_each_accelerator_setting_trains_on(monkeypatch, no_gpu):
    cfg = load_config("tiny")
    for accelerator in ("auto", "cpu"):
        check_devices(load_config("tiny", [f"train.accelerator={accelerator}", "train.precision=bf16-mixed"]).train)
        assert training_device(load_config("tiny", [f"train.accelerator={accelerator}"]).train).type == "cpu"
    with pytest.raises(ConfigError, match="sees no MPS device"):
        check_devices(load_config("tiny", ["train.accelerator=mps"]).train)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert training_device(cfg.train) == torch.device("cuda", 0)  # auto takes CUDA where there is one
    assert training_device(load_config("tiny", ["train.accelerator=cpu"]).train).type == "cpu"


def test_a_gpu_config_still_loads_where_there_is_no_gpu(no_gpu):
    """What a machine has is checked when a run starts, not when a config is read: a checkpoint trained on
    a GPU (its config says gpu, bf16) must stay readable, evaluable and resumable on a laptop."""
    cfg = load_config("tiny", ["train.accelerator=gpu", "train.precision=bf16-mixed"])
    assert cfg.train.accelerator == "gpu"
    with pytest.raises(ConfigError):
        check_devices(cfg.train)


@pytest.mark.slow  # a compile or a training run of seconds: `make test` runs it, `make test-fast` not
def test_bf16_mixed_trains_on_the_cpu(wt2_slice, tmp_path, capsys):
    """Lightning runs bf16-mixed on the CPU too; the adaptive softmax's log-probabilities are float32 there as
    CUDA's autocast makes them (CPU autocast leaves log_softmax in bfloat16, which index_add then refused)."""
    import json

    out = tmp_path / "run"
    code = main(["train", "--config", "tiny", *[a for s in (f"data.path={wt2_slice}", "data.vocab_size=300",
                                                            "model.cutoffs=[100, 200]", "train.accelerator=cpu",
                                                            "train.precision=bf16-mixed", "train.max_steps=3",
                                                            f"train.out_dir={out}") for a in ("--set", s)]])
    assert code == 0, capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["precision"] == "bf16-mixed" and 1 < metrics["val_ppl"] < 1e4


@pytest.fixture
def pins(monkeypatch):
    """``Tensor.pin_memory`` without a GPU: a copy marked pinned (and the tensors it made, in order)."""
    made = []

    def pin_memory(self):
        copy = self.clone()
        copy.is_pinned = lambda: True
        made.append(copy)
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return made


@pytest.mark.parametrize("device, pinned_batch", [("cuda", True), ("cpu", False), ("meta", False)])
def test_a_batch_bound_for_a_gpu_leaves_the_host_from_pinned_memory(pins, device, pinned_batch):
    """From pageable memory a copy to the GPU may wait for the GPU's queue to drain, every step; so every host
    tensor of a batch Lightning moves to a CUDA device (tokens, targets, the targets' cluster order) is pinned
    first, once, with its values kept; a batch for any other device is handed on as it is."""
    from types import SimpleNamespace

    from parnas.nn.adaptive import TargetCapacity
    from parnas.training.data_module import SegmentData

    model = build_fixed_model(ModelConfig(n_blocks=2, d_model=16, n_heads=2, d_ff=32, cutoffs=(10, 20)), 50)
    task = LanguageModelTask(load_config("tiny").train)
    task.set_model(model)
    data = SegmentData({}, 2, 2, 4)
    data.trainer = SimpleNamespace(lightning_module=task, strategy=SimpleNamespace(root_device=torch.device(device)),
                                   training=True, world_size=1)
    x, y = torch.randint(0, 50, (2, 4)), torch.randint(0, 50, (2, 4))
    batch = data.on_before_batch_transfer((x, y), 0)
    tensors = [batch[0], batch[1], batch[2].order]
    assert len(batch) == 3 and sorted(batch[2].order.tolist()) == list(range(2 * 4))
    assert [t.is_pinned() for t in tensors] == [pinned_batch] * 3
    assert len(pins) == (3 if pinned_batch else 0)
    assert torch.equal(batch[0], x) and torch.equal(batch[1], y)
    again = data.on_before_batch_transfer(batch[:2], 0)
    assert all(a is b for a, b in zip(again[:2], batch[:2]))  # pinned once: a pinned tensor is not copied again
    model.target_capacity = TargetCapacity()  # a compiled model's: its training batches' tail clusters padded
    padded = data.on_before_batch_transfer((x, y), 0)[2]
    assert padded.valid is not None and [padded.order.is_pinned(), padded.valid.is_pinned()] == [pinned_batch] * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_on_cuda_moves_every_batch_from_pinned_memory(monkeypatch, tmp_path):
    import numpy as np

    from parnas.training.data_module import SegmentData
    from parnas.training.latency import zipf_ids
    from parnas.training.trainer import build_trainer

    handed = []
    hook = SegmentData.on_before_batch_transfer

    def recorded(self, batch, index):
        batch = hook(self, batch, index)
        handed.append([t.is_pinned() for t in (batch[0], batch[1], batch[2].order)])
        return batch

    monkeypatch.setattr(SegmentData, "on_before_batch_transfer", recorded)
    cfg = load_config("tiny", ["train.accelerator=cuda", "train.max_steps=3", "train.eval_every=2",
                               "model.cutoffs=[100, 200]"])
    ids = zipf_ids(8 * 16 * 6, 500).numpy().astype(np.int64)
    task = LanguageModelTask(cfg.train)
    task.set_model(build_fixed_model(cfg.model, 500))
    trainer = build_trainer(cfg.train, tmp_path, enable_progress_bar=False)
    trainer.fit(task, datamodule=SegmentData({"train": ids, "valid": ids[:512], "test": ids[:512]}, 8, 8, 16))
    assert len(handed) >= 3 and all(all(pinned) for pinned in handed)  # training and validation batches
