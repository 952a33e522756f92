"""Ctrl-C and SIGTERM: the step in flight finishes, the checkpoint is written, the run exits 130 / 143 with one
line naming the step and the command that resumes it, and the resumed run is the uninterrupted one, exactly."""

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from parnas.cli import main, resume_command
from parnas.errors import Interrupted, stop_at_once
from parnas.retrain.run import retrain
from parnas.training import checkpoint as ckpt
from parnas.training.interrupt import SIGNALS, StopOnSignal

ROOT = Path(__file__).parents[2]


def sets(*pairs: str) -> list[str]:
    return [a for pair in pairs for a in ("--set", pair)]


def micro_sets(corpus: Path, *extra: str) -> list[str]:
    return sets(f"data.path={corpus}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "model.dropout=0.1",
                "train.warmup_steps=3", *extra)


def same_weights(a: Path, b: Path) -> None:
    a, b = ckpt.load(a), ckpt.load(b)
    assert a["global_step"] == b["global_step"]
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key


# --- in this process: the signal lands at a chosen step --------------------------------------------------

class SignalAt(pl.Callback):
    """Send ``signum`` to this process while optimiser step ``step`` is in flight (its first batch starts)."""

    def __init__(self, step: int, signum: int = signal.SIGINT) -> None:
        self.step, self.signum, self.sent = step, signum, False

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step - 1 and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)


def interrupted_settings(micro) -> list[str]:
    return [f"data.path={micro}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "model.dropout=0.1",
            "train.max_steps=12", "train.eval_every=4", "train.ckpt_every=100", "train.warmup_steps=3"]


@pytest.fixture(scope="module")
def uninterrupted(micro, tmp_path_factory):
    """The run the interrupted ones must equal, trained once for all of them."""
    out = tmp_path_factory.mktemp("uninterrupted") / "whole"
    with pytest.MonkeyPatch.context() as mp:  # module scope: set the private cache ourselves
        mp.setenv("PARNAS_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "parnas-cache"))
        whole = retrain("transformer-xl", "tiny", [*interrupted_settings(micro), f"train.out_dir={out}"])
    return whole, out


@pytest.mark.parametrize("step", [pytest.param(7, marks=pytest.mark.slow), 8,
                                  pytest.param(12, marks=pytest.mark.slow)])  # 8, validation in flight: fast
def test_a_signal_saves_the_step_in_flight_and_the_resumed_run_is_the_uninterrupted_one(micro, uninterrupted,
                                                                                          tmp_path, step):
    """Step 7 does not validate (saved at its end), step 8 does (its validation stopped and run again on
    resuming), the last step 12 does (saved after its validation, which a resumed run would not run again)."""
    whole, whole_dir = uninterrupted
    split = [*interrupted_settings(micro), f"train.out_dir={tmp_path / 'split'}"]
    handlers = [signal.getsignal(s) for s in SIGNALS]
    with pytest.raises(Interrupted) as stopped:
        retrain("transformer-xl", "tiny", split, callbacks=[SignalAt(step, signal.SIGTERM)])
    assert [signal.getsignal(s) for s in SIGNALS] == handlers  # the trainer put the handlers back
    assert (stopped.value.signum, stopped.value.step) == (signal.SIGTERM, step)
    last = tmp_path / "split" / "checkpoints" / "last.ckpt"
    assert stopped.value.checkpoint == str(last) and ckpt.load(last)["global_step"] == step
    assert not (tmp_path / "split" / "metrics.json").exists()  # not written as if finished
    resumed = retrain("transformer-xl", "tiny", split, resume=True)
    same_weights(whole_dir / "checkpoints" / "last.ckpt", last)
    assert resumed["val_ppl"] == whole["val_ppl"] and resumed["test_ppl"] == whole["test_ppl"]
    assert [h["step"] for h in whole["history"]] == [4, 8, 12]
    assert resumed["history"] == whole["history"]  # the validation at step 8 neither lost nor repeated


def test_the_first_signal_hands_every_stop_signal_to_the_at_once_handler():
    """So a second Ctrl-C ends the process at once, in one line; the first is only recorded."""
    saved = [signal.getsignal(s) for s in SIGNALS]
    stop = StopOnSignal(checkpoint=None)
    try:
        for s in SIGNALS:
            signal.signal(s, stop.record)
        stop.record(signal.SIGINT, None)
        stop.record(signal.SIGTERM, None)  # the first one is what is reported
        assert stop.signum == signal.SIGINT
        assert all(signal.getsignal(s) is stop_at_once for s in SIGNALS)
    finally:
        for s, handler in zip(SIGNALS, saved):
            signal.signal(s, handler)


def test_under_ddp_the_ranks_agree_on_the_host_whatever_device_the_model_is_on(tmp_path):
    """Agreeing must not read a tensor back from the model's device (on a GPU that waits for every kernel queued
    in the step): a trainer whose device is ``meta``, where nothing can be read back, still agrees."""
    saved = [signal.getsignal(s) for s in SIGNALS]
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        class Strategy:
            root_device = torch.device("meta")

        class Trainer:
            world_size, strategy = 2, Strategy()  # the one real rank stands for both

        stop = StopOnSignal(checkpoint=None)
        stop.on_train_start(Trainer(), None)
        assert stop._agreed(Trainer()) == 0
        stop.signum = signal.SIGTERM
        assert stop._agreed(Trainer()) == signal.SIGTERM
    finally:
        for s, handler in zip(SIGNALS, saved):
            signal.signal(s, handler)
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_a_second_ctrl_c_ends_the_process_at_once(micro, tmp_path):
    code = ("import os, signal, time\n"
            "import pytorch_lightning as pl\n"
            "from parnas.retrain.run import retrain\n"
            "class Twice(pl.Callback):\n"
            "    def on_train_batch_start(self, trainer, *args):\n"
            "        if trainer.global_step == 2:\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "            time.sleep(0.5)  # the first one's handler runs (Python runs handlers between bytecodes)\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "            time.sleep(0.5)\n"
            "            print('survived the second signal', flush=True)\n"
            f"retrain('transformer-xl', 'tiny', ['data.path={micro}', 'data.tokenizer=char', "
            f"'model.cutoffs=[20, 40]', 'train.max_steps=50', 'train.out_dir={tmp_path / 'run'}'],\n"
            "        callbacks=[Twice()])\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == -signal.SIGINT, run.stdout + run.stderr[-2000:]
    assert "survived" not in run.stdout


def test_the_resume_command_is_the_users_own_plus_resume():
    argv = ["retrain", "--arch", "my arch.json", "--set", "model.cutoffs=[20, 40]"]
    assert resume_command(argv, True) == "parnas retrain --arch 'my arch.json' --set 'model.cutoffs=[20, 40]' --resume"
    assert resume_command([*argv, "--resume"], True).count("--resume") == 1
    for given in (["--resume=old.ckpt"], ["--resume", "old.ckpt"]):  # began from another checkpoint: now last.ckpt
        assert resume_command([*argv, *given], True) == resume_command(argv, True)
    assert resume_command(["study", "--out", "s"], False) == "parnas study --out s"  # a rerun resumes a study
    # inside an nnictl trial: what the trial got from NNI, and its directory
    assert resume_command(["search"], True, ["search.tau_end=0.2", "search.out_dir=/t/x"]) == \
        "parnas search --set search.tau_end=0.2 --set search.out_dir=/t/x --resume"


# --- a real process, a real signal ---------------------------------------------------------------------------

def interrupt(args: list[str], signum: int, env: dict[str, str], after: str = "step 5/") -> tuple[int, str, str]:
    """Start ``python -m parnas.cli ARGS``, send ``signum`` once it prints ``after``; (status, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "parnas.cli", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out = []
        for line in proc.stdout:
            out.append(line)
            if line.startswith(after):
                proc.send_signal(signum)
                break
        rest, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return proc.returncode, "".join(out) + rest, err


def check_the_line(err: str, command: str, args: list[str], signum: int, run_dir: Path) -> int:
    """The one line on stderr: the signal, the step, the checkpoint, and argv + --resume; returns the step."""
    (line,) = err.strip().splitlines()
    name = signal.Signals(signum).name
    assert line.startswith(f"parnas {command}: stopped by {name} after step "), line
    step = int(line.split(" after step ")[1].split(",")[0])
    last = run_dir / "checkpoints" / "last.ckpt"
    assert f"saved in {last}" in line and ckpt.load(last)["global_step"] == step >= 5
    again = shlex.split(line.split("resume with: ")[1])
    assert again == [sys.executable, "-m", "parnas.cli", *args, "--resume"]
    return step


def resume_and_run_straight(args: list[str], out_key: str, step: int, tmp_path: Path, env: dict[str, str]) -> Path:
    """Run the printed resume command (argv + --resume) to ``step + 3``, and the same run straight through to
    ``step + 3`` in this process, in ``tmp_path / "straight"``; ``args`` ends with ``--set <out_key>=<run dir>``."""
    stop = sets(f"train.stop_at={step + 3}")
    again = subprocess.run([sys.executable, "-m", "parnas.cli", *args, "--resume", *stop], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    straight = tmp_path / "straight"
    assert args[-2:] == ["--set", f"{out_key}={tmp_path / 'run'}"]
    assert main([*args[:-2], *sets(f"{out_key}={straight}"), *stop]) == 0
    return straight


@pytest.fixture
def env():
    """This worktree's parnas, this session's cache, and one thread, as in this process (conftest): the
    uninterrupted run, trained here, must sum in the same order to compare bit for bit."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "PARNAS_CACHE_DIR": os.environ["PARNAS_CACHE_DIR"],
            "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_ctrl_c_to_a_retrain_process_saves_and_its_resume_command_continues_exactly(micro, tmp_path, env):
    run = tmp_path / "run"
    args = ["retrain", "--arch", "transformer-xl", "--config", "tiny",
            *micro_sets(micro, "train.max_steps=3000", "train.log_every=1", "train.eval_every=4",
                        f"train.out_dir={run}")]
    code, out, err = interrupt(args, signal.SIGINT, env)
    assert code == 130, err[-2000:]
    step = check_the_line(err, "retrain", args, signal.SIGINT, run)
    assert not (run / "metrics.json").exists()
    straight = resume_and_run_straight(args, "train.out_dir", step, tmp_path, env)
    same_weights(straight / "checkpoints" / "last.ckpt", run / "checkpoints" / "last.ckpt")
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (straight, run))
    assert (a["val_ppl"], a["test_ppl"], a["history"]) == (b["val_ppl"], b["test_ppl"], b["history"])


@pytest.mark.slow
def test_sigterm_to_a_search_process_saves_exports_nothing_and_resumes_exactly(micro, tmp_path, env):
    """What nnictl does to a trial it stops."""
    run = tmp_path / "run"
    args = ["search", "--config", "tiny",
            *micro_sets(micro, "train.max_steps=3000", "train.log_every=1", "train.eval_every=4",
                        "search.log_every=2", "search.penalty_cost=flops", f"search.out_dir={run}")]
    code, out, err = interrupt(args, signal.SIGTERM, env)
    assert code == 143, err[-2000:]
    step = check_the_line(err, "search", args, signal.SIGTERM, run)
    assert not (run / "architecture.json").exists() and not (run / "probabilities.png").exists()
    straight = resume_and_run_straight(args, "search.out_dir", step, tmp_path, env)
    same_weights(straight / "checkpoints" / "last.ckpt", run / "checkpoints" / "last.ckpt")  # logits included
    assert (run / "history.jsonl").read_text() == (straight / "history.jsonl").read_text()
    a, b = (json.loads((d / "architecture.json").read_text()) for d in (straight, run))
    assert (a["architecture"], a["probabilities"], a["search"]["val_ppl"]) == \
        (b["architecture"], b["probabilities"], b["search"]["val_ppl"])


@pytest.mark.slow
def test_under_ddp_a_signal_to_rank_0_alone_stops_both_ranks_at_the_same_step(micro, tmp_path, env):
    """The ranks agree before any of them saves (saving is collective), the other rank says nothing, and the
    resumed two-process run is the uninterrupted one."""
    run = tmp_path / "run"
    args = ["retrain", "--arch", "transformer-xl", "--config", "tiny",
            *micro_sets(micro, "data.batch_size=8", "train.devices=2", "train.accelerator=cpu",
                        "train.max_steps=3000", "train.log_every=1", "train.eval_every=4", f"train.out_dir={run}")]
    proc = subprocess.Popen([sys.executable, "-m", "parnas.cli", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("step 5/"):
                proc.send_signal(signal.SIGTERM)  # rank 0 only: rank 1 is its child, not signalled
                break
        out, err = proc.communicate(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # rank 1 too, should anything hang
        except ProcessLookupError:  # all gone already
            pass
    assert proc.returncode == 143, err[-3000:]
    (line,) = [line for line in err.splitlines() if "stopped by" in line]
    step = int(line.split(" after step ")[1].split(",")[0])
    assert ckpt.load(run / "checkpoints" / "last.ckpt")["global_step"] == step
    stop = sets(f"train.stop_at={step + 2}")
    for out_dir, extra in ((run, ["--resume"]), (tmp_path / "straight", [])):
        done = subprocess.run([sys.executable, "-m", "parnas.cli", *args[:-2], *sets(f"train.out_dir={out_dir}"),
                               *extra, *stop], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    same_weights(tmp_path / "straight" / "checkpoints" / "last.ckpt", run / "checkpoints" / "last.ckpt")


# --- every stage: a real signal, sent by the process to itself where a hook puts it ---------------------------

# ``python -c`` with one function wrapped so that the process signals itself on entering it, then ``parnas``.
AT_STAGE = '''
import os, signal, sys
import {module} as where
from parnas.cli import main

owner = {owner}
real = getattr(owner, "{name}")
def hooked(*args, **kwargs):
    if not getattr(hooked, "sent", False):
        hooked.sent = True
        os.kill(os.getpid(), signal.{signal})
    return real(*args, **kwargs)
setattr(owner, "{name}", hooked)
sys.exit(main(sys.argv[1:]))
'''
STAGES = {  # where: (module, the object that owns the function, its name)
    "loading the data": ("parnas.retrain.run", "where", "load_splits"),
    "setting up the trainer": ("parnas.training.task", "where.LanguageModelTask", "configure_optimizers"),
    "validation": ("parnas.training.task", "where.LanguageModelTask", "validation_step"),
    "the final evaluation": ("parnas.training.fit", "where", "final_metrics"),
    "the export": ("parnas.strategies.search", "where", "final_evaluation"),
}


def signalled_at(stage: str, signum: int, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    module, owner, name = STAGES[stage]
    code = AT_STAGE.format(module=module, owner=owner, name=name, signal=signal.Signals(signum).name)
    # -W ignore: the hook imports NNI before parnas.cli quiets its warnings about torch
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def retrain_args(corpus: Path, run: Path, *extra: str) -> list[str]:
    return ["retrain", "--arch", "transformer-xl", "--config", "tiny",
            *micro_sets(corpus, "train.max_steps=8", "train.eval_every=4", "train.log_every=1", *extra,
                        f"train.out_dir={run}")]


@pytest.mark.slow
@pytest.mark.parametrize("stage, signum", [("loading the data", signal.SIGTERM),
                                           ("setting up the trainer", signal.SIGINT),
                                           ("setting up the trainer", signal.SIGTERM)])
def test_a_signal_before_the_first_step_says_nothing_was_saved_and_how_to_start_again(micro, tmp_path, env, stage,
                                                                                       signum):
    """Not Lightning's exit status 1 for Ctrl-C, nor a silent death for SIGTERM: one line, 130 / 143."""
    args = retrain_args(micro, tmp_path / "run")
    done = signalled_at(stage, signum, args, env)
    assert done.returncode == 128 + signum, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"parnas retrain: stopped by {signal.Signals(signum).name} before the first step"), line
    assert shlex.split(line.split("run it again: ")[1]) == ["parnas", *args]  # main(argv) is called by the hook
    assert not (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()


@pytest.mark.slow
def test_a_signal_during_a_validation_stops_it_and_the_resumed_run_validates_again(micro, tmp_path, env):
    """Not waited for: a validation can outlast the grace before SIGKILL (NNI's is 5 s). The resumed run runs
    that validation again, whole, and ends as the uninterrupted run does."""
    run, whole = tmp_path / "run", tmp_path / "whole"
    done = signalled_at("validation", signal.SIGTERM, retrain_args(micro, run), env)
    assert done.returncode == 143, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert "stopped by SIGTERM after step 4, saved in" in line and line.endswith("--resume"), line
    assert "step 4: validation perplexity" not in done.stdout  # the validation was cut, not finished
    saved = ckpt.load(run / "checkpoints" / "last.ckpt")
    assert saved["global_step"] == 4 and not (run / "metrics.json").exists()
    for args in (retrain_args(micro, run) + ["--resume"], retrain_args(micro, whole)):
        again = subprocess.run([sys.executable, "-m", "parnas.cli", *args], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-3000:]
    resumed, uninterrupted = (json.loads((r / "metrics.json").read_text()) for r in (run, whole))
    assert [h["step"] for h in resumed["history"]] == [4, 8]
    assert resumed["history"] == uninterrupted["history"] and resumed["val_ppl"] == uninterrupted["val_ppl"]
    same_weights(whole / "checkpoints" / "last.ckpt", run / "checkpoints" / "last.ckpt")


def finishes_on_resume(line: str, stage: str, run: Path, env: dict[str, str]) -> None:
    """The line names ``stage`` and the checkpoint of the last step, and its command (``--resume``) finishes."""
    assert f"stopped by SIGTERM during {stage}, after training to step 8 (saved in {run / 'checkpoints'}" in line
    again = shlex.split(line.split("--resume finishes it: ")[1])
    assert again[0] == "parnas" and again[-1] == "--resume"  # main(argv) is called by the hook
    done = subprocess.run([sys.executable, "-m", "parnas.cli", *again[1:]], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_sigterm_during_the_final_evaluation_says_resume_finishes_it_and_it_does(micro, tmp_path, env):
    run, straight = tmp_path / "run", tmp_path / "straight"
    done = signalled_at("the final evaluation", signal.SIGTERM, retrain_args(micro, run), env)
    assert done.returncode == 143, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert not (run / "metrics.json").exists()
    finishes_on_resume(line, "the final evaluation", run, env)
    assert main(retrain_args(micro, straight)) == 0
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (straight, run))
    assert (a["val_ppl"], a["test_ppl"], a["history"]) == (b["val_ppl"], b["test_ppl"], b["history"])


@pytest.mark.slow
def test_sigterm_while_a_search_exports_says_resume_finishes_it_and_it_does(micro, tmp_path, env):
    run, straight = tmp_path / "run", tmp_path / "straight"
    args = ["search", "--config", "tiny", *micro_sets(micro, "train.max_steps=8", "train.eval_every=100",
                                                      "search.penalty_cost=flops")]
    done = signalled_at("the export", signal.SIGTERM, [*args, *sets(f"search.out_dir={run}")], env)
    assert done.returncode == 143, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert not (run / "architecture.json").exists()
    finishes_on_resume(line, "the export", run, env)
    assert main([*args, *sets(f"search.out_dir={straight}")]) == 0
    a, b = (json.loads((d / "architecture.json").read_text()) for d in (straight, run))
    assert (a["architecture"], a["probabilities"], a["search"]["val_ppl"], a["search"]["tau_final"]) == \
        (b["architecture"], b["probabilities"], b["search"]["val_ppl"], b["search"]["tau_final"])
    assert (run / "history.jsonl").read_text() == (straight / "history.jsonl").read_text()  # the same tau too


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_a_finished_command_exits_keeps_its_exit_status(env, signum):
    """Lightning's, TensorBoard's and NNI's threads end as the interpreter shuts down: a signal then (here from an
    atexit hook) must not turn a finished run into a silent death by the signal."""
    code = ("import atexit, os, signal, parnas.cli as cli\n"
            "cli.main = lambda: 0  # a command that has finished\n"
            f"atexit.register(lambda: os.kill(os.getpid(), signal.{signal.Signals(signum).name}))\n"
            "cli.run()\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and not done.stderr, (done.returncode, done.stderr[-2000:])
