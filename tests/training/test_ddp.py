"""DDP on the CPU: two gloo processes split the streams and train like one process with the same global batch.

Both runs go through ``retrain`` in a subprocess (Lightning's DDP launcher re-runs
the script for rank 1), each under a hard timeout that kills its whole process
group, so a hung collective cannot hang the suite.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

SCRIPT = '''
import json, sys, warnings
warnings.filterwarnings("ignore")
import pytorch_lightning as pl
from parnas.retrain.run import retrain


class Recorder(pl.Callback):
    """Each rank writes its first batch and its loss at every step."""

    def __init__(self, out):
        self.out, self.first, self.losses = out, None, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.first is None:
            self.first = batch[0].tolist()
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    def on_train_end(self, trainer, module):
        from torch._dynamo.utils import counters

        record = {"rank": trainer.global_rank, "world": trainer.world_size, "first": self.first,
                  "losses": self.losses, "graphs": counters["stats"]["unique_graphs"]}
        with open(f"{self.out}/rank{trainer.global_rank}.json", "w") as f:
            json.dump(record, f)


out, corpus, devices, compile_mode, *settings = sys.argv[1:]  # settings: further --set pairs
retrain("transformer-xl", "tiny", [f"data.path={corpus}", "data.vocab_size=300", "model.cutoffs=[100, 200]",
                                   "data.batch_size=8", "train.max_steps=16", "train.eval_every=8",
                                   "train.ckpt_every=8", "train.accelerator=cpu", f"train.devices={devices}",
                                   f"train.compile={compile_mode}", f"train.out_dir={out}", *settings],
        callbacks=[Recorder(out)])
'''


def run_script(script, out, corpus, devices, cache, compile_mode="none", timeout=300):
    out.mkdir()
    env = {**os.environ, "PARNAS_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(script), str(out), str(corpus), str(devices), compile_mode], cwd=out,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # rank 1 too: it is in the same session
        proc.communicate()
        pytest.fail(f"training with {devices} process(es) did not finish in {timeout}s")
    assert proc.returncode == 0, log[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]


@pytest.mark.slow
@pytest.mark.parametrize("compile_mode", ["none", "default"])
def test_two_gloo_processes_split_streams_and_match_one_process(wt2_slice, tmp_path, tmp_path_factory, compile_mode):
    """Eager, and compiled (``train.compile=default``: each rank compiles its model, which DDP wraps)."""
    script = tmp_path / "train_ddp.py"
    script.write_text(SCRIPT)
    cache = tmp_path_factory.getbasetemp() / "parnas-cache"
    (one,) = run_script(script, tmp_path / "one", wt2_slice, 1, cache, compile_mode)
    ranks = run_script(script, tmp_path / "two", wt2_slice, 2, cache, compile_mode)

    assert [r["world"] for r in ranks] == [2, 2] and one["world"] == 1
    assert all((r["graphs"] > 0) == (compile_mode != "none") for r in [one, *ranks])  # compiled, each rank
    # each rank owns half of the 8 streams, disjoint, together the single process's batch
    assert ranks[0]["first"] == one["first"][:4] and ranks[1]["first"] == one["first"][4:]
    assert ranks[0]["first"] != ranks[1]["first"]

    # same global batch: the mean of the ranks' losses follows the single process step by step
    ddp = torch.tensor([(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])])
    torch.testing.assert_close(ddp, torch.tensor(one["losses"]), rtol=1e-4, atol=1e-4)
    assert len(one["losses"]) == 16

    m1 = json.loads((tmp_path / "one/metrics.json").read_text())
    m2 = json.loads((tmp_path / "two/metrics.json").read_text())
    assert m2["world_size"] == 2 and m2["val_ppl"] == pytest.approx(m1["val_ppl"], rel=1e-3)
    # the checkpoint holds the memory of all 8 streams, gathered from both ranks
    memory = torch.load(tmp_path / "two/checkpoints/last.ckpt", weights_only=True)["parnas"]["train_memory"]
    assert [tuple(m.shape) for m in memory if m is not None] == [(8, 16, 32)] * 2
