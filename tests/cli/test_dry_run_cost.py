"""``--dry-run`` says what a run costs before it reads anything: its steps and tokens, and its expected time where a
latency table prices its shapes (one cached for this device, or a search's ``search.latency_table`` timed on
another). No corpus is read: the data folder it is given does not exist."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parnas.cli import main
from parnas.config import load_config
from parnas.training.latency_table import LatencyTable, table_key

TABLES = Path(__file__).parents[2] / "benchmarks" / "tables"
GPU_SHAPE = ["data.batch_size=32", "data.seg_len=128", "model.mem_len=128", "train.precision=bf16-mixed"]


def dry_run(capsys, monkeypatch, tmp_path, *args: str) -> str:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARNAS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PARNAS_DATA_DIR", str(tmp_path / "no-data"))  # a corpus read would fail here
    code = main([*args, "--dry-run"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert not (tmp_path / "no-data").exists() and not (tmp_path / "runs").exists()
    return out.out


@pytest.mark.parametrize("sets, steps, tokens", [
    ([], "steps 56,500,", "tokens 57,856,000 (32 x 32 a step)"),  # the seed's 20 epochs
    (["train.stop_at=2825"], "steps 2,825 (train.stop_at),", "tokens 2,892,800 "),  # the schedule still 56.5k
])
def test_a_dry_run_says_its_steps_and_tokens(capsys, monkeypatch, tmp_path, sets, steps, tokens):
    out = dry_run(capsys, monkeypatch, tmp_path, "train", "--config", "wt2-seed", *(a for s in sets for a in
                                                                                     ("--set", s)))
    line = next(line for line in out.splitlines() if line.strip().startswith("steps "))
    assert steps in line and tokens in line, line
    assert "expected time: no latency table for this device" in out  # an empty cache: no figure made up


def cache_table(tmp_path: Path, cfg, constant: float, costs: dict[str, float]) -> None:
    """A table in the latency cache for this machine's device at ``cfg``'s shapes, as ``parnas latency`` writes."""
    kinds = sorted(costs)
    key = table_key(cfg, cfg.data.vocab_size, kinds, torch.device("cpu"))
    table = LatencyTable(key, {"train": constant, "inference": 1.0, "generate": 1.0},
                         {k: {"train": v, "inference": v, "generate": v} for k, v in costs.items()}, 4)
    folder = tmp_path / "cache" / "latency"
    folder.mkdir(parents=True)
    (folder / "table.json").write_text(json.dumps(table.to_dict()))


def test_a_table_cached_for_this_device_gives_the_expected_time(capsys, monkeypatch, tmp_path):
    """tiny's four blocks ADAD at 2 + 3 + 1 + 3 + 1 = 10 ms a step: 1,000 steps take 10 s."""
    cache_table(tmp_path, load_config("tiny", ["train.accelerator=cpu"]), 2.0,
                {"attention": 3.0, "dense": 1.0, "identity": 0.0})
    out = dry_run(capsys, monkeypatch, tmp_path, "train", "--config", "tiny", "--set", "train.accelerator=cpu",
                  "--set", "train.max_steps=1000")
    assert "expected time 0:10: 1,000 steps x 10.00 ms on cpu" in out and "(the latency cache;" in out, out
    # another shape (a longer segment) is not priced by it
    out = dry_run(capsys, monkeypatch, tmp_path, "train", "--config", "tiny", "--set", "train.accelerator=cpu",
                  "--set", "data.seg_len=32")
    assert "expected time: no latency table" in out


@pytest.mark.parametrize("device, file", [("NVIDIA H100 80GB HBM3", "h100-wt2-par-v2.json"),
                                          ("NVIDIA H200", "h200-wt2-par-v2.json")])
def test_a_search_planned_for_a_gpu_is_priced_by_its_table_on_the_cpu(capsys, monkeypatch, tmp_path, device, file):
    """The wt2-par GPU tables in benchmarks/tables/ price a search at their shapes on any machine: a supernet step
    as every candidate of every block (the table's constant, plus 12 x attention + dense)."""
    table = json.loads((TABLES / file).read_text())
    ms = table["constant_ms"]["train"] + 12 * sum(table["kinds_ms"][k]["train"] for k in ("attention", "dense"))
    out = dry_run(capsys, monkeypatch, tmp_path, "search", "--config", "wt2-par",
                  *(a for s in [*GPU_SHAPE, "train.max_steps=400", f"search.latency_table={TABLES / file}"]
                    for a in ("--set", s)))
    assert f"400 steps x {ms:.2f} ms on {device} (search.latency_table" in out, out
    assert "steps 400, tokens 1,638,400 (32 x 128 a step)" in out



@pytest.mark.slow  # a fresh Python process that loads torch
def test_a_search_dry_run_priced_by_a_latency_table_loads_neither_lightning_nor_nni(tmp_path):
    """A dry run is a quick look before a run: pricing a search by its latency table and checking its budget reads
    the table, and never loads the training stack (Lightning and NNI take most of a dry run's time to import)."""
    file = TABLES / "h100-wt2-par-v2.json"
    sets = [*GPU_SHAPE, "train.max_steps=400", f"search.latency_table={file}",
            "search.par-gumbel-darts.latency_budget=0.65"]
    code = ("import sys; from parnas.cli import main; "
            f"code = main(['search', '--config', 'wt2-par', '--dry-run', *{[a for s in sets for a in ('--set', s)]}]); "
            "print(code, sorted(m for m in ('nni', 'pytorch_lightning', 'lightning_fabric') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PARNAS_DATA_DIR": str(tmp_path / "no-data"),
                              "PARNAS_CACHE_DIR": str(tmp_path / "cache")})
    assert "400 steps x" in out.stdout and "latency budget 0.65: within reach" in out.stdout, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 []", out.stdout
