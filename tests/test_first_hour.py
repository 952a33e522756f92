"""What a newcomer's first hour relies on: search.yaml sized for a laptop and the README's figures read
from it, every option explained in --help, and a trial that shows in NNI's web UI what it has found."""

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from parnas.cli import build_parser, main
from parnas.config import load_config, presets

REPO = Path(__file__).resolve().parents[1]
README = " ".join((REPO / "README.md").read_text().split())  # as read, lines unwrapped


def trial_config(yaml_name: str):
    """The experiment file and the parnas config its trialCommand runs (preset plus --set, as the trial reads
    them; the tuner's parameters only change search settings, train.seed and the arch learning rate)."""
    experiment = yaml.safe_load((REPO / yaml_name).read_text())
    words = shlex.split(experiment["trialCommand"])
    words = words[next(i for i, w in enumerate(words) if w == "parnas"):]  # after any VAR=value prefix
    assert words[:2] == ["parnas", "search"], words
    config = words[words.index("--config") + 1]
    sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    return experiment, config, load_config(config, sets)


def test_search_yaml_is_the_readme_first_hour_experiment_and_stays_laptop_sized():
    """The README's stated time holds for a size: the steps, trials and model it names are search.yaml's own."""
    experiment, preset, cfg = trial_config("search.yaml")
    trials, concurrency = experiment["maxTrialNumber"], experiment["trialConcurrency"]
    m = re.search(r"`make search` runs (\d+) trials, (\d+) at a time, of a ([\d,]+)-step search of a "
                  r"(\d+)-block, width-(\d+) supernet \(`--config ([\w-]+)`\)", README)
    assert m, "README.md no longer states search.yaml's size in the sentence this test reads"
    stated = (int(m[1]), int(m[2]), int(m[3].replace(",", "")), int(m[4]), int(m[5]), m[6])
    assert stated == (trials, concurrency, cfg.train.max_steps, cfg.model.n_blocks, cfg.model.d_model, preset)
    # what the measured minutes were measured for: a change here needs a new measurement, not an edit
    assert (trials, concurrency, cfg.train.max_steps) == (4, 1, 600)  # (NNI 3.0 mixes up concurrent trials' parameters)
    assert (cfg.model.n_blocks, cfg.model.d_model, cfg.model.d_ff, cfg.data.batch_size, cfg.data.seg_len,
            cfg.model.mem_len, cfg.data.vocab_size) == (6, 64, 256, 8, 32, 32, 1000)
    assert cfg.train.eval_every <= cfg.train.max_steps and cfg.search.arch_warmup_steps < cfg.train.max_steps // 2
    assert "OMP_NUM_THREADS=1" in experiment["trialCommand"]  # a busy 2-core laptop: more threads, slower steps


def test_gpu_experiments_are_named_for_what_they_are_and_listed_in_the_readme():
    for name, preset in (("search-seed-gpu.yaml", "wt2-seed"), ("search-par-gpu.yaml", "wt2-par")):
        experiment, config, cfg = trial_config(name)
        assert config == preset and cfg.train.accelerator == "gpu" and experiment.get("trialGpuNumber") == 1
        assert f"`{name}`" in README
    assert trial_config("search-par-gpu.yaml")[2].train.max_steps == 20000  # wt2-par at its full length


def test_every_option_of_every_command_says_what_it_does():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [f"parnas {name} {'/'.join(action.option_strings) or action.dest}"
               for name, command in sub.choices.items() for action in command._actions
               if action.help in (None, "") and not isinstance(action, argparse._HelpAction)]
    assert not missing, missing
    assert all(choice.help for choice in sub._choices_actions)  # each command's line in `parnas --help`


def test_config_help_lists_every_preset(capsys):
    assert {"tiny", "wt2-cpu", "wt2-par", "wt2-seed"} <= set(presets())
    for command in ("train", "search", "retrain", "study"):
        assert main([command, "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        assert f"preset name ({', '.join(presets())})" in text, command


def test_readme_and_docs_links_resolve():
    """Relative links point at files that exist, and #anchors at headings of the page they name."""
    def anchors(path: Path) -> set[str]:
        heads = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}

    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    checked = 0
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            assert path.exists(), f"{page.name}: {target}"
            if anchor:
                assert anchor in anchors(path), f"{page.name}: {target}"
            checked += 1
    assert checked >= 5


@pytest.fixture
def nni_trial(tmp_path, monkeypatch):
    """A search as nnictl runs it: NNI's environment, with the reports it sends to the web UI recorded."""
    import nni

    reports: dict[str, list] = {"intermediate": [], "final": []}
    monkeypatch.setenv("NNI_PLATFORM", "local")
    monkeypatch.setenv("NNI_OUTPUT_DIR", str(tmp_path / "trial"))
    monkeypatch.setenv("NNI_TRIAL_JOB_ID", "Abc12")
    monkeypatch.setattr(nni, "get_next_parameter", lambda: {"search.tau_end": 0.3})
    monkeypatch.setattr(nni, "report_intermediate_result", reports["intermediate"].append)
    monkeypatch.setattr(nni, "report_final_result", reports["final"].append)
    return reports


@pytest.mark.slow
def test_a_trial_reports_what_it_found_at_every_evaluation_and_prints_progress_from_step_1(
        nni_trial, tmp_path, wt2_slice, capsys):
    code = main(["search", "--config", "tiny", "--set", f"data.path={wt2_slice}", "--set", "data.vocab_size=300",
                 "--set", "model.cutoffs=[100, 200]", "--set", "train.max_steps=24", "--set", "train.eval_every=8",
                 "--set", "train.log_every=10", "--set", "search.log_every=4"])
    out = capsys.readouterr().out
    assert code == 0, out
    progress = [line for line in out.splitlines() if line.startswith("step ")]
    assert progress[0].startswith("step 1/24, train loss ")  # the trial's log shows it is alive at once
    assert [line.split(",")[0] for line in progress if "/24" in line] == ["step 1/24", "step 10/24", "step 20/24"]

    history = [json.loads(line) for line in (tmp_path / "trial" / "history.jsonl").read_text().splitlines()]
    evaluations = [h for h in history if "val_ppl" in h]
    reports = nni_trial["intermediate"]
    assert [r["architecture"] for r in reports] == [h["architecture"] for h in evaluations]
    assert [r["default"] for r in reports] == [round(h["val_ppl"], 4) for h in evaluations] and len(reports) == 3
    assert list(reports[0])[:3] == ["default", "architecture", "latency_ratio"]  # the web UI's order of columns
    for report, evaluation in zip(reports, evaluations):
        assert report["latency_ratio"] == pytest.approx(evaluation["exported_cost_ratio"], abs=1e-4)
        assert report["predicted_step_ms"] > 0 and report["attention_blocks"] == report["architecture"].count("A")
        assert re.search(rf"^step {evaluation['step']}: validation perplexity [\d.]+ exported architecture "
                         rf"{evaluation['architecture']}, [\d.]+ supernet$", out, flags=re.M), out
    (final,) = nni_trial["final"]
    assert final == reports[-1]  # the last evaluation was at the last step
    record = json.loads((tmp_path / "trial" / "architecture.json").read_text())["search"]
    assert final["latency_ratio"] == record["latency"]["ratio"] and final["architecture"] == record["argmax"]
    assert record["tau_final"] == pytest.approx(0.3) and record["nni_trial"] == "Abc12"  # the tuner's parameter
