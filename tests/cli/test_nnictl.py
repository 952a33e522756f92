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
from parnas.report.experiments import FINISHED, experiment_trials

REPO = Path(__file__).resolve().parents[2]
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
def test_nnictl_create_runs_trials_that_report_and_leave_architectures(tmp_path, shrunk_search_yaml, capsys):
    config_path = shrunk_search_yaml(2)  # FLOPs priced, no latency timing: wiring only
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
        trials = experiment_trials(experiment, tmp_path / "experiments").values()
        runs = {t.id: t.run_dir for t in trials if t.status == FINISHED}
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


def non_loopback_address() -> str | None:
    """An IPv4 address of this machine that another machine could connect to, if it has one."""
    import psutil

    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


PROBE = {"experimentName": "parnas-loopback-probe", "trialConcurrency": 1, "maxTrialNumber": 1,
         "trialCommand": "python -c \"import nni; nni.get_next_parameter(); nni.report_final_result(1.0)\"",
         "searchSpace": {"x": {"_type": "choice", "_value": [1, 2]}}, "tuner": {"name": "Random"},
         "trainingService": {"platform": "local"}}


@pytest.mark.slow
@pytest.mark.parametrize("listen_all", [False, True])
def test_launch_serves_the_web_ui_on_loopback_unless_asked(tmp_path, capsys, listen_all):
    """From another address the port is refused; on 127.0.0.1 the web UI answers and a trial runs and reports
    (NNI's tuner and trials reach the manager through loopback). --listen-all opens it, saying so."""
    import errno

    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    config = tmp_path / "probe.yaml"
    config.write_text(yaml.safe_dump({**PROBE, "trialCodeDirectory": str(tmp_path),
                                      "experimentWorkingDirectory": str(tmp_path / "experiments")}))
    port = free_port()
    code = main(["launch", "--config", str(config), "--port", str(port), *(["--listen-all"] * listen_all)])
    out, err = capsys.readouterr()
    assert code == 0, err
    experiment = re.search(r"experiment (\w+): web UI http://127\.0\.0\.1:(\d+)", out)[1]
    try:
        deadline = time.time() + 120
        while time.time() < deadline and [j["status"] for j in trial_jobs(port)] != ["SUCCEEDED"]:
            time.sleep(2)
        assert [j["status"] for j in trial_jobs(port)] == ["SUCCEEDED"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as page:
            assert b"<html" in page.read().lower()
        with socket.socket() as s:
            s.settimeout(10)
            outside = s.connect_ex((address, port))
        if listen_all:
            assert outside == 0 and f"anyone who reaches port {port}" in err and len(err.splitlines()) == 1, err
        else:
            assert outside == errno.ECONNREFUSED, f"{address}:{port} answered ({os.strerror(outside)})"
            assert err == ""
    finally:
        nnictl("stop", experiment)


def test_launch_refuses_trials_on_other_machines_without_listen_all(tmp_path, capsys):
    """Remote workers report to the manager's port over the network: loopback would cut them off."""
    config = tmp_path / "remote.yaml"
    config.write_text(yaml.safe_dump({**PROBE, "trainingService": {"platform": "remote", "machineList": []}}))
    assert main(["launch", "--config", str(config), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "(remote)" in err and "--listen-all" in err, err


def test_the_preload_keeps_the_users_node_options():
    from parnas.report.experiments import LOOPBACK_JS, loopback_env

    env = loopback_env({"NODE_OPTIONS": "--max-old-space-size=512", "PATH": "/bin"})
    assert env["NODE_OPTIONS"] == f'--max-old-space-size=512 --require "{LOOPBACK_JS}"' and env["PATH"] == "/bin"
    assert LOOPBACK_JS.is_file()


@pytest.mark.slow
def test_launch_wait_shows_the_trials_progress_and_ends_with_the_export_table(tmp_path, shrunk_search_yaml, capsys):
    """What `make search` runs: trial k of n with its step while the trials run, then the end, the export table
    and the next command, without the web UI."""
    config_path = shrunk_search_yaml(1)
    port = free_port()
    code = main(["launch", "--config", str(config_path), "--port", str(port), "--wait"])
    out, err = capsys.readouterr()
    experiment = re.search(r"experiment (\w+): web UI", out)[1]
    try:
        assert code == 0, out + err
        assert "following it here until it is done (1 trial;" in out
        assert re.search(r"trial 1 of 1 \(\w+\) finished at step 20", out), out
        assert "architecture" in out and f"summary of experiment {experiment}" in out
        assert f"  parnas export --experiment {experiment} --out found/" in out
    finally:
        nnictl("stop", experiment)


@pytest.mark.slow
def test_a_launch_that_loses_its_port_to_another_leaves_nothing_and_says_so_in_one_line(tmp_path, capsys,
                                                                                        monkeypatch):
    """Two launches racing for one port both find it free; the loser is one line, exit 2, with no experiment
    folder left, no entry in nnictl's list and no address printed for a manager that died."""
    import http.server
    import threading

    from parnas.report import experiments

    class Other(http.server.BaseHTTPRequestHandler):  # the winner's manager, answering for its own experiment
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps({"id": "winner00"}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Other)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(experiments, "port_in_use", lambda port: False)  # as the racing launch found it
    config = tmp_path / "probe.yaml"
    config.write_text(yaml.safe_dump({**PROBE, "trialCodeDirectory": str(tmp_path),
                                      "experimentWorkingDirectory": str(tmp_path / "experiments")}))
    before = set(json.loads((Path.home() / "nni-experiments" / ".experiment").read_text())) if (
        Path.home() / "nni-experiments" / ".experiment").is_file() else set()
    try:
        code = main(["launch", "--config", str(config), "--port", str(port)])
    finally:
        server.shutdown()
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (out, err)
    assert f"port {port}" in err and "Traceback" not in err
    left = sorted(p.name for p in (tmp_path / "experiments").glob("*")) if (tmp_path / "experiments").is_dir() else []
    assert left == [], (err, left)
    after = set(json.loads((Path.home() / "nni-experiments" / ".experiment").read_text())) if (
        Path.home() / "nni-experiments" / ".experiment").is_file() else set()
    assert after <= before


def test_nnictl_says_what_it_does_without_a_deprecation_warning_first():
    """Every nnictl command a user runs (``nnictl stop`` after ``parnas launch``) imports pkg_resources; the
    setuptools pyproject.toml allows keeps that import quiet (from 80.9 it is a UserWarning on every command).
    A failure here means the environment is older than pyproject.toml: ``make install`` brings it in line."""
    done = subprocess.run([str(Path(sys.executable).parent / "nnictl"), "--version"], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"})
    assert done.returncode == 0 and done.stdout.strip() == "3.0"
    assert "Warning" not in done.stderr, done.stderr


def test_a_failed_launch_removes_only_its_own_experiment_folder(tmp_path, capsys, monkeypatch):
    """Folders that appear beside the launch (another experiment, a user's files) are kept; the launch's own
    folder, named by the id the launch gave nnictl (nnictl may fail before printing it), goes, and so does the
    ``_latest`` link to it."""
    from parnas.report import experiments

    root = tmp_path / "experiments"
    config = tmp_path / "probe.yaml"
    config.write_text(yaml.safe_dump({**PROBE, "trialCodeDirectory": str(tmp_path),
                                      "experimentWorkingDirectory": str(root)}))

    def failed_create(args, **kwargs):  # nnictl create that makes its experiment's folder, then fails unnamed
        own = args[args.index(experiments.CREATE_WITH_ID) + 1]
        for name in ("other_run", f"{own}/log", "shared/new_run_1"):
            (root / name).mkdir(parents=True)
        (root / "_latest").symlink_to(own)
        return subprocess.CompletedProcess(args, 1, "", "ERROR: the manager died\n")

    monkeypatch.setattr(experiments.subprocess, "run", failed_create)
    monkeypatch.setattr(experiments, "port_in_use", lambda port: False)
    monkeypatch.setattr("nni.tools.nnictl.config_utils.Experiments.remove_experiment", lambda self, i: None)
    code = main(["launch", "--config", str(config), "--port", str(free_port())])
    out, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "nnictl create failed" in err, err
    assert sorted(p.name for p in root.iterdir()) == ["other_run", "shared"]
    assert (root / "shared" / "new_run_1").is_dir()
