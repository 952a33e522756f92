"""A latency table timed on one machine (``parnas latency``) prices a search on another (search.latency_table)."""

import json
import os
from pathlib import Path

import pytest
import torch

from parnas.cli import main
from parnas.config import load_config
from parnas.training import latency, latency_table

OTHER = "NVIDIA Claimed GPU"  # a device this machine is not: the run must name it, not its own
H100 = Path(os.environ.get("PARNAS_DATA_DIR") or "/nonexistent").parent / "latency" / "h100-wt2-par-gpu.json"


def micro_sets(corpus, *extra):
    sets = [f"data.path={corpus}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "model.n_blocks=2",
            "train.max_steps=4", "train.eval_every=4", "search.log_every=2", *extra]
    return ["--config", "tiny", *[a for s in sets for a in ("--set", s)]]


def cli(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


@pytest.fixture(scope="module")
def timed(micro, tmp_path_factory):
    """A table `parnas latency` wrote for the micro search's shapes, then edited to claim another device's costs."""
    path = tmp_path_factory.mktemp("table") / "table.json"
    with pytest.MonkeyPatch.context() as mp:  # module scope: set the private cache ourselves
        mp.setenv("PARNAS_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "parnas-cache"))
        assert main(["latency", *micro_sets(micro), "--out", str(path)]) == 0
    table = json.loads(path.read_text())
    assert table["format"] == "parnas.latency" and table["version"] == 2
    assert table["key"]["kinds"] == ["attention", "dense", "identity"] and table["key"]["seg_len"] == 16
    table["key"].update(device=OTHER, device_type="cuda", torch="9.9", threads=16, precision="bf16-mixed")
    table["constant_ms"] = {"train": 5.0, "inference": 1.0, "generate": 0.5}
    table["kinds_ms"] = {"attention": {"train": 3.0, "inference": 1.5, "generate": 0.8},
                         "dense": {"train": 1.0, "inference": 0.5, "generate": 0.1},
                         "identity": {"train": 0.0, "inference": 0.0, "generate": 0.0}}
    path.write_text(json.dumps(table))
    return path


@pytest.mark.slow  # a search
def test_a_search_priced_by_another_devices_table_records_that_device(micro, timed, tmp_path, capsys):
    run = tmp_path / "run"
    code, out, err = cli(capsys, "search", *micro_sets(micro, f"search.latency_table={timed}",
                                                       f"search.out_dir={run}"))
    assert code == 0, err
    assert f"on {OTHER}" in out  # the printed prediction names the table's device
    assert f"latency table: given, {timed}; timed " in out and "spread" in out  # which table, how steady
    record = json.loads((run / "architecture.json").read_text())
    summary = record["search"]["latency"]
    assert summary["device"] == OTHER and summary["precision"] == "bf16-mixed"
    assert summary["table"] == str(timed) and summary["timed_here"] is False
    assert record["search"]["block_costs"] == {"attention": 3.0, "dense": 1.0, "identity": 0.0}  # the table's
    kinds = list(record["architecture"].values())
    assert summary["train_step_ms"] == pytest.approx(5.0 + sum({"attention": 3.0, "dense": 1.0}.get(k, 0.0)
                                                               for k in kinds))
    lines = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert lines and all(line["latency_device"] == OTHER for line in lines)
    assert json.loads((run / "latency_table.json").read_text())["key"]["device"] == OTHER  # what --resume reads
    from parnas.report.history import load_history
    from parnas.report.plots import architecture_figure

    fig = architecture_figure(load_history(run), record)
    assert any(f"Transformer-XL's on {OTHER}" in t.get_text() for t in fig.axes[0].texts)  # the figure says it


def test_a_resumed_search_reads_its_pinned_table_not_the_given_file(micro, timed, tmp_path):
    from parnas.strategies.pricing import cost_model

    cfg = load_config("tiny", micro_sets(micro, f"search.latency_table={timed}")[3::2])
    pinned = json.loads(timed.read_text())
    pinned["kinds_ms"]["attention"]["train"] = 7.0
    (tmp_path / "latency_table.json").write_text(json.dumps(pinned))
    key = json.loads(timed.read_text())["key"]
    costs, record = cost_model(cfg, key["vocab_size"], torch.device("cpu"), pinned=tmp_path / "latency_table.json")
    assert costs.per_kind["attention"] == 7.0 and costs.device == OTHER and record["timed_here"] is False


def test_the_pinned_table_carries_the_given_tables_device_and_costs(micro, timed):
    from parnas.strategies.nni_trial import nni_metric
    from parnas.strategies.pricing import cost_model

    cfg = load_config("tiny", micro_sets(micro, f"search.latency_table={timed}")[3::2])
    vocab = json.loads(timed.read_text())["key"]["vocab_size"]
    costs, record = cost_model(cfg, vocab, torch.device("cpu"))
    assert record["table"].key["device"] == OTHER and costs.device == OTHER
    assert costs.ratio(["dense", "dense"]) == pytest.approx((5 + 2) / (5 + 3 + 1))
    assert costs.per_kind == {"attention": 3.0, "dense": 1.0, "identity": 0.0}
    from parnas.strategies.pricing import latency_summary
    from parnas.strategies.supernet_export import Evaluated

    result = Evaluated(4, 0.5, {}, ["dense", "dense"], 30.0, 29.0, costs.ratio(["dense", "dense"]))
    assert nni_metric(result, latency_summary(costs, record, result.kinds, None))["latency_device"] == OTHER


@pytest.mark.slow
def test_a_search_for_the_generation_latency_is_priced_by_the_tables_generation_costs(micro, timed, tmp_path, capsys):
    """search.latency_target=generate: the costs, the budget's ratio, the record, the history and the printed line
    are the generated token's, not the train step's."""
    run = tmp_path / "run"
    code, out, err = cli(capsys, "search", *micro_sets(micro, f"search.latency_table={timed}", f"search.out_dir={run}",
                                                       "search.latency_target=generate",
                                                       "search.par-gumbel-darts.latency_budget=0.9"))
    assert code == 0, err
    assert "predicted generated token" in out and f"on {OTHER}" in out
    record = json.loads((run / "architecture.json").read_text())
    summary, kinds = record["search"]["latency"], list(record["architecture"].values())
    assert record["search"]["block_costs"] == {"attention": 0.8, "dense": 0.1, "identity": 0.0}
    assert record["search"]["cost_unit"] == "ms/token" and summary["target"] == "generate"
    generate = 0.5 + sum({"attention": 0.8, "dense": 0.1}.get(k, 0.0) for k in kinds)
    assert summary["target_ms"] == pytest.approx(generate) == summary["generate_token_ms"]
    assert summary["ratio"] == pytest.approx(generate / (0.5 + 0.8 + 0.1), abs=1e-4) and summary["within_budget"]
    assert summary["train_step_ms"] == pytest.approx(5.0 + sum({"attention": 3.0, "dense": 1.0}.get(k, 0.0)
                                                               for k in kinds))
    lines = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert any("exported_cost_ratio" in line for line in lines)
    assert all(line["latency_target"] == "generate" for line in lines if "exported_cost_ratio" in line)


@pytest.mark.slow
def test_a_version_1_table_prices_train_and_inference_and_refuses_generate(micro, timed, tmp_path, capsys):
    def version_1(table):
        table["version"] = 1
        del table["constant_ms"]["generate"]
        for costs in table["kinds_ms"].values():
            del costs["generate"]

    old = rewrite(timed, tmp_path, version_1)
    for target in ("train", "inference"):
        code, _, err = cli(capsys, "search", *micro_sets(micro, f"search.latency_table={old}",
                                                         f"search.latency_target={target}",
                                                         f"search.out_dir={tmp_path / target}"))
        assert code == 0, err
    code, _, err = cli(capsys, "search", *micro_sets(micro, f"search.latency_table={old}",
                                                     "search.latency_target=generate",
                                                     f"search.out_dir={tmp_path / 'generate'}"))
    assert code == 2 and len(err.splitlines()) == 1 and "has no generate costs" in err, err
    assert not (tmp_path / "generate").exists()


def rewrite(timed, tmp_path, edit):
    table = json.loads(timed.read_text())
    edit(table)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(table))
    return path


def other_shapes(table):
    table["key"]["seg_len"] = 128
    table["key"]["model"]["mem_len"] = 64


def without_dense(table):
    del table["kinds_ms"]["dense"]
    table["key"]["kinds"] = ["attention", "identity"]


@pytest.mark.parametrize("make, needles", [
    (lambda timed, tmp: tmp / "missing.json", ["cannot read"]),
    (lambda timed, tmp: (tmp / "any.json").write_text('{"format": "parnas.latency"}') and tmp / "any.json",
     ["is not a parnas latency table"]),
    (lambda timed, tmp: (tmp / "list.json").write_text("[1, 2]") and tmp / "list.json",
     ["is not a parnas latency table"]),
    (lambda timed, tmp: (tmp / "search.log").write_text("step 1/60, train loss 8.6\n") and tmp / "search.log",
     ["is not a parnas latency table (not JSON)"]),
    (lambda timed, tmp: (tmp / "model.bin").write_bytes(bytes(range(256))) and tmp / "model.bin",
     ["is not a parnas latency table (not JSON)"]),
    (lambda timed, tmp: rewrite(timed, tmp, lambda t: t["kinds_ms"]["dense"].update(train="fast")),
     ["is not a parnas latency table"]),
    (lambda timed, tmp: rewrite(timed, tmp, other_shapes),
     ["other shapes", "seg_len 128 (table) vs 16 (run)", "model.mem_len 64 (table) vs 16 (run)"]),
    (lambda timed, tmp: rewrite(timed, tmp, without_dense), ["no cost for block kind(s) dense"]),
])
def test_a_bad_latency_table_is_refused_in_one_line_and_nothing_is_written(micro, timed, tmp_path, capsys,
                                                                           make, needles):
    table = make(timed, tmp_path)
    run = tmp_path / "run"
    code, out, err = cli(capsys, "search", *micro_sets(micro, f"search.latency_table={table}",
                                                       f"search.out_dir={run}"))
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("parnas search: error: search.latency_table: ")
    for needle in needles:
        assert needle in err, err
    assert not run.exists()


def test_latency_refuses_a_folder_as_its_output_and_a_table_with_flops(micro, tmp_path, capsys):
    code, _, err = cli(capsys, "latency", *micro_sets(micro), "--out", tmp_path)
    assert code == 2 and len(err.splitlines()) == 1 and "is a folder" in err, err
    code, _, err = cli(capsys, "search", *micro_sets(micro, "search.latency_table=t.json", "search.penalty_cost=flops",
                                                     f"search.out_dir={tmp_path}/run"))
    assert code == 2 and "set search.penalty_cost=latency" in err and not (tmp_path / "run").exists(), err
    code, _, err = cli(capsys, "search", *micro_sets(micro, "search.latency_target=decode",
                                                     f"search.out_dir={tmp_path}/run"))
    assert code == 2 and "search.latency_target must be one of train, inference, generate" in err, err


@pytest.mark.skipif(not H100.is_file(), reason=f"{H100} not found (the shared tables beside PARNAS_DATA_DIR)")
def test_the_h100_table_prices_a_wt2_par_run_at_its_shapes_and_names_the_others():
    par = ["data.batch_size=32", "data.seg_len=128", "model.mem_len=128"]
    cfg = load_config("wt2-par", par)
    key = latency_table.table_key(cfg, 12000, ["attention", "dense", "identity"], torch.device("cpu"))
    table = latency_table.load_table_for(H100, key)
    assert table.key["device"] == "NVIDIA H100 80GB HBM3" and table.key["precision"] == "bf16-mixed"
    assert table.block_ms("attention") > table.block_ms("dense") > 0  # PAR's premise, on that GPU
    assert table.key["seg_len"] == 128 and table.n_reference == 12
    from parnas.errors import ConfigError

    with pytest.raises(ConfigError, match="batch_size 32 .table. vs 16 .run.") as e:
        default = latency_table.table_key(load_config("wt2-par"), 12000, key["kinds"], torch.device("cpu"))
        latency_table.load_table_for(H100, default)
    assert "seg_len 128 (table) vs 64 (run)" in str(e.value) and "model.mem_len" in str(e.value)


@pytest.mark.parametrize("where, cost, needle", [
    (("kinds_ms", "dense", "train"), -1.0, "block kind 'dense' a train cost of -1.0 ms"),
    (("kinds_ms", "attention", "generate"), 0.0, "block kind 'attention' a generate cost of 0.0 ms"),
    (("kinds_ms", "dense", "inference"), float("nan"), "block kind 'dense' an inference cost of nan ms"),
    (("constant_ms", "inference"), -3.0, "an inference constant of -3.0 ms"),
    (("kinds_ms", "identity", "train"), float("inf"), "block kind 'identity' a train cost of inf ms"),
    (("constant_ms", "train"), 0.0, "a train constant of 0.0 ms"),
])
def test_a_table_whose_costs_are_not_finite_and_positive_is_refused(micro, timed, tmp_path, capsys, where, cost,
                                                                     needle):
    table = json.loads(timed.read_text())
    node = table
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = cost
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(table))  # NaN and Infinity, as Python's json writes them
    run = tmp_path / "run"
    code, out, err = cli(capsys, "search", *micro_sets(micro, f"search.latency_table={edited}",
                                                       f"search.out_dir={run}"))
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err and "search.latency_table" in err and "parnas latency" in err, err
    assert not run.exists()


def test_a_kind_timed_no_slower_than_identity_is_not_free(monkeypatch):
    """Noise can time a cheap kind at or below identity: the table then prices it at its resolution, never 0, so
    the tables `parnas latency` writes pass the check above."""
    def round_times(layouts, *args, **kwargs):
        return [[10.0, 10.2, 9.9]] + [[9.8, 10.0, 9.9] for _ in layouts[1:]]  # each kind no slower than identity

    monkeypatch.setattr(latency, "_round_times", round_times)
    table = latency.measure_table(load_config("tiny"), 100, ["attention", "dense", "identity"])
    assert table.costs("train") == {"attention": latency.MIN_BLOCK_MS, "dense": latency.MIN_BLOCK_MS, "identity": 0.0}
    assert latency.MIN_BLOCK_MS > 0 and latency_table.cost_problem(table) is None
