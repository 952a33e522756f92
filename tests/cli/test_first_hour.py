"""What a newcomer's first hour relies on: search.yaml sized for a laptop and the README's figures read
from it, every option explained in --help, a trial that shows in NNI's web UI what it has found, and every
command the README and docs show running (at tiny scale), or skipped with its reason."""

import argparse
import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from parnas.cli import build_parser, main
from parnas.config import load_config, presets

REPO = Path(__file__).resolve().parents[2]
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
    assert (trials, concurrency, cfg.train.max_steps) == (3, 1, 600)  # (NNI 3.0 mixes up concurrent trials' parameters)
    assert (cfg.model.n_blocks, cfg.model.d_model, cfg.model.d_ff, cfg.data.batch_size, cfg.data.seg_len,
            cfg.model.mem_len, cfg.data.vocab_size) == (6, 64, 256, 8, 32, 32, 1000)
    assert cfg.train.eval_every <= cfg.train.max_steps
    assert cfg.search.settings.arch_warmup_steps < cfg.train.max_steps // 2
    assert "OMP_NUM_THREADS=1" in experiment["trialCommand"]  # a busy 2-core laptop: more threads, slower steps


def test_the_readme_is_a_front_door_of_at_most_800_words():
    words = len((REPO / "README.md").read_text().split())  # as `wc -w README.md` counts them
    assert words <= 800, f"README.md has {words} words: results go in docs/results.md, speed in docs/benchmarks.md"


def search_minutes(text: str) -> list[float]:
    """Each "N minutes" / "N min" figure stated within a line or so after a mention of `make search`."""
    return [float(m[1]) for m in re.finditer(r"make search\b[^\n]{0,100}?(\d+(?:\.\d+)?) min(?:utes)?\b", text)]


def test_make_search_is_given_one_time_and_the_makefile_and_search_yaml_say_the_same():
    stated = {name: search_minutes((REPO / name).read_text()) for name in ("README.md", "Makefile", "search.yaml")}
    assert len(stated["README.md"]) == 1, f"README.md should state `make search`'s time once: {stated}"
    assert stated["Makefile"] and stated["search.yaml"], stated
    assert len({t for times in stated.values() for t in times}) == 1, f"`make search`'s time disagrees: {stated}"


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
    monkeypatch.setattr(nni, "get_next_parameter", lambda: {"search.par-gumbel-darts.tau_end": 0.3})
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
                         rf"{evaluation['architecture']}, [\d.]+ supernet( \([\d.]+ of the split\))?$", out,
                         flags=re.M), out
    (final,) = nni_trial["final"]
    assert final == reports[-1]  # the last evaluation was at the last step
    record = json.loads((tmp_path / "trial" / "architecture.json").read_text())["search"]
    assert final["latency_ratio"] == record["latency"]["ratio"] and final["architecture"] == record["argmax"]
    assert record["tau_final"] == pytest.approx(0.3) and record["nni_trial"] == "Abc12"  # the tuner's parameter


# --- every command the README's and docs' code blocks show ---------------------------------------------------

def documented_commands() -> list[tuple[str, str]]:
    """``(page, command)`` for each ``parnas ...``, ``make ...`` or ``python tools/...`` line of the bash blocks of
    README.md and docs/*.md: continuation lines joined, comments and ``VAR=value`` or ``srun`` prefixes kept as
    written."""
    found = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in re.findall(r"^```bash\n(.*?)^```", page.read_text(), flags=re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                program = next((w for w in words if not re.match(r"\w+=", w) and w != "srun"), None)
                script = words[words.index(program) + 1:][:1] if program == "python" else []
                if program in ("parnas", "make") or script and script[0].startswith("tools/"):
                    found.append((page.name, shlex.join(words)))
    return found


@dataclass(frozen=True)
class Skip:
    reason: str


@dataclass(frozen=True)
class Run:
    """Run the command in a fresh folder holding ``needs`` (see :class:`Workspace`), with settings appended
    after its own (so they win): ``scale`` "tiny" appends ``--config tiny`` and small settings on the micro
    corpus, "data" only the micro corpus (a command that trains nothing), "none" nothing; then ``extra``."""
    needs: tuple[str, ...] = ()
    scale: str = "tiny"
    extra: tuple[str, ...] = ()
    gpu: bool = False


GPU = "needs a CUDA GPU"
# the documented latency table's shapes and precision (an H100's, bf16), shrunk for the CPU
TABLE_SHAPES = ("--set", "data.batch_size=4", "--set", "data.seg_len=16", "--set", "model.mem_len=16",
                "--set", "train.precision=32-true")
HOURS = "takes an hour or more at its size; the documented tiny study runs the same code"
# first match wins; every documented command must match one, and every entry some command
PLANS: list[tuple[str, Skip | Run]] = [
    (r"^make install$", Skip("creates .venv and downloads packages")),
    (r"^make search$", Skip("starts nnictl on port 8080 (test_nnictl runs search.yaml's experiment, shrunk, "
                            "on a free port, and `parnas launch` on a free port)")),
    (r"^make test", Skip("runs the test suite itself (test-gpu: the CUDA tests; VENV=: installs another torch)")),
    (r"^parnas launch ", Skip("starts nnictl on port 8080 (test_nnictl launches on a free port)")),
    (r"^srun ", Skip("needs SLURM and GPUs on two nodes")),
    (r"^python tools/first_hour\.py", Skip("reruns the whole first hour (about 10 minutes); "
                                          "tests/cli/test_first_hour_script.py runs its dry run and its rewrite")),
    (r"^python tools/campaign\.py --quick", Skip("tests/cli/test_campaign.py runs it and checks every case")),
    (r"^python tools/campaign\.py", Skip("takes many minutes, and runs this test's documented commands itself; "
                                        "tests/cli/test_campaign.py runs --quick")),
    (r"--accelerator gpu", Run(needs=("found", "arch"), gpu=True, extra=("--set", "train.precision=32-true"))),
    (r"^parnas study \.\.\. ", Skip("elides its arguments (the line above, with another target)")),
    (r"^parnas table (score|build) ", Skip("needs the finished study or search of the lines above (minutes to "
                                                "hours at their size); tests/study/test_score.py and "
                                                "tests/study/test_table.py run both on tiny runs")),
    (r"^parnas table add-seeds ", Skip("adds the line above's wt2-cpu retrain to the shipped table, in place; "
                                         "tests/study/test_table.py adds runs to a table and refuses the ones it "
                                         "cannot take")),
    (r"^parnas study --config tiny ", Run(extra=("--seeds", "1", "--steps", "2"))),
    (r"^parnas study ", Skip(HOURS)),
    (r"^parnas strategies ", Skip("searches with four strategies, 3 seeds each (many minutes); "
                                  "tests/study/test_study.py compares three at tiny scale")),
    (r"--strategy regularized-evolution", Skip("starts an NNI experiment of 8 trials (test_nni_strategies runs "
                                                 "every multi-trial strategy, 2 tiny trials each)")),
    (r"search\.candidates=\[attention,shift", Skip("needs the plugin package the section writes (parnas-shift)")),
    (r"--strategy random-layout", Skip("needs the plugin package the section writes (random-layout); "
                                       "tests/strategies/test_strategy_registry.py installs and runs it")),
    (r"--dry-run", Run(scale="none")),
    (r"^parnas latency ", Run(extra=TABLE_SHAPES)),
    (r"search\.latency_table=h100", Run(needs=("table",), extra=TABLE_SHAPES)),
    (r"^parnas (export|plot) --experiment", Run(needs=("experiment",), scale="none")),
    (r"^parnas plot runs/search", Run(needs=("search",), scale="none")),
    (r"^parnas retrain --arch '?found/", Run(needs=("found",))),
    (r"^parnas retrain .*--resume", Run(needs=("arch", "runs"))),
    (r"^parnas retrain --arch architecture\.json", Run(needs=("arch",))),
    (r"^parnas retrain ", Run()),
    (r"^parnas train .*--resume", Run(needs=("train",))),
    (r"^parnas train --config wt2-(seed|cpu) --set '?model\.blocks=", Run(extra=("--set", "model.n_blocks=6"))),
    (r"^parnas train ", Run()),
    (r"^parnas search .*search\.latency_table=runs/(wt2-cpu|planer|adi6)-(table|latency)\.json", Skip(
        "prices with a table at wt2-cpu's full shapes that a line above writes (a search priced by a "
        "given table runs in tests/training/test_latency_table.py; the 4-block searches above run here, tiny)")),
    (r"^parnas search ", Run()),
    (r"^parnas (evaluate|generate|compare) ", Run(needs=("runs",), scale="none")),
    (r"^parnas cutoffs .*spm\.model", Run(needs=("spm",), scale="data")),
    (r"^parnas cutoffs ", Run(scale="data")),
]


def plan(command: str) -> Skip | Run | None:
    return next((p for pattern, p in PLANS if re.search(pattern, command)), None)


def test_every_documented_command_is_run_or_skipped_with_its_reason():
    commands = [c for _, c in documented_commands()]
    assert len(commands) > 40
    assert [c for c in commands if plan(c) is None] == []
    assert [p for p, _ in PLANS if not any(re.search(p, c) for c in commands)] == []  # no stale entry


EXPERIMENT, TRIAL = "Ab12Cd34", "T0001"


class Workspace:
    """What documented commands start from, each made once (tiny, on the micro corpus) and copied into a
    command's folder: ``arch`` (architecture.json, a search's), ``found`` (found/<trial>.json), ``runs``
    (runs/found, runs/txl and runs/aaa: finished retrains), ``train`` (runs/tiny, a finished train run),
    ``search`` (runs/search, a search's run folder), ``experiment`` (an nnictl experiment's folder holding one
    finished trial, under $NNI_EXPERIMENTS_DIR), ``table`` (h100-wt2-par.json, timed at the documented
    search's shapes here) and ``spm`` (a cached SentencePiece tokenizer of the corpus)."""

    def __init__(self, root: Path, micro: Path) -> None:
        self.root, self.micro, self.made = root, micro, set()

    def tiny(self) -> list[str]:
        sets = [f"data.path={self.micro}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "train.max_steps=2",
                "train.eval_every=2", "train.log_every=1", "search.log_every=1"]
        return ["--config", "tiny", *[a for s in sets for a in ("--set", s)]]

    def settings(self, scale: str) -> list[str]:
        data = ["--set", f"data.path={self.micro}", "--set", "data.vocab_size=100"]
        return {"tiny": self.tiny(), "data": data, "none": []}[scale]

    def run(self, *args: str) -> None:
        assert main([*args]) == 0, args

    def make(self, name: str) -> None:
        if name in self.made:
            return
        r = self.root
        if name == "arch":
            self.run("search", *self.tiny(), "--set", f"search.out_dir={r / 'search'}")
            shutil.copy(r / "search" / "architecture.json", r / "architecture.json")
        elif name == "found":
            self.make("arch")
            (r / "found").mkdir()
            shutil.copy(r / "architecture.json", r / "found" / f"{TRIAL}.json")
        elif name == "runs":
            self.make("arch")
            for arch, out in ((str(r / "architecture.json"), "found"), ("transformer-xl", "txl"),
                              ("all-attention", "aaa")):
                self.run("retrain", "--arch", arch, *self.tiny(), "--out", str(r / "runs" / out))
        elif name == "train":
            self.run("train", *self.tiny(), "--set", f"train.out_dir={r / 'runs' / 'tiny'}")
        elif name == "search":
            self.make("arch")
            shutil.copytree(r / "search", r / "runs" / "search")
        elif name == "experiment":
            self.make("arch")
            shutil.copytree(r / "search", r / "experiments" / EXPERIMENT / "trials" / TRIAL)
        elif name == "table":
            self.run("latency", *self.tiny(), *TABLE_SHAPES, "--out", str(r / "h100-wt2-par.json"))
        elif name == "spm":
            self.run("cutoffs", "--config", "tiny", "--set", f"data.path={self.micro}", "--set", "data.vocab_size=100",
                     "--clusters", "2")
        self.made.add(name)

    def enter(self, folder: Path, needs: tuple[str, ...]) -> None:
        """Copy what ``needs`` names into ``folder`` (made once, here)."""
        for name in needs:
            self.make(name)
        copies = {"arch": ["architecture.json"], "found": ["found"], "runs": ["runs/found", "runs/txl", "runs/aaa"],
                  "train": ["runs/tiny"], "search": ["runs/search"], "table": ["h100-wt2-par.json"]}
        for name in needs:
            for rel in copies.get(name, []):
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                copy = shutil.copytree if (self.root / rel).is_dir() else shutil.copy
                copy(self.root / rel, folder / rel)

    def localise(self, command: str) -> list[str]:
        """The documented command's words with its placeholders filled in: an optional ``[--flag value]``
        given, an experiment id, a trial, ``/data/nni`` and ``~/.cache/parnas`` as this test's folders."""
        command = re.sub(r"'?\[(--[\w-]+)'? '?([^\]\s']+)\]'?", r"\1 \2", command)
        spm = sorted(Path(os.environ["PARNAS_CACHE_DIR"]).glob("tokenizers/*/spm.model"))
        out = []
        for w in shlex.split(command):
            w = w.replace("<id>", EXPERIMENT).replace("<trial>", TRIAL)
            w = w.replace("/data/nni", str(self.root / "experiments"))
            out.append(str(spm[0]) if "<dir>/spm.model" in w else w)
        return out


@pytest.fixture(scope="module")
def workspace(micro, wt2_tokenizer, tmp_path_factory):  # <dir>/spm.model: the presets' tokenizer
    with pytest.MonkeyPatch.context() as mp:  # module scope: set the private cache ourselves
        mp.setenv("PARNAS_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "parnas-cache"))
        mp.setenv("NNI_EXPERIMENTS_DIR", str(tmp_path_factory.getbasetemp() / "documented" / "experiments"))
        yield Workspace(tmp_path_factory.mktemp("documented", numbered=False), micro)


@pytest.mark.slow
@pytest.mark.parametrize("page, command", documented_commands(),
                         ids=[f"{page}:{command[:60]}" for page, command in documented_commands()])
def test_every_documented_command_runs(workspace, tmp_path, monkeypatch, page, command):
    """Each command as documented, in a folder of its own, at tiny scale (``--config tiny`` and small settings
    appended) or as it is (a dry run); ``--out`` and relative paths land in that folder."""
    how = plan(command)
    if isinstance(how, Skip):
        pytest.skip(how.reason)
    if how.gpu and not __import__("torch").cuda.is_available():
        pytest.skip(GPU)
    monkeypatch.setenv("NNI_EXPERIMENTS_DIR", str(workspace.root / "experiments"))
    workspace.enter(tmp_path, how.needs)
    monkeypatch.chdir(tmp_path)
    words = workspace.localise(command)
    assert words[0] == "parnas"
    args = [*words[1:], *workspace.settings(how.scale), *how.extra]
    assert main(args) == 0, shlex.join(args)
