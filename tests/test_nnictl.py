"""nnictl end to end: search.yaml's experiment, shrunk to two tiny trials, on a free port."""

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from parnas import architecture
from parnas.cli import main
from parnas.report.experiments import trial_run_dirs

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nnictl(*args: str, env=None, timeout: float = 120) -> str:
    done = subprocess.run([str(BIN / "nnictl"), *args], capture_output=True, text=True, env=env, timeout=timeout)
    return done.stdout + done.stderr


def trial_jobs(port: int) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/nni/trial-jobs", timeout=10) as r:
        return json.load(r)


@pytest.mark.slow
def test_nnictl_create_runs_trials_that_report_and_leave_architectures(tmp_path, wt2_slice, capsys):
    config = yaml.safe_load((REPO / "search.yaml").read_text())
    config.update(
        trialCommand=(f"parnas search --config tiny --set data.path={wt2_slice} --set data.vocab_size=300 "
                      "--set 'model.cutoffs=[100, 200]' --set train.max_steps=20 --set train.eval_every=10 "
                      "--set search.log_every=5 --set search.penalty_cost=flops"),  # no latency timing: wiring only
        trialCodeDirectory=str(REPO), maxTrialNumber=2, trialConcurrency=1,
        experimentWorkingDirectory=str(tmp_path / "experiments"))
    config_path = tmp_path / "search.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1")  # a loaded machine
    port = free_port()
    out = nnictl("create", "--config", str(config_path), "--port", str(port), env=env)
    match = re.search(r"Experiment ID: (?:\x1b\[\d+m)?(\w+)", out)
    assert match, out
    experiment = match.group(1)
    try:
        deadline = time.time() + 900
        while time.time() < deadline:
            jobs = trial_jobs(port)
            if len(jobs) == 2 and all(j["status"] in ("SUCCEEDED", "FAILED", "USER_CANCELED") for j in jobs):
                break
            time.sleep(3)
        assert [j["status"] for j in jobs] == ["SUCCEEDED"] * 2, jobs
        for job in jobs:
            final = json.loads(json.loads(job["finalMetricData"][0]["data"]))
            assert final["default"] > 1.0 and "attention_blocks" in final
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/nni/metric-data", timeout=10) as r:
            intermediate = [json.loads(json.loads(m["data"])) for m in json.load(r) if m["type"] == "PERIODICAL"]
        assert len(intermediate) == 4  # two evaluations per trial, each with what the trial would export then
        # (a cost ratio of FLOPs here, 0 for all identity blocks; a latency ratio under the default penalty_cost)
        assert all(len(m["architecture"]) == 4 and m["latency_ratio"] >= 0 and m["default"] > 1.0 for m in intermediate)
        runs = trial_run_dirs(experiment, tmp_path / "experiments")
        assert sorted(runs) == sorted(j["trialJobId"] for j in jobs)
        for run_dir in runs.values():
            record = architecture.read(run_dir / "architecture.json")
            assert len(record["architecture"]) == 4 and record["search"]["steps"] == 20
            assert record["search"]["nni_trial"] == run_dir.name
            assert (run_dir / "history.jsonl").is_file()
        assert main(["export", "--experiment", experiment, "--experiments-dir", str(tmp_path / "experiments"),
                     "--out", str(tmp_path / "export")]) == 0
        rows = json.loads((tmp_path / "export" / "summary.json").read_text())
        assert [r["val_ppl"] for r in rows] == sorted(r["val_ppl"] for r in rows)
    finally:
        nnictl("stop", experiment, env=env)
