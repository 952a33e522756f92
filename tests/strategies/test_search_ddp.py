"""The search under DDP (2 gloo processes on the CPU) chooses one architecture: every rank holds the same
logits at every step and exports the same JSON (NNI's own DARTS lets ranks drift: microsoft/nni #5013), its
supernet eager or compiled (``train.compile``: a search in several processes steps mixed, one static graph)."""

import json
import os
import signal
import subprocess
import sys

import pytest

SCRIPT = '''
import json, sys, warnings
warnings.filterwarnings("ignore")
import numpy as np
import pytorch_lightning as pl
from parnas.config import load_config
from parnas.strategies.costs import CostModel
from parnas.strategies.search import build_search

out, compile_mode = sys.argv[1:3]


class Recorder(pl.Callback):
    def __init__(self):
        self.alphas = []

    def on_train_batch_end(self, trainer, module, *args):
        self.alphas.append([m._arch_alpha.tolist() for m in module.choices()])

    def on_train_end(self, trainer, module):
        with open(f"{out}/rank{trainer.global_rank}.json", "w") as f:
            json.dump({"world": trainer.world_size, "alphas": self.alphas, "export": module.exported_kinds()[0],
                       "lambda": module.dual}, f)


def stream(n, seed):
    r = np.random.default_rng(seed).integers(0, 32, size=(n, 4))
    return np.concatenate([r, r], axis=1).reshape(-1).astype(np.int32)


cfg = load_config("tiny", ["model.n_blocks=3", "model.cutoffs=[]", "model.mem_len=8", "model.dropout=0.1",
                           "data.batch_size=8", "data.seg_len=16", "data.eval_batch_size=4", "train.max_steps=12",
                           "train.eval_every=6", "train.lr=1e-2", "search.arch_lr=0.05", "train.accelerator=cpu",
                           "train.devices=2", "search.par-gumbel-darts.latency_budget=0.5",
                           f"train.compile={compile_mode}"])
splits = {"train": stream(400, 0), "valid": stream(40, 1), "test": stream(40, 2)}
# known costs: a budget of 0.5 means the same on every machine (a timed table's ratios are the device's)
costs = CostModel({"attention": 3.0, "dense": 1.0, "identity": 0.0}, 1.0, "ms/step", 3)
search = build_search(cfg, splits, 32, __import__("pathlib").Path(out), costs=costs)
recorder = Recorder()
search.trainer.callbacks.append(recorder)
search.run()
'''


@pytest.mark.parametrize("compile_mode", ["none", "default"])
@pytest.mark.slow
def test_ranks_hold_identical_logits_at_every_step_and_export_the_same(tmp_path, tmp_path_factory, compile_mode):
    script = tmp_path / "search_ddp.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PARNAS_CACHE_DIR": str(tmp_path_factory.getbasetemp() / "parnas-cache"),
           "PYTHONPATH": os.pathsep.join([str(script.parents[0]), *sys.path])}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), compile_mode], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the 2-process search did not finish in 300 s")
    assert proc.returncode == 0, log[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert len(ranks[0]["alphas"]) == 12
    assert ranks[0]["alphas"] == ranks[1]["alphas"]  # bit-identical, step by step
    assert ranks[0]["alphas"][0] != ranks[0]["alphas"][-1]  # and they did move
    assert ranks[0]["export"] == ranks[1]["export"] and ranks[0]["lambda"] == ranks[1]["lambda"]
