"""On a CUDA GPU: every command finishes (fp32 and bf16-mixed), a killed run resumes exactly, a checkpoint moves
between the GPU and the CPU, bf16-mixed trains as well as fp32, and a CUDA-graphed retrain ends where an eager one
does (host syncs and the compiled step: ``tests/gpu/test_gpu_compile.py``). ``make test-gpu`` runs every CUDA test
(``pytest -m gpu``); without CUDA they are collected and reported as skipped. Tiny shapes throughout: they
exercise the device paths, not its speed (benchmarks/gpu_step.py measures that)."""

import json
import math
import os
import statistics
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch

from parnas import architecture
from parnas.cli import main
from parnas.config import DataConfig, ModelConfig, load_config
from parnas.data.corpora import ContextBatches, load_splits
from parnas.nn.model import build_fixed_model
from parnas.training import checkpoint as ckpt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
# cuBLAS picks its workspace when CUDA starts (after collection): a fixed one makes its products repeatable,
# which the exact-resume tests need (with torch.use_deterministic_algorithms for the other kernels)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

SMALL = ["data.vocab_size=300", "model.cutoffs=[100, 200]"]


def sets(*pairs: str) -> list[str]:
    return [a for pair in pairs for a in ("--set", pair)]


def cli(*args) -> int:
    return main([str(a) for a in args])


def read(path: Path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.fixture
def deterministic():
    """Kernels that give the same bits every run (embedding and index_add backward without atomics...)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


# --- every command, on the GPU ----------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:.*Running trial code without runtime:RuntimeWarning")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_search_export_retrain_evaluate_generate_compare_on_cuda(wt2_slice, tmp_path, capsys, monkeypatch, precision):
    gpu = ["train.accelerator=gpu", "train.devices=1", f"train.precision={precision}"]
    common = ["--config", "tiny", *sets(f"data.path={wt2_slice}", *SMALL, *gpu, "train.eval_every=10",
                                        "train.ckpt_every=10", "search.log_every=5")]

    # a search stopped at step 10 of 20, then resumed: each part ends with Lightning's teardown
    run = tmp_path / "search"
    search = [*common, *sets(f"search.out_dir={run}", "train.max_steps=20")]
    assert cli("search", *search, *sets("train.stop_at=10")) == 0
    assert read(run / "architecture.json")["search"]["steps"] == 10
    assert cli("search", *search, "--resume") == 0
    record = read(run / "architecture.json")["search"]
    assert record["steps"] == 20 and math.isfinite(record["val_ppl"]) and math.isfinite(record["supernet_val_ppl"])
    assert record["latency"]["device"] == torch.cuda.get_device_name()  # its costs were timed on the GPU

    # the same search as an nnictl trial (its run directory from NNI), then `parnas export`
    trial = tmp_path / "experiments" / "gpuexp" / "trials" / "T1"
    trial.mkdir(parents=True)
    with monkeypatch.context() as nni:
        nni.setenv("NNI_PLATFORM", "unittest")  # NNI's stand-alone trial channel: no manager needed
        nni.setenv("NNI_OUTPUT_DIR", str(trial))
        nni.setenv("NNI_TRIAL_JOB_ID", "T1")
        assert cli("search", *common, *sets("train.max_steps=20")) == 0
    assert (trial / "architecture.json").is_file()
    found = tmp_path / "found"
    assert cli("export", "--experiment", "gpuexp", "--experiments-dir", tmp_path / "experiments", "--out", found) == 0

    # retrain the exported architecture, and train a fixed layout
    out = tmp_path / "retrain"
    assert cli("retrain", "--arch", found / "T1.json", *common, *sets(f"train.out_dir={out}",
                                                                       "train.max_steps=20")) == 0
    metrics = read(out / "metrics.json")
    assert metrics["device"].startswith("cuda") and metrics["peak_memory_kind"] == "cuda_max_allocated"
    assert metrics["precision"] == precision and metrics["steps"] == 20
    assert math.isfinite(metrics["val_ppl"]) and math.isfinite(metrics["test_ppl"])
    assert cli("train", *common, *sets(f"train.out_dir={tmp_path / 'train'}", "train.max_steps=10")) == 0
    assert read(tmp_path / "train" / "metrics.json")["device"].startswith("cuda")

    # evaluate and sample from the checkpoint on the GPU
    last = out / "checkpoints" / "last.ckpt"
    assert cli("evaluate", last, "--accelerator", "gpu", "--out", tmp_path / "eval.json") == 0
    evaluated = read(tmp_path / "eval.json")
    assert evaluated["device"].startswith("cuda") and evaluated["ppl"] == pytest.approx(metrics["val_ppl"], rel=1e-4)
    capsys.readouterr()
    sample = ["generate", last, "--accelerator", "gpu", "--tokens", "20", "--seed", "1", "--prompt", "The"]
    assert cli(*sample) == 0
    text = capsys.readouterr().out
    assert cli(*sample) == 0 and capsys.readouterr().out == text and text.startswith("The")

    assert cli("compare", out, tmp_path / "train", "--out", tmp_path / "table") == 0
    assert f"| {metrics['architecture']} |" in capsys.readouterr().out


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_study_on_cuda(wt2_slice, tmp_path, capsys, precision):
    out = tmp_path / "study"
    settings = sets(f"data.path={wt2_slice}", *SMALL, "train.accelerator=gpu", f"train.precision={precision}",
                    "train.eval_every=1000", "train.warmup_steps=3", "search.log_every=5")
    assert cli("study", "--config", "tiny", *settings, "--seeds", "1", "--budgets", "none", "--out", out,
               "--steps", "8", "--random-orderings", "1") == 0
    study = read(out / "study.json")
    assert study["timing"]["device"] == torch.cuda.get_device_name()
    for row in study["rows"]:
        metrics = read(out / "retrain" / row["layout"] / "metrics.json")
        assert metrics["device"].startswith("cuda") and math.isfinite(metrics["val_ppl"])


def test_cuda_bf16_retrain_and_evaluate(wt2_slice, tmp_path):
    out = tmp_path / "gpu"
    record = architecture.make_record(
        {architecture.label(i): k for i, k in enumerate(["attention", "attention", "dense", "identity"])},
        ModelConfig(n_blocks=4, d_model=32, n_heads=2, d_ff=64, mem_len=16, dropout=0.0, cutoffs=(100, 200)), 300,
        tokenizer={"kind": "sentencepiece", "vocab_size": 300})
    (tmp_path / "arch.json").write_text(json.dumps(record))
    assert cli("retrain", "--arch", tmp_path / "arch.json", "--accelerator", "gpu", "--devices", "1", "--precision",
               "bf16-mixed", "--config", "tiny", *sets(f"data.path={wt2_slice}", *SMALL, f"train.out_dir={out}",
                                                       "train.max_steps=20")) == 0
    metrics = read(out / "metrics.json")
    assert metrics["device"].startswith("cuda") and metrics["peak_memory_kind"] == "cuda_max_allocated"
    assert metrics["precision"] == "bf16-mixed" and metrics["val_ppl"] < 300
    assert cli("evaluate", out / "checkpoints/last.ckpt", "--accelerator", "gpu",
               "--out", tmp_path / "e.json") == 0
    assert read(tmp_path / "e.json")["ppl"] == pytest.approx(metrics["val_ppl"], rel=1e-3)


# --- kill and resume, and checkpoints between devices ---------------------------------------------------------

@pytest.mark.parametrize("compile_mode", ["none", "reduce-overhead"])
def test_a_killed_cuda_retrain_resumes_to_exactly_the_uninterrupted_run(micro_corpus, kill_at, tmp_path,
                                                                        deterministic, compile_mode):
    """As on the CPU: killed in the middle of a pass and at its very end, resumed, it ends with the same weights,
    memory, perplexities and history, bit for bit; eager, and replayed as CUDA graphs (whose dropout draws from
    the generator's state as it is restored)."""
    from parnas.retrain.run import retrain

    _, splits = load_splits(DataConfig(path=str(micro_corpus), tokenizer="char"))
    seg_len = next(L for L in range(40, 80) if len(ContextBatches(splits["train"], 8, L)) % 2 == 0)
    n = len(ContextBatches(splits["train"], 8, seg_len))  # steps per pass
    half, total = n // 2, n + n // 2 + 3
    common = [f"data.path={micro_corpus}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "data.batch_size=8",
              f"data.seg_len={seg_len}", "model.dropout=0.2", "model.dropatt=0.1", f"train.max_steps={total}",
              f"train.eval_every={half}", f"train.ckpt_every={half}", "train.warmup_steps=5",
              "train.accelerator=gpu", f"train.compile={compile_mode}"]
    whole = retrain("transformer-xl", "tiny", [*common, f"train.out_dir={tmp_path / 'whole'}"])
    split = [*common, f"train.out_dir={tmp_path / 'split'}"]
    for kill in (half, n):
        with pytest.raises(RuntimeError, match="killed"):
            retrain("transformer-xl", "tiny", split, resume=kill != half, callbacks=[kill_at(kill + 1)])
        assert ckpt.load(tmp_path / "split/checkpoints/last.ckpt")["global_step"] == kill
    resumed = retrain("transformer-xl", "tiny", split, resume=True)
    a, b = (ckpt.load(tmp_path / f"{run}/checkpoints/last.ckpt") for run in ("whole", "split"))
    assert a["global_step"] == b["global_step"] == total and resumed["device"].startswith("cuda")
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
    for mine, theirs in zip(a["parnas"]["train_memory"], b["parnas"]["train_memory"]):
        assert (mine is None and theirs is None) or torch.equal(mine, theirs)
    assert resumed["val_ppl"] == whole["val_ppl"] and resumed["history"] == whole["history"]


def copy_stream(n_chunks: int, seed: int) -> np.ndarray:
    r = np.random.default_rng(seed).integers(0, 32, size=(n_chunks, 4))
    return np.concatenate([r, r], axis=1).reshape(-1).astype(np.int32)


def test_a_killed_cuda_search_resumes_to_the_same_logits_and_history(tmp_path, deterministic):
    from parnas.strategies.costs import CostModel
    from parnas.strategies.search import build_search
    from parnas.strategies.search_folder import prepare_run_dir

    splits = {"train": copy_stream(3000, 0), "valid": copy_stream(100, 1), "test": copy_stream(100, 2)}
    costs = CostModel({"attention": 3.0, "dense": 1.0, "identity": 0.0}, 1.0, "ms/step", 2)

    def search(run_dir, *extra, resume_from=None):
        torch.manual_seed(0)
        cfg = load_config("tiny", ["model.n_blocks=2", "model.cutoffs=[]", "model.mem_len=8", "data.batch_size=8",
                                   "data.seg_len=16", "data.eval_batch_size=4", "train.warmup_steps=10",
                                   "train.lr=1e-2", "search.arch_lr=0.03", "train.max_steps=20",
                                   "train.eval_every=10", "train.ckpt_every=10", "search.log_every=5",
                                   "model.dropout=0.1", "search.par-gumbel-darts.latency_budget=0.5",
                                   "train.accelerator=gpu", *extra])
        meta = {"config": cfg.to_dict(), "architecture": {}, "tokenizer": {}}
        s = build_search(cfg, splits, 32, run_dir, ckpt=resume_from, meta=meta, costs=costs)
        s.run()
        return s

    straight = search(tmp_path / "straight")
    search(tmp_path / "killed", "train.stop_at=10")
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    prepare_run_dir(tmp_path / "killed", ckpt.load(last)["global_step"])
    resumed = search(tmp_path / "killed", resume_from=last)
    for a, b in zip(straight.module.arch_parameters(), resumed.module.arch_parameters()):
        assert torch.equal(a.detach().cpu(), b.detach().cpu())
    assert straight.module.argmax() == resumed.module.argmax() and straight.module.dual == resumed.module.dual
    assert resumed.module.last_evaluation.val_ppl == straight.module.last_evaluation.val_ppl
    history = [(tmp_path / run / "history.jsonl").read_text() for run in ("straight", "killed")]
    assert history[0] == history[1]


def test_a_checkpoint_written_on_the_gpu_evaluates_and_resumes_on_the_cpu_and_back(wt2_slice, tmp_path):
    out = tmp_path / "run"
    base = ["retrain", "--arch", "transformer-xl", "--config", "tiny",
            *sets(f"data.path={wt2_slice}", *SMALL, f"train.out_dir={out}", "train.max_steps=30",
                  "train.eval_every=10", "train.ckpt_every=10")]
    assert cli(*base, *sets("train.accelerator=gpu", "train.stop_at=10")) == 0
    last = out / "checkpoints" / "last.ckpt"
    written = torch.load(last, weights_only=True)  # no map_location: tensors come back where they were saved
    assert any(t.is_cuda for t in written["state_dict"].values())
    for device in ("cpu", "gpu"):
        assert cli("evaluate", last, "--accelerator", device, "--out", tmp_path / f"{device}.json") == 0
    on_cpu, on_gpu = read(tmp_path / "cpu.json"), read(tmp_path / "gpu.json")
    assert on_cpu["device"] == "cpu" and on_gpu["device"].startswith("cuda")
    assert on_cpu["ppl"] == pytest.approx(on_gpu["ppl"], rel=1e-4)

    assert cli(*base, *sets("train.accelerator=cpu", "train.stop_at=20"), "--resume") == 0  # GPU checkpoint, CPU run
    assert read(out / "metrics.json")["device"] == "cpu"
    assert not any(t.is_cuda for t in torch.load(last, weights_only=True)["state_dict"].values())
    assert cli(*base, *sets("train.accelerator=gpu"), "--resume") == 0  # and back
    metrics = read(out / "metrics.json")
    assert metrics["device"].startswith("cuda") and metrics["steps"] == 30 and math.isfinite(metrics["val_ppl"])
    assert [h["step"] for h in metrics["history"]] == [10, 20, 30]


# --- precision ----------------------------------------------------------------------------------------------------

def test_bf16_mixed_trains_within_the_fp32_seed_spread(wt2_slice, tmp_path):
    """500 steps of tiny, three seeds each: bf16-mixed's mean validation loss lies within the spread fp32's seeds
    give (max - min) of fp32's mean."""
    from parnas.training.fit import train

    losses: dict[str, list[float]] = {"32-true": [], "bf16-mixed": []}
    for precision, runs in losses.items():
        for seed in range(3):
            cfg = load_config("tiny", [f"data.path={wt2_slice}", *SMALL, "train.accelerator=gpu",
                                       f"train.precision={precision}", f"train.seed={seed}", "train.max_steps=500",
                                       "train.eval_every=500", "train.ckpt_every=500", "train.log_every=500",
                                       f"train.out_dir={tmp_path / f'{precision}-{seed}'}"])
            runs.append(train(cfg)["val_loss"])
    fp32, bf16 = losses["32-true"], losses["bf16-mixed"]
    assert all(math.isfinite(v) for v in fp32 + bf16), losses
    assert abs(statistics.mean(bf16) - statistics.mean(fp32)) <= max(fp32) - min(fp32), losses


# --- compiled, on the GPU ---------------------------------------------------------------------------------------

def test_a_cuda_graphed_retrain_finishes_and_evaluates_like_an_eager_one(wt2_slice, tmp_path):
    """``parnas retrain --set train.compile=reduce-overhead`` on CUDA trains, writes its metrics, and ends where
    the eager run ends (dropout off) to a tolerance."""
    import torch._dynamo

    ppl = {}
    for mode in ("none", "reduce-overhead"):
        out = tmp_path / mode
        torch._dynamo.reset()
        try:
            assert cli("retrain", "--arch", "transformer-xl", "--accelerator", "gpu", "--devices", "1", "--config",
                       "tiny", *sets(f"data.path={wt2_slice}", *SMALL, f"train.out_dir={out}", "model.dropout=0.0",
                                     "train.max_steps=30", f"train.compile={mode}")) == 0
        finally:
            torch._dynamo.reset()
        metrics = read(out / "metrics.json")
        assert metrics["device"].startswith("cuda")
        ppl[mode] = metrics["val_ppl"]
    assert ppl["reduce-overhead"] == pytest.approx(ppl["none"], rel=1e-2)


def test_reversible_pairs_and_lsh_recompute_the_same_gradients_on_cuda():
    """CUDA's random state (dropout, lsh's rotations) is replayed in the backward pass: the recomputed gradients
    are ordinary autograd's, in float32 on the GPU."""
    from parnas.nn import model as model_module

    cfg = load_config("tiny", ["model.reversible=true", "model.blocks=[attention, dense, identity, lsh]",
                               "model.lsh.chunk_len=8", "model.dropout=0.2"])
    torch.manual_seed(0)
    model = build_fixed_model(cfg.model, 1000).cuda().train()
    x = torch.randint(0, 1000, (4, 16), device="cuda")
    grads = []
    original = model_module.reversible_stack
    for recompute in (True, False):
        model_module.reversible_stack = lambda *a, r=recompute, **k: original(*a, recompute=r)
        try:
            torch.manual_seed(5)
            h, _ = model(x)
            model.nll(h, x).sum().backward()
        finally:
            model_module.reversible_stack = original
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad()
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def block_forward_backward(call, block, h, mem, pos, precision, context=nullcontext):
    """``call(h, mem, pos)`` forward (inside ``context()``, autocast to bf16 for bf16-mixed) and backward of the mean
    squared output: the output and every gradient (``block``'s and ``h``'s), in float32; gradients zeroed after."""
    with context(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        out = call(h, mem, pos).float()
        out.square().mean().backward()
    grads = {name: p.grad.float().clone() for name, p in block.named_parameters()} | {"h": h.grad.clone()}
    block.zero_grad()
    h.grad = None
    return out.detach(), grads


def assert_same_block_results(got, want, precision):
    """Two :func:`block_forward_backward` results agree, within bf16's tolerance or fp32's."""
    tolerance = 3e-2 if precision == "bf16-mixed" else 1e-3
    torch.testing.assert_close(got[0], want[0], rtol=tolerance, atol=tolerance)
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_heads_of_41_run_a_fused_attention_kernel_on_cuda(precision):
    """Dai et al.'s WikiText-103 base has heads of 41, which no fused SDPA kernel takes: padded, the attention runs
    forward and backward with SDPA's math path shut off, and computes what the unpadded math path computes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from parnas.nn.blocks import AttentionBlock, sinusoid

    torch.manual_seed(0)
    block = AttentionBlock(d_model=410, n_heads=10, dropout=0.0, dropatt=0.0).cuda()
    h = torch.randn(4, 32, 410, device="cuda", requires_grad=True)
    mem, pos = torch.randn(4, 32, 410, device="cuda"), sinusoid(64, 410, torch.device("cuda"))
    fused = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]

    def run(backends):
        return block_forward_backward(block, block, h, mem, pos, precision, lambda: sdpa_kernel(backends))

    padded = run(fused)
    block.pad_multiple = 1
    with pytest.raises(RuntimeError, match="[Nn]o available kernel"):
        run(fused)  # unpadded, only the math path takes them
    block.zero_grad()
    h.grad = None
    assert_same_block_results(padded, run([SDPBackend.MATH]), precision)
