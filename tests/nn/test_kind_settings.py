"""Each kind owns its settings: ``model.<kind>.<setting>`` reaches the kind's block, unknown settings are errors,
the core model config holds none of them, and configs and checkpoints written with the earlier flat keys still
load, with a one-line note."""

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from parnas import architecture, kinds
from parnas.config import Config, ModelConfig, load_config
from parnas.errors import ConfigError
from parnas.nn.model import build_fixed_model
from parnas.old_keys import RENAMED
from parnas.overrides import from_dict

VOCAB = 500


def test_a_kinds_settings_reach_its_blocks():
    cfg = load_config("tiny", ["model.blocks=[lsh, moe, dense_double, attention_quarter]", "model.n_blocks=4",
                               "model.lsh.chunk_len=8", "model.moe.n_experts=3", "model.n_heads=4"])
    lsh, moe, wide, few = build_fixed_model(cfg.model, VOCAB).blocks
    assert lsh.attention.chunk_len == 8 if hasattr(lsh, "attention") else lsh.chunk_len == 8
    assert moe.w_in.shape[0] == 3
    assert wide.net[0].out_features == 2 * cfg.model.d_ff
    assert few.n_heads == 1 and few.d_head == cfg.model.d_model // 4


def test_the_core_model_config_holds_no_kinds_settings():
    core = {f.name for f in dataclasses.fields(ModelConfig)}
    for name in (n for n in kinds.names() if kinds.get(n).settings is not None):
        own = {f.name for f in dataclasses.fields(kinds.get(name).settings)}
        assert not core & (own | {f"{name}_{field}" for field in own}), name
    assert not core & {key.split('.')[1] for key in RENAMED if key.startswith('model.')}  # the old flat keys


@pytest.mark.parametrize("setting, needle", [
    ("model.lsh.bogus=1", "unknown config key model.lsh.bogus; known keys: chunk_len, n_buckets, n_hashes"),
    ("model.dense.ratio=2", "model.dense: the dense kind has no settings"),
    ("model.moe=3", "model.moe must be a mapping of the moe kind's settings"),
    ("model.moe.top_k=5", "model.moe.top_k must be in [1, n_experts=4], got 5"),
    ("model.moe.n_experts=0", "model.moe.n_experts must be >= 1"),
    ("model.attention_half.fraction=0.3", "model.attention_half.fraction was removed"),
    ("model.kind_settings={}", "unknown config key model.kind_settings"),
])
def test_bad_settings_are_refused_naming_the_key(setting, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_config("tiny", ["model.n_heads=4", "model.d_ff=128", setting])


def test_a_config_round_trips_through_its_dict_and_defaults_are_not_stored():
    cfg = load_config("tiny", ["model.moe.top_k=2", "model.conv.kernel=7"])  # 7: conv's default
    assert set(cfg.model.kind_settings) == {"moe"}
    again = from_dict(Config, cfg.to_dict())
    assert again == cfg and again.model.settings_of("moe").top_k == 2
    record = architecture.make_record({"block_0": "moe"}, dataclasses.replace(cfg.model, n_blocks=1), VOCAB)
    assert architecture.model_config(record).settings_of("moe").top_k == 2


@dataclass(frozen=True)
class ScaleSettings:
    gain: float = 1.0

    def __post_init__(self) -> None:
        if self.gain <= 0:
            raise ConfigError(f"gain must be > 0, got {self.gain}")


class Scale(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gain = cfg.settings_of("scale").gain

    def forward(self, h, mem, pos):
        return h * self.gain


@pytest.fixture
def scale():
    kinds.register(kinds.BlockKind("scale", Scale, False, "X", settings=ScaleSettings))
    yield
    kinds.unregister("scale")


def test_a_registered_kind_declares_its_own_settings(scale):
    cfg = load_config("tiny", ["model.blocks=[scale, dense]", "model.n_blocks=2", "model.scale.gain=2"])
    block = build_fixed_model(cfg.model, VOCAB).blocks[0]
    assert block.gain == 2.0 and cfg.to_dict()["model"]["scale"] == {"gain": 2.0}
    with pytest.raises(ConfigError, match=r"model.scale.gain must be > 0, got -1"):
        load_config("tiny", ["model.scale.gain=-1"])
    with pytest.raises(Exception, match="settings must be a frozen dataclass"):
        kinds.BlockKind("bad", Scale, False, "Y", settings=dict)
    h = torch.ones(1, 2, cfg.model.d_model)
    assert torch.equal(block(h, h[:, :0], None), 2 * h)
