"""The two prepared device calls, ``tools/gpu_checks.sh seed`` and ``study``, checked on the CPU: their steps in
order, limits that keep each call within 9 minutes, and every command they would run accepted as it stands (parnas's
commands by ``--dry-run``, the scripts' arguments by their parsers, their settings by the config), with CUDA graphs
(``train.compile=reduce-overhead``, which the CPU refuses) read as ``default``. And the two scripts' own plans:
where the seed's run stops, and the study's steps and verdict."""

import json
import shlex
from pathlib import Path

import pytest

from parnas.cli import main
from tests.gpu.test_gpu_checks import SCALE, run_plan

ROOT = Path(__file__).parents[2]
SEED = ["seed-train", "seed-wt103", "seed-search", "seed-plot"]
STUDY = ["study-search", "study-retrain"]
CALL_LIMIT = 9 * 60 - 40  # the install (.gpu/run.sh) and the lines before the steps take the rest


def on_cpu(settings: list[str]) -> list[str]:
    return [s.replace("train.compile=reduce-overhead", "train.compile=default") for s in settings]


def sets(args: list[str]) -> list[str]:
    return [a for flag, a in zip(args, args[1:]) if flag == "--set"]


def dry_run(capsys, monkeypatch, tmp_path, args: list[str]) -> str:
    monkeypatch.chdir(ROOT)  # the plans name the shipped latency tables relative to the repository
    monkeypatch.setenv("PARNAS_DATA_DIR", str(tmp_path / "no-data"))
    assert main([*on_cpu(args), "--dry-run"]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


# Stand-ins for the commands that write what comes back: each writes its file where the real one does.
WRITERS = """out_of() { echo "$2" | sed "s/.*$1\\([^ ]*\\).*/\\1/"; }
case "$*" in
    *seed_table.py*) d=$(out_of "--out " "$*"); mkdir -p "$d" && echo table >"$d/seed-table.md" ;;
    *"parnas.cli plot"*) d=$(out_of "plot " "$*"); mkdir -p "$d" && echo png >"$d/probabilities.png" ;;
    *gpu_study.py*) d=$(out_of "--out " "$*"); mkdir -p "$d" && echo verdict >"$d/study.md" ;;
    *"parnas.cli search"*wt2-par*) d=$(out_of search.out_dir= "$*"); mkdir -p "$d" && echo {} >"$d/architecture.json" ;;
esac"""
BACK = {"seed": ["device.txt", "probabilities.png", "seed-plot.log", "seed-search.log", "seed-table.md",
                 "seed-train.log", "seed-wt103.log", "summary.tsv"],
        "study": ["device.txt", "study-architecture.json", "study-retrain.log", "study-search.log", "study.md",
                  "summary.tsv"]}


@pytest.mark.parametrize("plan, steps", [("seed", SEED), ("study", STUDY)])
def test_each_call_runs_its_steps_in_order_within_9_minutes(tmp_path, plan, steps):
    """And leaves in $OUT what a device call brings back: at most 8 files, no folder (the runs stay outside)."""
    proc, out, rows = run_plan(tmp_path, [plan], WRITERS)
    assert sorted(p.name for p in out.iterdir()) == BACK[plan] and len(BACK[plan]) <= 8
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [(r["step"], r["result"]) for r in rows] == [(s, "passed") for s in steps]
    assert sum(float(r["limit"]) for r in rows) / SCALE <= CALL_LIMIT
    limits = {r["step"]: float(r["limit"]) / SCALE for r in rows}
    calls = [shlex.split(c) for c in (tmp_path / "calls").read_text().splitlines()]
    for call in calls:  # a script given --seconds ends its own work before its step's limit cuts it
        if "--seconds" in call:
            step = "seed-train" if "benchmarks/seed_table.py" in call else "study-retrain"
            assert float(call[call.index("--seconds") + 1]) / SCALE <= limits[step] - 10  # scaled alike


def calls_of(tmp_path: Path, plan: str, gpu: str) -> dict[str, list[str]]:
    """The plan's commands, by what they run (a parnas command's name, or a script's file name)."""
    proc, _, _ = run_plan(tmp_path, [plan], "", gpu=gpu)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = {}
    for line in (tmp_path / "calls").read_text().splitlines():
        args = shlex.split(line)
        if args[:2] == ["-m", "parnas.cli"]:
            calls[args[2]] = args[2:]
        elif args[0].startswith("benchmarks/"):
            calls[Path(args[0]).stem] = args[1:]
    return calls


def test_the_seed_calls_commands_are_accepted_as_they_stand(capsys, monkeypatch, tmp_path, benchmark_script):
    calls = calls_of(tmp_path, "seed", "NVIDIA H200")
    assert set(calls) == {"seed_table", "gpu_step", "search", "plot"}
    seed_table = benchmark_script("seed_table")
    args = seed_table.parse_args(calls["seed_table"])
    settings = [a for s in [*seed_table.SETTINGS, *args.set] for a in ("--set", s)]
    out = dry_run(capsys, monkeypatch, tmp_path, ["train", "--config", args.config, *settings])
    assert "steps 56,500, tokens 57,856,000" in out  # the seed's 20 epochs, its schedule whatever the run reaches
    step = benchmark_script("gpu_step").parse_args(calls["gpu_step"])
    assert step.shape == ["wt103-base"] and step.compile == "reduce-overhead"
    out = dry_run(capsys, monkeypatch, tmp_path, calls["search"])
    assert "steps 300," in out and "search (the supernet)" in out
    from parnas.cli import build_parser

    plot = build_parser().parse_args(calls["plot"])
    assert plot.run_dir == dict(s.split("=", 1) for s in sets(calls["search"]))["search.out_dir"]


@pytest.mark.parametrize("gpu, table", [("NVIDIA H100 80GB HBM3", "benchmarks/tables/h100-wt2-par-v2.json"),
                                        ("NVIDIA H200", "benchmarks/tables/h200-wt2-par-v2.json"),
                                        ("NVIDIA A100-SXM4-80GB", None)])
def test_the_study_calls_commands_are_accepted_and_priced_by_this_gpus_table(capsys, monkeypatch, tmp_path,
                                                                              benchmark_script, gpu, table):
    """The search is priced by the wt2-par table timed on the GPU's kind (a dry run on the CPU then gives its
    expected time on that GPU), or times its own on another kind; the retrains read the same table."""
    calls = calls_of(tmp_path, "study", gpu)
    assert set(calls) == {"search", "gpu_study"}
    search = dict(s.split("=", 1) for s in sets(calls["search"]))
    assert search.get("search.latency_table") == table and search["search.par-gumbel-darts.latency_budget"] == "0.65"
    out = dry_run(capsys, monkeypatch, tmp_path, calls["search"])
    assert "steps 300, tokens 1,228,800 (32 x 128 a step)" in out
    assert ("latency budget 0.65: within reach by the given table" in out) == bool(table)
    assert (f"on {gpu} (search.latency_table" in out) == bool(table)
    study = benchmark_script("gpu_study").parse_args(calls["gpu_study"])
    assert study.search == search["search.out_dir"] and study.latency_table == table and study.seeds == 2
    assert set(sets(calls["gpu_study"])) <= set(sets(calls["search"]))  # the retrains at the search's shape
    dry_run(capsys, monkeypatch, tmp_path, ["train", "--config", study.config,
                                            *(a for s in [*study.set, "train.compile=reduce-overhead"]
                                              for a in ("--set", s))])


@pytest.mark.parametrize("left, reach, fit", [(250.0, 56500, 65143), (100.0, 28250, 29232), (-1.0, 5651, 5651)])
def test_the_seed_run_stops_at_the_largest_of_the_seeds_counts_that_fits(benchmark_script, left, reach, fit):
    """At step 5,651, 4 ms a step and 0.5 s a validation (one every 2,825 steps), with the final evaluation's
    three validations kept: the largest count within the steps that fit, or now when none does."""
    seed_table = benchmark_script("seed_table")
    counts = seed_table.targets(2825)
    assert counts == [2825, 8475, 14125, 28250, 48025, 56500]
    assert seed_table.largest_fitting(5651, counts, 0.004, 0.5, 2825, left) == (reach, fit)


def test_the_study_takes_the_mode_that_fits_more_steps(benchmark_script):
    """Short retrains of many layouts: compiling each costs more than CUDA graphs save, so eager fits more; given
    long enough, the graphs' 0.37x step wins."""
    gpu_study = benchmark_script("gpu_study")
    step_ms, blocks = {"ADADADADADAD": 25.7, "ADAD": 12.3, "ADADAD": 15.6, "ADIDAIDDIDII": 18.0}, \
        {"ADADADADADAD": 12, "ADAD": 4, "ADADAD": 6, "ADIDAIDDIDII": 7}
    short = {m: gpu_study.plan_steps(step_ms, blocks, 2, 355, m) for m in ("none", "reduce-overhead")}
    long = {m: gpu_study.plan_steps(step_ms, blocks, 2, 3600, m) for m in ("none", "reduce-overhead")}
    assert short["none"] > short["reduce-overhead"] > 0 and long["reduce-overhead"] > long["none"]
    assert gpu_study.plan_steps(step_ms, blocks, 2, 10, "reduce-overhead") == 0


def tiny(micro: Path) -> list[str]:
    return ["--config", "tiny", "--set", f"data.path={micro}", "--set", "data.tokenizer=char",
            "--set", "model.cutoffs=[]", "--set", "train.compile=none", "--set", "train.precision=32-true"]


def test_a_seed_run_out_of_time_stops_at_its_decision_and_keeps_its_table(tmp_path, micro, benchmark_script):
    """No time left when it decides (after the second epoch's validation, at step 5 of epochs of 2 steps): it
    stops there; the first count's row is filled in both measures, the later ones say they were not reached."""
    seed_table = benchmark_script("seed_table")
    args = [*tiny(micro), "--set", "train.max_steps=40", "--set", "train.eval_every=2", "--set", "train.log_every=2",
            "--seconds", "0",
            "--out", str(tmp_path / "seed")]
    assert seed_table.main(args) == 0
    rows = [r.split("|")[1:-1] for r in (tmp_path / "seed" / "seed-table.md").read_text().splitlines()
            if r.startswith("| ") and r[2].isdigit()]
    assert [r[2].strip() for r in rows] == ["2", "6", "10", "20", "34", "40"]
    assert float(rows[0][3]) > 1 and float(rows[0][4]) > 1
    assert all(r[3].strip() == "not reached" for r in rows[1:])
    metrics = json.loads((tmp_path / "seed" / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 5 and metrics["config"]["train"]["max_steps"] == 40  # the schedule kept


@pytest.mark.slow
def test_a_study_retrains_each_layout_on_two_seeds_and_judges_against_the_front(tmp_path, micro, benchmark_script):
    """From a search folder (its export ADII and a latency table): the Transformer-XL, the front point at the
    export's cost and the export, two seeds each; the verdict weighs the gap against the seed spread."""
    from parnas import architecture
    from parnas.config import load_config
    from parnas.data.corpora import load_splits
    from parnas.training.latency_table import LatencyTable

    cfg = load_config("tiny", [f"data.path={micro}", "data.tokenizer=char", "model.cutoffs=[]"])
    tokenizer, _ = load_splits(cfg.data)
    kinds = ["attention", "dense", "identity", "identity"]
    search = tmp_path / "search"
    architecture.write(search / "architecture.json", architecture.make_record(
        {architecture.label(i): k for i, k in enumerate(kinds)}, cfg.model, tokenizer.vocab_size,
        tokenizer=tokenizer.identity(), search={"seed": 0, "latency": {"budget": 0.65}}))
    modes = ("train", "inference", "generate")
    table = LatencyTable({"device": "Stand-in GPU"}, dict.fromkeys(modes, 2.0),
                         {k: dict.fromkeys(modes, c) for k, c in (("attention", 3.0), ("dense", 1.0),
                                                                   ("identity", 0.0))}, 4)
    (search / "latency_table.json").write_text(json.dumps(table.to_dict()))
    study = benchmark_script("gpu_study")
    assert study.main(["--search", str(search), "--out", str(tmp_path / "study"), "--steps", "4", "--compile", "none",
                       *tiny(micro)[:-4]]) == 0
    text = (tmp_path / "study" / "study.md").read_text()
    assert "| transformer-xl | ADAD | 1.000 |" in text and "| front | AD | 0.600 |" in text
    assert "| found | ADII | 0.600 |" in text
    assert all(len(line.split("|")[4].split(",")) == 2 for line in text.splitlines() if line.startswith("| ")
               and line[2] != "r" and not line.startswith("|---"))
    assert "budget 0.65: val ppl" in text and "seed spread" in text
