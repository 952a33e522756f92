"""The memory estimate a run is checked against before anything is allocated."""

import pytest
import torch

from parnas.config import load_config
from parnas.errors import ConfigError
from parnas.nn.model import build_fixed_model
from parnas.search_spaces import PARTransformerXLSpace
from parnas.training import memory

VOCAB = 500


def params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("layout", [("attention", "dense", "identity", "conv"), ("shared", "dense", "shared", "glu")])
def test_parameters_are_counted_exactly_without_allocating_them(layout):
    cfg = load_config("tiny", ["model.n_blocks=4", "model.cutoffs=[100, 400]"])
    estimate = memory.estimate_memory(cfg, VOCAB, [[kind] for kind in layout])
    assert estimate.parameters == params(build_fixed_model(cfg.model, VOCAB, layout))


def test_reversible_pairs_are_estimated_as_the_model_they_build():
    # the estimate once built a one-block body with the pairing flag still set, refusing every reversible run
    cfg = load_config("tiny", ["model.reversible=true", "model.n_blocks=16"])
    estimate = memory.estimate_memory(cfg, VOCAB, [[kind] for kind in cfg.model.layout])
    assert estimate.parameters == params(build_fixed_model(cfg.model, VOCAB))


def test_a_supernet_counts_every_candidate():
    cfg = load_config("tiny")
    candidates = cfg.search.candidates
    estimate = memory.estimate_memory(cfg, VOCAB, [candidates] * cfg.model.n_blocks)
    assert estimate.parameters == params(PARTransformerXLSpace(cfg.model, VOCAB, candidates))


def test_weights_too_large_for_torch_to_describe_are_refused_without_a_traceback():
    cfg = load_config("tiny", ["model.d_model=100000000000"])
    estimate = memory.estimate_memory(cfg, VOCAB, [["attention"], ["dense"]])
    assert estimate.parameters == float("inf") and estimate.total == float("inf")
    with pytest.raises(ConfigError, match=r"more than 8 EiB .* model\.d_model=100000000000: make it smaller"):
        memory.check_memory(cfg, VOCAB, [["attention"], ["dense"]])


def test_the_refusal_names_what_grows_and_counts_every_process(monkeypatch):
    monkeypatch.setattr(memory, "machine_memory", lambda cfg: (2.0**30, "of RAM", cfg.train.devices))
    layout = [["attention"], ["dense"]] * 2
    cfg = load_config("tiny", ["data.batch_size=4096", "data.seg_len=256"])
    with pytest.raises(ConfigError, match=r"this machine has 1\.0 GiB of RAM; the (activations|attention scores) "
                                          r"grow with data\.batch_size=4096, data\.seg_len=256: make them smaller"):
        memory.check_memory(cfg, VOCAB, layout)
    half = memory.estimate_memory(load_config("tiny"), VOCAB, layout).total
    monkeypatch.setattr(memory, "machine_memory", lambda cfg: (1.5 * half, "of RAM", cfg.train.devices))
    memory.check_memory(load_config("tiny"), VOCAB, layout)  # fits one process
    two = load_config("tiny", ["train.devices=2", "train.accelerator=cpu"])
    with pytest.raises(ConfigError, match="in each of 2 processes"):  # two processes share the RAM
        memory.check_memory(two, VOCAB, layout)


def test_a_long_evaluation_memory_counts_where_validation_needs_more_than_training(monkeypatch):
    layout = [["attention"], ["dense"]] * 2
    train = memory.estimate_memory(load_config("tiny"), VOCAB, layout)
    long = load_config("tiny", ["model.eval_mem_len=2000000"])
    assert memory.estimate_memory(long, VOCAB, layout).total > 100 * train.total
    monkeypatch.setattr(memory, "machine_memory", lambda cfg: (2.0**30, "of RAM", cfg.train.devices))
    with pytest.raises(ConfigError, match=r"the evaluation memories grow with model\.eval_mem_len=2000000"):
        memory.check_memory(long, VOCAB, layout)
    dense = load_config("tiny", ["model.eval_mem_len=2000000", "model.blocks=[dense,dense]", "model.n_blocks=2"])
    memory.check_memory(dense, VOCAB, [["dense"], ["dense"]])  # blocks that keep no memory need none


def test_the_machine_memory_is_the_ram_on_a_cpu():
    total, what, processes = memory.machine_memory(load_config("tiny", ["train.accelerator=cpu"]))
    assert what == "of RAM" and processes == 1 and total > 2**28


def test_sizes_read_in_binary_units():
    assert [memory.size(n) for n in (512, 1536, 3 * 2**30, float("inf"))] == \
        ["512 B", "1.5 KiB", "3.0 GiB", "more than 8 EiB"]
