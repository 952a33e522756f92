"""Past one machine: DDP across nodes (``train.num_nodes``) and NNI's remote training service.

The two "nodes" are two gloo processes on localhost, started the way torchrun or SLURM
start them on two machines: each on its own, told its node rank, the world size and
where rank 0 listens. Both run under one hard deadline that kills their process
groups, so a hung rendezvous cannot hang the suite.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from nni.experiment.config import ExperimentConfig
from test_ddp import SCRIPT, run_script

from parnas.config import load_config
from parnas.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(script, out, corpus, cache, nodes=2, timeout=300):
    """One process per node, as a launcher on each machine would start it; their logs go to files,
    so neither can block on a full pipe while the other waits for it in a collective."""
    out.mkdir()
    port, procs = free_port(), []
    for node in range(nodes):
        env = {**os.environ, "PARNAS_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "NODE_RANK": str(node), "WORLD_SIZE": str(nodes), "LOCAL_RANK": "0"}
        with open(out / f"node{node}.log", "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, str(script), str(out), str(corpus), "1", "none", f"train.num_nodes={nodes}"],
                cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        pytest.fail(f"{nodes} nodes did not finish in {timeout}s")
    for node, proc in enumerate(procs):
        assert proc.returncode == 0, (out / f"node{node}.log").read_text()[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nodes)]


@pytest.mark.slow
def test_two_nodes_of_one_process_train_like_one_process(wt2_slice, tmp_path, tmp_path_factory):
    script = tmp_path / "train_node.py"
    script.write_text(SCRIPT)  # test_ddp's training script: its arguments, then further --set pairs
    cache = tmp_path_factory.getbasetemp() / "parnas-cache"
    (one,) = run_script(script, tmp_path / "one", wt2_slice, 1, cache)  # also fills the tokenizer cache
    nodes = run_nodes(script, tmp_path / "nodes", wt2_slice, cache)

    assert [r["world"] for r in nodes] == [2, 2] and [r["rank"] for r in nodes] == [0, 1]
    # node r owns streams [4r, 4r+4) of the 8: together the single process's batch
    assert nodes[0]["first"] == one["first"][:4] and nodes[1]["first"] == one["first"][4:]
    # same global batch: the mean of the nodes' losses follows the single process step by step
    mean = torch.tensor([(a + b) / 2 for a, b in zip(nodes[0]["losses"], nodes[1]["losses"])])
    assert len(one["losses"]) == 16
    torch.testing.assert_close(mean, torch.tensor(one["losses"]), rtol=1e-4, atol=1e-4)
    metrics = json.loads((tmp_path / "nodes/metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["config"]["train"]["num_nodes"] == 2


def test_num_nodes_must_be_positive():
    assert load_config("tiny", ["train.num_nodes=2"]).train.num_nodes == 2
    with pytest.raises(ConfigError, match="train.num_nodes must be > 0"):
        load_config("tiny", ["train.num_nodes=0"])


def test_remote_experiment_runs_search_yamls_trials_and_passes_nnis_validation(tmp_path):
    remote, local = (ExperimentConfig.load(ROOT / name) for name in ("search-remote.yaml", "search.yaml"))
    assert (remote.trial_command, remote.search_space, remote.tuner) == (local.trial_command, local.search_space,
                                                                         local.tuner)
    service = remote.training_service
    assert service.platform == "remote" and len(service.machine_list) == 2
    assert all("<" in m.host and "<" in m.user for m in service.machine_list)  # placeholders to fill in
    with pytest.raises(ValueError, match="SSH key"):  # as shipped it names no real key
        remote.validate()
    key = tmp_path / "id_ed25519"
    key.write_text("")
    for machine in service.machine_list:  # what a user does: name a key that exists
        machine.ssh_key_file = str(key)
    remote.validate()
    assert remote.json()["trainingService"]["machineList"][0]["pythonPath"].endswith("/.venv/bin")
