"""NNI's own one-shot strategies search the PAR space through the task, as an NNI user would set it up."""

import atexit
import logging
import os
from pathlib import Path

import pytest
import torch
from nni.nas.evaluator.pytorch import Lightning, Trainer
from nni.nas.experiment import NasExperiment
from nni.nas.strategy import DARTS, GumbelDARTS, Proxyless, RandomOneShot

from parnas.architecture import make_record, model_config
from parnas.search_spaces import PARTransformerXLSpace, fixed_model
from parnas.strategies.arch_stream import NNIDartsTask
from parnas.training.data_module import SegmentData
from parnas.training.trainer import build_trainer
from tests.nni_stall import STALLED, rerun_on_stall
from tests.strategies.test_search import SPLITS, VOCAB, search_config

logging.getLogger("nni").setLevel(logging.WARNING)

STRATEGIES = {
    "darts": lambda: DARTS(gradient_clip_val=0.25),
    "gumbel-darts": lambda: GumbelDARTS(temperature=(1.0, 0.5), gradient_clip_val=0.25),
    "random-oneshot": RandomOneShot,
    "proxyless": lambda: Proxyless(gradient_clip_val=0.25),
}


def search(tmp_path, cfg, strategy, data=None):
    trainer = build_trainer(cfg.train, tmp_path, trainer_cls=Trainer, gradient_clip_val=None)
    task = NNIDartsTask(cfg.train)
    data = data or SegmentData(SPLITS, 8, 4, 16)
    data.task = task  # NNI's module wraps the task: the batches are grouped for its model
    evaluator = Lightning(task, trainer, datamodule=data)
    experiment = NasExperiment(PARTransformerXLSpace(cfg.model, VOCAB), evaluator, strategy)
    experiment.config.experiment_working_directory = str(tmp_path / "nni")  # not ~/nni-experiments
    experiment.run()
    experiment.stop()
    atexit.unregister(experiment.stop)
    return task, experiment


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_nni_strategy_searches_the_space_and_exports_a_retrainable_architecture(tmp_path, name):
    cfg = search_config("train.max_steps=6", "train.eval_every=3")
    task, experiment = search(tmp_path, cfg, STRATEGIES[name]())

    # 6 optimiser steps; NNI's DARTS modules step the logits through Lightning's optimizer, which counts as
    # one, on the validation batch: half the steps are theirs, and only the training batches advance the data
    darts = name != "random-oneshot"
    assert task.batches_seen == (3 if darts else 6)
    assert task.mems["train"][0].shape == (8, 8, 32)  # (B, mem_len, d_model): the training streams' memory
    assert (task.arch_stream.memory is not None) == darts
    if not darts:  # NNI's sampling module runs the validation loop (without its start and end hooks)
        assert task.mems["val"][0].shape == (4, 8, 32)
    if darts:  # the validation stream's own memory, at its own batch size
        assert task.arch_stream.memory[0].shape == (4, 8, 32)
    (best,) = experiment.export_top_models(formatter="dict")
    record = make_record(best, cfg.model, VOCAB, search={"strategy": name})  # validated as retrain validates
    model = fixed_model(model_config(record), VOCAB, record["architecture"])
    assert model.block_kinds == [best["block_0"], best["block_1"]]
    h, _ = model(torch.randint(0, VOCAB, (2, 4)))
    assert torch.isfinite(h).all()


def test_under_nni_darts_the_validation_streams_memory_restarts_with_that_stream(tmp_path, monkeypatch):
    """The CombinedLoader cycles the (shorter) validation loader: its first segment must see no memory again."""
    import parnas.training.task as task_module

    calls = []  # (batch size, memory was empty) of every segment the model ran

    def spy(model, x, y, mems, groups=None):
        calls.append((x.size(0), mems is None))
        return segment_nll(model, x, y, mems, groups)

    segment_nll = task_module.segment_nll
    monkeypatch.setattr(task_module, "segment_nll", spy)
    data = SegmentData(SPLITS, 8, 4, 16)
    n_val = len(data.batches("valid"))
    cfg = search_config(f"train.max_steps={2 * (n_val + 2)}", "train.eval_every=10000")
    search(tmp_path, cfg, DARTS(), data)
    arch = [empty for batch_size, empty in calls if batch_size == 4]  # the validation stream's segments
    assert len(arch) == n_val + 2
    assert [i for i, empty in enumerate(arch) if empty] == [0, n_val]


@pytest.mark.slow
def test_importing_parnas_leaves_nni_strategies_importable():
    """NNI 3.0 swaps its one-shot strategies for failing placeholders when its strategy module is imported
    before ``nni.nas.strategy``: parnas's modules must not do that to a user who imports them first."""
    import subprocess
    import sys

    code = ("import parnas.strategies.gumbel_darts, parnas.training.task\n"
            "from nni.nas.strategy import DARTS\n"
            "print(DARTS.__module__)")
    root = str(Path(__file__).parents[2])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.stdout.split()[-1] == "nni.nas.oneshot.pytorch.strategy", out.stderr


# --- parnas search --strategy NAME ---------------------------------------------------------------------------------

def test_the_fixed_model_with_the_supernets_weights_computes_what_the_supernet_computes_for_that_layout(tmp_path):
    """What ``--strategy`` reports as the exported architecture's val ppl: NNI's mixed layers name each candidate
    by its kind, and dropping that name gives the fixed model the supernet's weights."""
    from parnas.strategies.nni_strategies import fixed_weights
    from parnas.strategies.supernet_export import exported

    cfg = search_config("train.max_steps=2", "train.eval_every=2")
    task, experiment = search(tmp_path, cfg, STRATEGIES["darts"]())
    (chosen,) = experiment.export_top_models(formatter="dict")
    for layout in (chosen, {"block_0": "attention", "block_1": "dense"}):
        model = fixed_model(cfg.model, VOCAB, layout)
        model.load_state_dict(fixed_weights(task.model.state_dict(), layout))  # strict: every weight, no other
        x = torch.randint(0, VOCAB, (2, 8))
        choices = sorted((m for m in task.model.modules() if hasattr(m, "_arch_alpha")),
                         key=lambda m: int(m.label.rsplit("_", 1)[1]))
        task.model.eval(), model.eval()
        with torch.no_grad(), exported(choices, list(layout.values())):
            expected, _ = task.model(x)
        torch.testing.assert_close(model(x)[0], expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["darts", "gumbel-darts", "random-oneshot", "proxyless"])
def test_parnas_search_strategy_writes_a_record_that_retrain_accepts(micro, tmp_path, capsys, name):
    import json

    from parnas.cli import main

    sets = [f"data.path={micro}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "model.n_blocks=2",
            "train.max_steps=4", "train.eval_every=2", f"search.out_dir={tmp_path / 'search'}"]
    assert main(["search", "--config", "tiny", "--strategy", name, *(a for s in sets for a in ("--set", s))]) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "search" / "architecture.json").read_text())
    assert record["search"]["strategy"] == name and f"NNI's {name}" in out
    assert record["search"]["val_ppl"] > 1 and 0 < record["search"]["latency"]["ratio"]
    assert set(record["architecture"].values()) <= {"attention", "dense", "identity"}
    if name != "random-oneshot":  # a strategy with logits writes PAR's history and draws its pictures
        lines = (tmp_path / "search" / "history.jsonl").read_text().splitlines()
        assert lines and set(json.loads(lines[-1])["probabilities"]) == {"block_0", "block_1"}
        assert (tmp_path / "search" / "architecture.png").is_file()
    retrain = [f"data.path={micro}", "data.tokenizer=char", "train.max_steps=2", "train.eval_every=2",
               f"train.out_dir={tmp_path / 'retrain'}"]
    assert main(["retrain", "--arch", str(tmp_path / "search" / "architecture.json"), "--config", "tiny",
                 *(a for s in retrain for a in ("--set", s))]) == 0
    assert json.loads((tmp_path / "retrain" / "metrics.json").read_text())["architecture"] == \
        "".join(k[0].upper() for k in record["architecture"].values())


@pytest.mark.parametrize("args, needle", [
    (["--strategy", "evolution"], "unknown search strategy 'evolution'; known strategies: par-gumbel-darts, darts"),
    (["--strategy", "tpe", "--resume"], "starts an NNI experiment of its own"),
    (["--strategy", "random", "--set", "search.trials=0"], "search.trials must be >= 1"),
    (["--strategy", "darts", "--resume"], "cannot resume"),
])
def test_strategies_refuse_what_they_cannot_do_in_one_line(tmp_path, capsys, args, needle):
    from parnas.cli import main

    out = tmp_path / "search"
    assert main(["search", "--config", "tiny", "--set", f"search.out_dir={out}", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("parnas search: error:") and needle in err, err
    assert not out.exists()


# --- NNI's multi-trial strategies ----------------------------------------------------------------------------------

def test_the_multi_trial_evaluator_serializes_in_a_few_kb():
    """NNI pickles the evaluator into every trial and refuses more than 64 KB: it carries settings, not data."""
    import nni

    from parnas.config import load_config
    from parnas.strategies.multi_trial import evaluator

    cfg = load_config("wt2-par")  # a 12k-token vocabulary, WikiText-2's 2M training tokens: none of it travels
    traced = evaluator(cfg, {"per_kind": {"attention": 3.0, "dense": 1.0, "identity": 0.0}, "constant": 1.0,
                             "reference": 25.0})
    size = len(nni.dump(traced, pickle_size_limit=10**9).encode())  # as NNI serialises it into each trial
    assert size < 8 * 1024, size


def test_the_tuner_channel_reads_a_trial_end_whose_parameters_hold_a_double_slash():
    """A trial-end command as NNI's manager sends it: the trial's parameters (base64 pickles) as a JSON string inside
    the command's JSON string. NNI 3.0's own parsing strips ``//`` as a comment there and fails, which stopped
    multi-trial searches now and then; while a search runs, the command is read whole, and NNI is restored after."""
    import json

    import nni
    from nni.runtime.command_channel.websocket import connection

    from parnas.strategies.multi_trial import commands_read_as_plain_json

    parameters = json.dumps({"parameter_id": 0, "parameters": {"cfg": {"__nni_obj__": "gAWVvgEAAAAAAAC//8AjA1w"}}})
    command = json.dumps({"type": "EN", "content": json.dumps({"trial_job_id": "FIRyT", "event": "SUCCEEDED",
                                                               "hyper_params": parameters})})
    with pytest.raises(json.JSONDecodeError, match="Unterminated string"):
        connection.nni.load(command)  # NNI 3.0 as it is
    with commands_read_as_plain_json():
        assert connection.nni.load(command) == json.loads(command)
        metric = {"type": "ME", "content": "x"}
        assert connection.nni.load(connection.nni.dump(metric)) == metric
    assert connection.nni is nni


@pytest.mark.slow
@rerun_on_stall
@pytest.mark.parametrize("name", ["random", "regularized-evolution", "tpe", "grid"])
def test_multi_trial_strategies_train_each_architecture_in_its_own_trial(micro, tmp_path, name):
    """Through NasExperiment on the local training service (nnictl's manager on a free port, stopped after):
    2 trials (a third only repeats a trial), each a fixed model trained from scratch, reporting its val ppl and
    predicted cost; the best is exported as a record parnas retrain accepts. The search runs as a user runs it, in
    a process of its own: NNI keeps process-wide state (its websocket event loop, its trial and tuner channels) that
    hundreds of earlier tests in this process must not share with it."""
    import json
    import subprocess
    import sys

    from parnas.cli import main

    sets = [f"data.path={micro}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "model.n_blocks=2",
            "train.max_steps=2", "train.eval_every=2", "search.trials=2", f"search.out_dir={tmp_path / 'search'}"]
    args = ["search", "--config", "tiny", "--strategy", name, *(a for s in sets for a in ("--set", s))]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # a loaded machine
    try:
        done = subprocess.run([sys.executable, "-m", "parnas.cli", *args], capture_output=True, text=True, env=env,
                              timeout=900)
    except BaseException:
        print_nni_logs(tmp_path / "search" / "nni")  # shown under the failure: the manager's, the loop's, the trials'
        raise
    out = done.stdout
    if done.returncode != 0 or "best of 2 trials" not in out or "was stopped" in out or "search stops there" in out:
        print_nni_logs(tmp_path / "search" / "nni")
        stalled = STALLED if "was stopped" in out or "search stops there" in out else ""  # run again
        pytest.fail(f"{stalled}exit {done.returncode}\n{out[-3000:]}\n{done.stderr[-3000:]}")
    record = json.loads((tmp_path / "search" / "architecture.json").read_text())
    tried = record["search"]["tried"]
    assert len(tried) == 2 and record["search"]["strategy"] == name
    best = min(tried, key=lambda t: t["val_ppl"])
    assert record["search"]["val_ppl"] == pytest.approx(best["val_ppl"], abs=1e-3)
    assert "".join(k[0].upper() for k in record["architecture"].values()) == best["architecture"]
    assert all(0 < t["latency_ratio"] for t in tried)
    retrain = [f"data.path={micro}", "data.tokenizer=char", "train.max_steps=2", "train.eval_every=2",
               f"train.out_dir={tmp_path / 'retrain'}"]
    assert main(["retrain", "--arch", str(tmp_path / "search" / "architecture.json"), "--config", "tiny",
                 *(a for s in retrain for a in ("--set", s))]) == 0


def print_nni_logs(root: Path, lines: int = 60) -> None:
    for log in sorted(p for p in root.rglob("*") if p.is_file() and (p.suffix == ".log" or p.name == "stderr")):
        print(f"==> {log.relative_to(root)}", *log.read_text(errors="replace").splitlines()[-lines:], sep="\n")


# --- NNI's loop, watched -------------------------------------------------------------------------------------------

class Job:
    def __init__(self, number: int, status: str) -> None:
        self.trialJobId, self.status = f"t{number}", status


class Experiment:
    """NNI's experiment as the watch sees it: ``run`` in a thread, the manager's trial table, ``stop``."""

    def __init__(self, statuses: list[str], run_s: float | None = None, error: Exception | None = None) -> None:
        import threading

        self.jobs = [Job(i, s) for i, s in enumerate(statuses)]
        self.run_s, self.error, self.forever = run_s, error, threading.Event()

    def run(self, port: int) -> None:
        if self.error is not None:
            raise self.error
        self.forever.wait(self.run_s)  # None: NNI's loop that never ends

    def list_trial_jobs(self) -> list[Job]:
        return self.jobs

    def stop(self) -> None:
        self.forever.wait()  # NNI's stop joining a listener that waits for a message that never comes


FAST = {"poll_s": 0.01, "settle_s": 0.1, "stall_s": 0.3}


def test_a_multi_trial_search_ends_when_its_trials_have_even_if_nnis_loop_does_not():
    import time

    from parnas.strategies.multi_trial import run_until_trials_end, stop_within

    started = time.monotonic()
    why = run_until_trials_end(Experiment(["SUCCEEDED", "FAILED", "SUCCEEDED"]), 0, 3, **FAST)
    assert why is not None and "all 3 trials ended" in why
    stalled = run_until_trials_end(Experiment(["SUCCEEDED"]), 0, 3, **FAST)
    assert stalled is not None and "after 1 of 3" in stalled
    stop_within(Experiment([]), timeout_s=0.1)
    assert time.monotonic() - started < 10


def test_the_watch_waits_for_running_trials_and_for_nnis_own_end():
    from parnas.strategies.multi_trial import run_until_trials_end

    assert run_until_trials_end(Experiment(["SUCCEEDED", "RUNNING"], run_s=1.0), 0, 3, **FAST) is None
    assert run_until_trials_end(Experiment(["SUCCEEDED"] * 3, run_s=0.0), 0, 3, **FAST) is None
    with pytest.raises(RuntimeError, match="manager failed"):
        run_until_trials_end(Experiment([], error=RuntimeError("manager failed")), 0, 3, **FAST)
