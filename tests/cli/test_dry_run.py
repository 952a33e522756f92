"""``--dry-run``: parameters, training FLOPs per token and a memory estimate from the config alone, on the meta
device, nothing read or written; and the paper presets it checks."""

import pytest
import torch

from parnas import kinds
from parnas.arguments import presets
from parnas.cli import main
from parnas.config import load_config
from parnas.nn.model import build_fixed_model
from parnas.training.dry_run import block_train_flops, dry_run, head_train_flops, zipf_fractions

PAPER_PRESETS = ("wt103-base", "wt103-par", "enwik8-base", "text8-base")


def cli(capsys, monkeypatch, tmp_path, *args):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARNAS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PARNAS_DATA_DIR", str(tmp_path / "no-data"))
    code = main(list(args))
    out = capsys.readouterr()
    assert list(tmp_path.iterdir()) == [], "a dry run wrote something"
    return code, out.out, out.err


def test_wt103_base_has_dai_et_als_parameter_count_and_nothing_is_read_or_written(capsys, monkeypatch, tmp_path):
    code, out, err = cli(capsys, monkeypatch, tmp_path, "retrain", "--arch", "transformer-xl", "--config",
                         "wt103-base", "--dry-run")
    assert code == 0, err
    assert "parameters 151,107,538:" in out and "vocabulary 267,735" in out and "nothing read" in out


@pytest.mark.parametrize("command", [["train"], ["search"], ["retrain", "--arch", "transformer-xl"]])
@pytest.mark.parametrize("preset", PAPER_PRESETS)
def test_every_paper_preset_dry_runs_under_every_command(capsys, monkeypatch, tmp_path, preset, command):
    assert preset in presets()
    code, out, err = cli(capsys, monkeypatch, tmp_path, command[0], "--config", preset, *command[1:], "--dry-run")
    assert code == 0, err
    assert "parameters" in out and "training FLOPs per token" in out and "memory at least" in out


@pytest.mark.parametrize("settings, layout", [
    ([], None), (["model.adaptive_input=true", "model.tie_weights=true", "model.tie_projs=[false,true,true]",
                  "model.share_position_bias=true"], None),
    (["model.cutoffs=[]", "model.tie_weights=true"], ["attention", "glu", "identity", "conv"]),
    ([], ["attention", "shared", "shared", "identity"]),
])
def test_the_parameters_printed_are_those_of_the_model_built(settings, layout):
    cfg = load_config("tiny", [*settings, "data.vocab_size=1000"])
    layout = layout or list(cfg.model.layout)
    with torch.device("meta"):
        model = build_fixed_model(cfg.model, 1000, layout)
    built = sum(p.numel() for p in model.parameters())
    assert f"parameters {built:,}:" in dry_run(cfg, [[k] for k in layout], "train")


def test_a_supernets_parameters_are_every_candidates(monkeypatch):
    from parnas.search_spaces import PARTransformerXLSpace

    cfg = load_config("tiny", ["data.vocab_size=1000", "search.candidates=[attention, dense, glu, identity]"])
    with torch.device("meta"):
        space = PARTransformerXLSpace(cfg.model, 1000, cfg.search.candidates)
    built = sum(p.numel() for p in space.parameters())
    assert f"parameters {built:,}:" in dry_run(cfg, [list(cfg.search.candidates)] * cfg.model.n_blocks, "search")


@pytest.mark.parametrize("cutoffs", [[], [250, 2500]])
def test_training_flops_are_the_gpu_benchmarks_hand_count(benchmark_script, cutoffs):
    """torch's own count of each block on meta tensors, plus the head from its shapes, agrees with the formula
    benchmarks/gpu_shapes.py states in its docstring."""
    gpu_shapes = benchmark_script("gpu_shapes")
    cfg = load_config("wt2-seed", [f"model.cutoffs={cutoffs}"])
    kinds, vocab = list(cfg.model.layout), 12000
    ours = head_train_flops(cfg.model, vocab) + sum(block_train_flops(k, cfg) for k in kinds)
    fractions = zipf_fractions(vocab, cutoffs) if cutoffs else []
    theirs = gpu_shapes.train_flops_per_token(cfg.model, kinds, cfg.data.batch_size, cfg.data.seg_len, vocab,
                                              fractions)
    assert ours == pytest.approx(theirs, rel=1e-9)


def test_an_unknown_preset_lists_the_presets(capsys, monkeypatch, tmp_path):
    code, _, err = cli(capsys, monkeypatch, tmp_path, "train", "--config", "wt104-base", "--dry-run")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "wt103-base" in err and "enwik8-base" in err


@pytest.mark.parametrize("kind", kinds.names())
def test_every_registered_kind_dry_runs_as_a_fixed_model_and_as_a_candidate(capsys, monkeypatch, tmp_path, kind):
    """A block whose work depends on its values (ut halts when its positions do) is counted at its bound."""
    blocks = ",".join([kind] * load_config("tiny").model.n_blocks)
    candidates = ",".join(dict.fromkeys([kind, "identity", "dense"]))
    for args in (["train", "--set", f"model.blocks=[{blocks}]"],
                 ["search", "--set", f"search.candidates=[{candidates}]"]):
        code, out, err = cli(capsys, monkeypatch, tmp_path, *args, "--config", "tiny", "--set", "model.n_heads=4",
                             "--dry-run")  # 4 heads: a quarter of them is a whole head
        assert code == 0, err
        assert "training FLOPs per token" in out and "nothing read" in out, out
