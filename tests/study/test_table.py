"""Ranking tables: a study converts to one, the loader refuses a damaged one in one line, and the noise ceiling is
the Kendall tau between halves of the seeds."""

import json
from pathlib import Path

import pytest
import torch

from parnas import architecture
from parnas.cli import main
from parnas.config import load_config
from parnas.study.table import config_section, load_table, noise_ceiling, rebuild_command, table_record
from parnas.training.latency_table import table_key


def refusal(err: str) -> str:
    """The one line a refused command prints (a deprecated setting's note aside); fails on more."""
    lines = [line for line in err.strip().splitlines() if "deprecated" not in line]
    assert len(lines) == 1, err
    return lines[0]

CANDIDATES = ("attention", "dense", "identity")
SEEDS = {"ADIIII": [30.0, 31.0], "AIIIII": [40.0, 41.0], "DIIIII": [50.0, 52.0], "ADADAD": [20.0, 20.5],
         "DDDDDD": [45.0, None]}


def config():
    return load_config("wt2-cpu")


def latency_table(cfg, vocab_size=1000, **changes):
    """A latency table for ``cfg``'s shapes: attention costs 3 ms a block, dense 1, the rest 2."""
    key = table_key(cfg, vocab_size, sorted({*CANDIDATES}), torch.device("cpu"))
    modes = ("train", "inference", "generate")
    costs = {"attention": 3.0, "dense": 1.0, "identity": 0.0}
    return {"format": "parnas.latency", "version": 2, "key": key, "constant_ms": dict.fromkeys(modes, 2.0),
            "kinds_ms": {k: dict.fromkeys(modes, c) for k, c in costs.items()}, "n_reference": 6, "timing": None,
            **changes}


VOCAB = {"kind": "sentencepiece", "vocab_size": 1000, "sha256": "ab" * 32}


def record(seeds=SEEDS, **changes):
    cfg = config()
    out = table_record("t", CANDIDATES, cfg, config_section(cfg, "wt2-cpu", [], VOCAB), latency_table(cfg), seeds,
                       commit="abc")
    return {**out, **changes}


def write(tmp_path, data, name="table.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_a_table_loads_with_its_means_spreads_and_costs_relative_to_transformer_xl(tmp_path):
    table = load_table(write(tmp_path, record()))
    assert table.n_blocks == 6 and table.candidates == CANDIDATES and table.commit == "abc"
    assert table.val_ppl("DDDDDD") == 45.0 and table.spread("DDDDDD") is None  # a seed without a perplexity
    assert table.val_ppl("ADIIII") == 30.5 and table.spread("ADIIII") == pytest.approx(0.7071, abs=1e-4)
    assert table.cost_ratio("ADADAD", "train") == 1.0
    assert table.cost_ratio("ADIIII", "generate") == pytest.approx((2 + 3 + 1) / (2 + 3 * 4))
    assert table.kinds("ADIIII") == ("attention", "dense", *["identity"] * 4)
    assert table.memory["evaluation_memory"] == config().model.evaluation_memory


def test_the_noise_ceiling_ranks_the_layouts_by_the_even_seeds_against_the_odd_ones():
    agree = {"a": [1.0, 1.1, 1.0], "b": [2.0, 2.1, 2.0], "c": [3.0, 3.1, 3.0]}
    assert noise_ceiling(agree) == pytest.approx(1.0)
    crossed = {"a": [1.0, 3.0], "b": [2.0, 2.0], "c": [3.0, 1.0]}
    assert noise_ceiling(crossed) == pytest.approx(-1.0)
    assert noise_ceiling({"a": [1.0, 2.0], "b": [2.0, 1.0], "c": [3.0]}) is None  # c has one seed: 2 layouts left
    # the means of the halves (seeds 0, 2 against 1, 3), not single seeds
    assert noise_ceiling({"a": [1.0, 2.0, 1.0, 2.0], "b": [2.0, 1.5, 2.0, 1.5], "c": [3.0, 3.0, 3.0, 3.0]}) == \
        pytest.approx(1 / 3)


@pytest.mark.parametrize("change, message", [
    ({"format": "parnas.study"}, "not a parnas ranking table"),
    ({"version": 9}, "version 9 is not supported"),
    ({"space": {"candidates": ["attention", "nope"], "n_blocks": 6}}, "nope"),
    ({"layouts": {"ADIIII": {"val_ppl_seeds": [1.0], "val_ppl_std": None}}}, "at least 3 layouts"),
    ({"noise_ceiling": 0.99}, "noise ceiling 0.99 is not its seeds'"),
    ({"latency_table": {"format": "parnas.latency"}}, "not a parnas latency table"),
])
def test_a_damaged_table_is_refused_in_one_line(tmp_path, capsys, change, message):
    path = write(tmp_path, record(**change))
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert main(["table", "score", str(run), "--table", str(path)]) == 2
    assert message in refusal(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "table.json"]


def test_edited_seeds_are_refused_by_their_recorded_spread(tmp_path):
    data = record()
    data["layouts"]["ADIIII"]["val_ppl_seeds"] = [30.0, 39.0]
    with pytest.raises(Exception, match="ADIIII: val_ppl_std 0.707"):
        load_table(write(tmp_path, data))
    data["layouts"]["ADIIII"] = {"val_ppl_seeds": [30.0, -1.0], "val_ppl_std": None}
    with pytest.raises(Exception, match="positive perplexities"):
        load_table(write(tmp_path, data))
    data["layouts"]["ADX"] = data["layouts"].pop("ADIIII")
    with pytest.raises(Exception, match="'ADX' is not 6 letters of the candidates"):
        load_table(write(tmp_path, data))


def study_folder(tmp_path, priced=True):
    """A finished study's files as `parnas study` leaves them (rows with each retrain seed's val ppl, a search's
    architecture.json), without running it."""
    cfg, out = config(), tmp_path / "adi6"
    lat = write(tmp_path, latency_table(cfg), "latency.json")
    kinds = {"A": "attention", "D": "dense", "I": "identity"}
    search = out / "search" / "bnone-s0"
    search.mkdir(parents=True)
    architecture.write(search / "architecture.json", architecture.make_record(
        {architecture.label(i): kinds[c] for i, c in enumerate("ADADAD")}, cfg.model, 1000, tokenizer=VOCAB))
    rows = [{"role": "transformer-xl", "layout": "ADADAD", "val_ppl": 20.25, "val_ppl_seeds": [20.0, 20.5]},
            {"role": "front", "layout": "AD", "val_ppl": 30.5, "val_ppl_seeds": [30.0, 31.0]},
            {"role": "front", "layout": "ADADAD-d32", "val_ppl": 25.0, "val_ppl_seeds": [25.0, 25.0]},
            {"role": "space", "layout": "A", "val_ppl": 40.5, "val_ppl_seeds": [40.0, 41.0]},
            {"role": "space", "layout": "D", "val_ppl": 51.0, "val_ppl_seeds": [50.0, 52.0]},
            {"role": "found", "layout": "ADIIII", "val_ppl": 30.4, "val_ppl_seeds": [30.2, 30.6]}]
    timing = {"priced_by": {"table": str(lat), "device": "cpu", "targets": ["train"]}} if priced else {}
    (out / "study.json").write_text(json.dumps({
        "format": "parnas.study", "version": 1, "config": "wt2-cpu", "overrides": [], "retrain_steps": 600,
        "retrain_seeds": 2, "candidate_sets": [], "rows": rows, "timing": timing, "seeds": 3, "budgets": ["0.6"],
        "random_orderings": 0}))
    return out, lat


def test_a_study_converts_to_a_table_of_its_layouts_at_the_searches_depth(tmp_path, capsys):
    out, _ = study_folder(tmp_path)
    target = tmp_path / "adi6.json"
    assert main(["table", "build", str(out / "study.json"), "--table", str(target)]) == 0
    assert "written" in capsys.readouterr().out
    table = load_table(target)
    # the shallower layouts padded with identity blocks; the narrower front point left out; a layout retrained
    # twice (AD as the front, ADIIII as found) is the first one's seeds, with both roles
    assert table.layouts == ["ADADAD", "ADIIII", "AIIIII", "DIIIII"]
    assert table.seeds["ADIIII"] == (30.0, 31.0) and table.roles["ADIIII"] == ("found", "front")
    assert table.noise_ceiling == pytest.approx(1.0)
    assert table.config["vocab"] == VOCAB and table.config["retrain_steps"] == 600
    # the study's own searches chose its found layouts: the rebuild repeats them, not one unbudgeted search
    assert table.rebuild.startswith("parnas study --config wt2-cpu --seeds 3,2 --budgets 0.6 --steps ,600 "
                                    "--random-orderings 0 --space all")
    assert len(table.commit) == 40 or table.commit == "unknown"


def test_a_conversion_without_costs_or_onto_an_existing_file_is_refused_and_writes_nothing(tmp_path, capsys):
    out, lat = study_folder(tmp_path, priced=False)
    target = tmp_path / "t.json"
    assert main(["table", "build", str(out / "study.json"), "--table", str(target)]) == 2
    assert "--latency-table" in refusal(capsys.readouterr().err) and not target.exists()
    assert main(["table", "build", str(out / "study.json"), "--table", str(lat)]) == 2
    assert "exists" in refusal(capsys.readouterr().err)
    other = write(tmp_path, latency_table(load_config("tiny")), "tiny-latency.json")
    assert main(["table", "build", str(out / "study.json"), "--table", str(target),
                 "--latency-table", str(other)]) == 2
    assert "timed at other shapes" in refusal(capsys.readouterr().err) and not target.exists()


def test_the_shipped_tables_load_and_rank_themselves_as_recorded():
    """Every table in benchmarks/spaces/ passes the loader's checks (its spreads and noise ceiling are its seeds'
    own) and covers its space: every network of PAR's three kinds; of a larger space (PLANER's, 137,257
    networks) a census of at least 60, each retrained on at least 3 seeds (its layouts' seed spread reaches 3%),
    beside Transformer-XL and its depth-scaled front."""
    from pathlib import Path

    from parnas.study.table import load_table

    tables = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "spaces").glob("*.json"))
    assert tables
    for path in tables:
        table = load_table(path)
        networks = {k.replace("I", "") for k in table.layouts} - {""}
        if set(table.candidates) == {"attention", "dense", "identity"}:
            assert len(networks) == 2 ** (table.n_blocks + 1) - 2, path.name  # every network of 1..n blocks
        else:
            assert len(networks) >= 60 and min(map(len, table.seeds.values())) >= 3, path.name
            roles = {role for rs in table.roles.values() for role in rs}
            assert {"transformer-xl", "front"} <= roles, (path.name, roles)


def test_the_rebuild_commands_time_the_latency_table_the_study_was_priced_by_first():
    study = {"config": "wt2-cpu", "overrides": ["model.n_heads=4", "search.candidates=planer",
                                                 "search.latency_table=runs/p.json", "train.threads=1"],
             "seeds": 3, "budgets": ["0.6"], "retrain_steps": 600, "retrain_seeds": 3, "random_orderings": 0,
             "census": {"networks": 60}}
    latency, study_command, convert = rebuild_command(study, Path("runs/planer/study.json")).split(" && ")
    # the latency table gets the settings that change what it prices (threads too), not the search's own
    assert latency == ("parnas latency --config wt2-cpu --set model.n_heads=4 --set search.candidates=planer "
                       "--set train.threads=1 --out runs/p.json --refresh")
    assert study_command.endswith("--seeds 3,3 --budgets 0.6 --steps ,600 "
                                  "--random-orderings 0 --space 60 --out runs/planer")
    assert convert == "parnas table build runs/planer/study.json --table TABLE.json"


def train_run(tmp_path, layout, seed, val_ppl=32.0, steps=600, vocab=VOCAB, sets=()):
    """A finished `parnas train` run's files (metrics.json, architecture.json), as the table's layouts retrain."""
    names = {"A": "attention", "D": "dense", "I": "identity"}
    blocks = [names[c] for c in layout]
    cfg = load_config("wt2-cpu", [f"model.blocks=[{', '.join(blocks)}]", f"train.seed={seed}",
                                  f"train.max_steps={steps}", *sets])
    run = tmp_path / f"{layout}-s{seed}-{len(list(tmp_path.iterdir()))}"
    run.mkdir()
    architecture.write(run / "architecture.json", architecture.make_record(
        {architecture.label(i): k for i, k in enumerate(blocks)}, cfg.model, 1000, tokenizer=vocab))
    (run / "metrics.json").write_text(json.dumps({"val_ppl": val_ppl, "steps": steps, "config": cfg.to_dict(),
                                                  "diverged": False}))
    return run


def six_hundred_step_table(tmp_path):
    cfg = config()
    return write(tmp_path, table_record("t", CANDIDATES, cfg, config_section(cfg, "wt2-cpu", [], VOCAB,
                                                                              retrain_steps=600),
                                        latency_table(cfg), SEEDS, commit="abc", rebuild="parnas study ..."))


def test_further_seeds_join_their_layouts_and_the_spreads_and_ceiling_follow(tmp_path, capsys):
    """`parnas table add-seeds RUN ... --table FILE`: each finished `parnas train` run of a table layout (a
    shallower network at the table's padded key) adds its validation perplexity at its seed's index; the table
    still loads, its spreads and noise ceiling are the new seeds', and its rebuild commands retrain them."""
    path = six_hundred_step_table(tmp_path)
    runs = [train_run(tmp_path, "ADIIII", 2, 32.0, sets=("train.threads=1",)),  # threads: the sums' order
            train_run(tmp_path, "IIADII", 3, 29.0),  # the same network
            train_run(tmp_path, "DDDDDD", 1, 47.0)]  # fills the seed that gave no perplexity
    assert main(["table", "add-seeds", *map(str, runs), "--table", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ADIIII: seed 2, val ppl 32.00" in out and "3 seeds added" in out
    table = load_table(path)
    assert table.seeds["ADIIII"] == (30.0, 31.0, 32.0, 29.0) and table.seeds["DDDDDD"] == (45.0, 47.0)
    assert table.spread("ADIIII") == pytest.approx(1.2909944) and table.val_ppl("DDDDDD") == 46.0
    assert table.noise_ceiling == noise_ceiling({k: list(v) for k, v in table.seeds.items()})
    assert ("parnas train --config wt2-cpu --set 'model.blocks=[attention, dense, identity, identity, identity, "
            "identity]' --set train.max_steps=600 --set train.seed=2 --set train.threads=1") in table.rebuild
    assert table.rebuild.startswith("parnas study ...") and "parnas table add-seeds" in table.rebuild


@pytest.mark.parametrize("change, message", [
    (dict(layout="ADIIII", seed=1), "is seed 1 of ADIIII, which the table holds already"),
    (dict(layout="DDDIII", seed=2), "trained DDDIII, which the table does not hold"),
    (dict(layout="ADIIII", seed=2, steps=300), "trained 300 steps; the table's layouts were retrained for 600"),
    (dict(layout="ADIIII", seed=2, vocab={**VOCAB, "sha256": "cd" * 32}), "another vocabulary"),
    (dict(layout="ADIIII", seed=2, sets=("model.d_model=32",)), "another model than the table's: model.d_model"),
])
def test_a_seed_the_table_cannot_take_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys, change,
                                                                                     message):
    path = six_hundred_step_table(tmp_path)
    before = path.read_text()
    good = train_run(tmp_path, "ADIIII", 4)
    assert main(["table", "add-seeds", str(good), str(train_run(tmp_path, **change)), "--table", str(path)]) == 2
    assert message in refusal(capsys.readouterr().err) and path.read_text() == before
    assert main(["table", "add-seeds", str(tmp_path), "--table", str(path)]) == 2
    assert "is not a finished `parnas train` run" in refusal(capsys.readouterr().err)


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "spaces").glob("*.json")),
                         ids=lambda p: p.stem)
def test_a_shipped_table_describes_the_model_its_own_config_builds_today(path):
    """`parnas table score` refuses a run whose model the table's perplexities do not describe; a shipped table
    recorded with a setting since removed would refuse every run, so its record is kept to today's model."""
    from parnas.study.table import model_differences

    table = load_table(path)
    cfg = load_config(table.config["preset"], table.config["overrides"])
    assert model_differences(table.config["model"], cfg, table.candidates) == []
