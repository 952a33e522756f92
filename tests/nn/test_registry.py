"""The block-kind registry: register, look up, build; plugins through entry points (the reference's example,
written out and installed the way pip installs it); the round trip register -> search -> export ->
retrain; and one clear line for every mistake."""

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from parnas import architecture, kinds
from parnas.cli import main
from parnas.config import ModelConfig, load_config
from parnas.kinds import BlockKind, KindError

ROOT = Path(__file__).parents[2]
CFG = ModelConfig(n_blocks=2, d_model=16, n_heads=2, d_ff=32, mem_len=4, dropout=0.0, cutoffs=())


class Gelu(nn.Module):
    """A kind defined in a test module: the dense block with GELU."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model))
        self.norm = nn.LayerNorm(cfg.d_model)

    def forward(self, h, mem, pos):
        return self.norm(h + self.net(h))


@pytest.fixture
def gelu():
    kind = kinds.register(BlockKind("gelu_test", Gelu, uses_memory=False, letter="g"))
    yield kind
    kinds.unregister(kind.name)


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# --- the registry ---------------------------------------------------------------------------------

def test_builtins_are_registered_in_order_with_unique_letters():
    builtin = ("attention", "dense", "identity", "conv", "glu", "sqrelu", "compressive", "shared")
    assert kinds.names()[:len(builtin)] == builtin
    assert architecture.layout_string(builtin) == "ADICGSMU"
    assert len({kinds.get(k).letter for k in kinds.names()}) == len(kinds.names())


def test_printed_layouts_say_what_each_of_their_letters_means():
    assert architecture.legend("ACAAACGGGDDG") == "A attention, C conv, G glu, D dense"
    assert architecture.legend(["attention", "dense", "identity"]) == "A attention, D dense, I identity"
    assert architecture.legend("AZ") == "A attention, Z unknown kind"


def test_every_kind_is_built_from_the_config_alone_and_keeps_the_block_call():
    h, pos = torch.randn(2, 3, 16), torch.randn(7, 16)
    for name in kinds.names():
        block = kinds.make_block(name, CFG)
        assert block.kind == name and block.uses_memory == kinds.get(name).uses_memory
        assert block(h, torch.randn(2, 4, 16), pos).shape == h.shape


def test_a_registered_kind_is_a_candidate_a_layout_and_a_letter(gelu):
    cfg = load_config("tiny", ["search.candidates=[attention,gelu_test]",
                               "model.blocks=[gelu_test,attention,dense,identity]"])
    assert cfg.search.candidates == ("attention", "gelu_test")
    from parnas.nn.model import build_fixed_model

    model = build_fixed_model(cfg.model, 500)
    assert model.block_kinds[0] == "gelu_test" and isinstance(model.blocks[0], Gelu)
    assert architecture.layout_string(model.block_kinds) == "gADI"


def test_config_validation_imports_neither_torch_nor_plugins():
    code = ("import sys; from parnas.config import load_config; "
            "load_config('tiny', ['search.candidates=[attention,conv,glu,compressive,shared]']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_every_kind_has_a_flops_cost_and_a_measured_one(gelu):
    from parnas.strategies.costs import flops_costs

    names = kinds.names()
    flops = flops_costs(names, CFG, 8, 2)
    assert flops["identity"] == 0 and all(v > 0 for k, v in flops.items() if k != "identity")
    assert flops["sqrelu"] == flops["dense"] and flops["shared"] > flops["attention"]
    assert flops["compressive"] > flops["attention"]  # more keys: the compressed memory
    gelu_params = sum(p.numel() for p in kinds.make_block("gelu_test", CFG).parameters())
    assert flops["gelu_test"] == pytest.approx(2 * gelu_params / 1e6)  # no formula: 2 FLOPs per parameter
    from parnas.config import Config, DataConfig
    from parnas.training.latency import measure_table

    cfg = Config(model=replace(CFG, n_blocks=2, cutoffs=()), data=DataConfig(batch_size=2, seg_len=8))
    table = measure_table(cfg, 64, names, rounds=1, steps=1)  # whole models: a compressive block's memory fills
    assert set(table.kinds_ms) == set(names) and all(v >= 0 for m in table.kinds_ms.values() for v in m.values())


@pytest.mark.parametrize("make, needle", [
    (lambda: kinds.register(BlockKind("dense", Gelu, False, "x")), "'dense' is already registered (built in)"),
    (lambda: kinds.register(BlockKind("mine", Gelu, False, "A")), "letter 'A' is taken by 'attention'"),
    (lambda: BlockKind("mine", None, False, "x"), "factory must be a callable or a 'module:attribute' string"),
    (lambda: BlockKind("mine", "no_colon", False, "x"), "factory must be a callable"),
    (lambda: BlockKind("mine", Gelu, False, "xy"), "letter must be one ASCII letter or digit"),
    (lambda: BlockKind("my kind", Gelu, False, "x"), "must be a Python identifier"),
    (lambda: kinds.make_block("nope_kind", CFG), "unknown block kind 'nope_kind'; known kinds: attention, dense"),
])
def test_bad_registrations_and_lookups_say_what_is_wrong_in_one_line(make, needle):
    with pytest.raises(KindError) as info:
        make()
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_a_factory_that_cannot_be_imported_fails_when_built_with_one_line():
    kind = kinds.register(BlockKind("ghost", "no_such_package.blocks:Ghost", False, "q"))
    try:
        with pytest.raises(KindError, match=r"^block kind 'ghost': cannot load its factory "
                                            r"'no_such_package.blocks:Ghost' \(ModuleNotFoundError"):
            kinds.make_block("ghost", CFG)
    finally:
        kinds.unregister(kind.name)


def test_unknown_kinds_in_a_config_stop_the_command_with_one_line(capsys, tmp_path):
    code = main(["search", "--config", "tiny", "--set", "search.candidates=[attention,nope]",
                 "--set", f"search.out_dir={tmp_path}"])
    err = one_line(capsys)
    assert code == 2 and "search.candidates: unknown block kind 'nope'; known kinds: attention" in err
    assert "entry point in group 'parnas.blocks'" in err


def test_retrain_refuses_an_unknown_kind_in_an_architecture_json_with_one_line(capsys, tmp_path):
    record = architecture.make_record({"block_0": "attention", "block_1": "dense"}, CFG, 300)
    record["architecture"]["block_1"] = "mystery"
    path = tmp_path / "arch.json"
    path.write_text(json.dumps(record))
    code = main(["retrain", "--arch", str(path), "--config", "tiny", "--set", f"train.out_dir={tmp_path}/out"])
    err = one_line(capsys)
    assert code == 2 and "block_1: unknown block kind 'mystery'; known kinds: attention, dense" in err
    assert "parnas.blocks" in err and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_checkpoint_of_a_kind_this_version_lacks_is_one_line_for_every_command(capsys, tmp_path, wt2_slice):
    """A model trained with a plugin kind, read where the plugin is not installed (or by an older parnas)."""
    out = tmp_path / "run"
    sets = [f"data.path={wt2_slice}", "data.tokenizer=char", "model.blocks=[attention,gelu_test]", "model.n_blocks=2",
            "model.cutoffs=[]", "train.max_steps=2", "train.eval_every=2", f"train.out_dir={out}"]
    args = ["--config", "tiny", *[a for s in sets for a in ("--set", s)]]
    kinds.register(BlockKind("gelu_test", Gelu, uses_memory=False, letter="g"))
    try:
        assert main(["train", *args]) == 0
    finally:
        kinds.unregister("gelu_test")
    capsys.readouterr()
    last = out / "checkpoints" / "last.ckpt"
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    lacks = "trained with block kind(s) gelu_test, which this parnas lacks"
    for command, needle in ((["evaluate", last, "--out", tmp_path / "e.json"], lacks),
                            (["generate", last, "--tokens", "4"], lacks),
                            (["train", *args, "--resume"], "model.blocks: unknown block kind 'gelu_test'")):
        code = main([str(a) for a in command])
        err = one_line(capsys)
        assert code == 2 and needle in err and "parnas.blocks" in err, (command, err)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before and not (tmp_path / "e.json").exists()


# --- plugins: the reference's example (docs/reference.md), installed as pip would -------------------

def readme_example() -> dict[str, str]:
    """The files the reference's plugin example shows, by the path in its marker comment."""
    text = (ROOT / "docs" / "reference.md").read_text()
    blocks = re.findall(r"<!-- plugin-example: (\S+) -->\n```\w+\n(.*?)```", text, flags=re.S)
    assert [p for p, _ in blocks] == ["pyproject.toml", "parnas_shift/__init__.py"]
    return dict(blocks)


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """The example package on sys.path with the dist-info (metadata, entry points) pip writes for it."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    files = readme_example()
    project = tomllib.loads(files["pyproject.toml"])["project"]
    (tmp_path / "parnas_shift").mkdir()
    (tmp_path / "parnas_shift" / "__init__.py").write_text(files["parnas_shift/__init__.py"])
    info = tmp_path / f"parnas_shift-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    points = project["entry-points"]["parnas.blocks"]
    (info / "entry_points.txt").write_text("[parnas.blocks]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    kinds.unregister("shift")
    sys.modules.pop("parnas_shift", None)


@pytest.mark.slow
def test_a_plugin_kind_is_known_by_name_before_its_module_is_imported(installed_plugin):
    code = ("import sys; from parnas.config import load_config; from parnas import kinds; "
            "load_config('tiny', ['search.candidates=[attention,shift]']); "
            "print('parnas_shift' in sys.modules, 'torch' in sys.modules, 'shift' in kinds.names()); "
            "print(kinds.letter('shift'), 'parnas_shift' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": f"{installed_plugin}:{ROOT}", "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == ["False", "False", "True", "T", "True"]


@pytest.mark.slow
def test_round_trip_plugin_kind_searched_exported_and_retrained(installed_plugin, wt2_slice, tmp_path, capsys):
    """register (entry point) -> search tiny -> architecture.json -> retrain. The plugin kind is far cheaper
    than attention, and a compute penalty makes the search choose it."""
    data = ["--set", f"data.path={wt2_slice}", "--set", "data.vocab_size=300", "--set", "model.cutoffs=[100,200]",
            "--set", "model.n_blocks=2", "--set", "train.eval_every=1000", "--set", "data.eval_batch_size=32"]
    assert main(["search", "--config", "tiny", *data, "--set", "search.candidates=[attention,shift]",
                 "--set", "search.par-gumbel-darts.penalty_weight=5", "--set", "train.max_steps=20",
                 "--set", f"search.out_dir={tmp_path / 'search'}"]) == 0
    record = architecture.read(tmp_path / "search" / "architecture.json")
    assert set(record["probabilities"]["block_0"]) == {"attention", "shift"}
    assert "shift" in record["architecture"].values(), record["probabilities"]
    assert "T" in capsys.readouterr().out  # the layout string printed by `parnas search`
    assert main(["retrain", "--arch", str(tmp_path / "search" / "architecture.json"), "--config", "tiny", *data,
                 "--set", "train.max_steps=5", "--set", f"train.out_dir={tmp_path / 'retrain'}"]) == 0
    metrics = json.loads((tmp_path / "retrain" / "metrics.json").read_text())
    assert metrics["blocks"] == architecture.layout(record) and "T" in metrics["architecture"]
    assert metrics["val_ppl"] is not None
