"""``parnas launch --wait`` (what ``make search`` runs): a newcomer sees trial k of n, the step and the time left
in the terminal, and an end, without opening the web UI."""

import json
from pathlib import Path

from parnas.report.follow import Follower, experiment_size, follow, last_step

REPO = Path(__file__).resolve().parents[2]


def trial(root: Path, experiment: str, trial_id: str, steps: list[int], finished: bool = False) -> Path:
    run = root / experiment / "environments" / "local-env" / "trials" / trial_id
    run.mkdir(parents=True, exist_ok=True)
    (run / "history.jsonl").write_text("".join(json.dumps({"step": s, "tau": 1.0}) + "\n" for s in steps))
    if finished:
        (run / "architecture.json").write_text("{}")
    return run


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_last_step_is_read_from_the_last_whole_line(tmp_path):
    run = trial(tmp_path, "e", "T1", [1, 2, 3])
    with open(run / "history.jsonl", "a") as f:
        f.write('{"step": 4, "ta')  # being written
    assert last_step(run) == 3
    assert last_step(tmp_path / "nowhere") is None


def test_progress_says_trial_k_of_n_its_step_and_the_time_left(tmp_path):
    clock, status = Clock(), {"now": "RUNNING"}
    follower = Follower("exp", 8080, n_trials=2, max_steps=100, root=tmp_path, clock=clock,
                        status=lambda port: status["now"])
    assert follower.poll() == [] and not follower.done  # nothing started yet
    trial(tmp_path, "exp", "A", [0])
    lines = follower.poll()
    assert lines[0] == "trial 1 of 2 (A) started" and "trial 1 of 2 at step 0 of 100" in lines[1]
    assert "left" not in lines[1]  # no step seen run yet: no estimate
    clock.now = 50.0
    trial(tmp_path, "exp", "A", list(range(51)))
    (line,) = follower.poll()
    assert line.startswith("trial 1 of 2 at step 50 of 100; 0 ended; about ")
    clock.now = 51.0
    assert follower.poll() == []  # a line at most every PRINT_EVERY_S while nothing starts or ends


def test_the_time_left_counts_the_trials_not_started(tmp_path):
    clock = Clock()
    follower = Follower("exp", 8080, n_trials=2, max_steps=100, root=tmp_path, clock=clock, status=lambda p: "RUNNING")
    trial(tmp_path, "exp", "A", [0])
    follower.poll()
    clock.now = 100.0
    trial(tmp_path, "exp", "A", list(range(51)))  # 50 steps in 100 s: 2 s a step
    (line,) = follower.poll()
    # 50 steps left of trial 1, 100 of trial 2: 300 s
    assert line == "trial 1 of 2 at step 50 of 100; 0 ended; about 5 min left"


def test_it_ends_when_nni_says_done_or_the_manager_has_gone(tmp_path):
    status = {"now": "RUNNING"}
    follower = Follower("exp", 8080, n_trials=1, max_steps=10, root=tmp_path, status=lambda p: status["now"])
    trial(tmp_path, "exp", "A", list(range(11)), finished=True)
    assert follower.poll() == ["trial 1 of 1 (A) finished at step 10"] and not follower.done
    status["now"] = "DONE"
    printed = []
    follow(follower, out=printed.append, sleep=lambda s: None)
    assert follower.done and printed == []  # the end was announced once


def test_search_yaml_is_read_for_its_size():
    from parnas.config import load_config
    from parnas.report.follow import pick_retrain_steps

    trials, steps, preset, root, pick = experiment_size(REPO / "search.yaml")
    assert (trials, steps, preset, root) == (3, 600, "wt2-cpu", None)
    assert pick == pick_retrain_steps(load_config("wt2-cpu").search.settings.select,
                                      steps) > 0  # the time left counts it


def test_a_config_it_cannot_read_leaves_the_size_unknown(tmp_path):
    (tmp_path / "e.yaml").write_text("trialCommand: python train.py\nmaxTrialNumber: 3\n")
    assert experiment_size(tmp_path / "e.yaml") == (3, None, None, None, 0)
    assert experiment_size(tmp_path / "missing.yaml") == (None, None, None, None, 0)
