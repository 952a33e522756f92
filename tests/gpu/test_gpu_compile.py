"""On a CUDA GPU: the training step waits for the GPU only where the CPU's recorder says (a search step
nowhere), and the compiled model (``train.compile``: Inductor's kernels, and CUDA graphs under
``reduce-overhead``) compiles without breaks, stops compiling once the memory is full and trains like the eager
one. ``make test-gpu`` runs these with the other CUDA tests (``pytest -m gpu``); without CUDA they are collected
and reported as skipped. Tiny shapes throughout."""

import os
import warnings

import numpy as np
import pytest
import torch

from parnas.config import load_config
from parnas.nn.model import build_fixed_model
from parnas.training.devices import pinned
from parnas.training.latency import zipf_ids
from parnas.training.task import adam

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as tests/gpu/test_gpu.py: repeatable cuBLAS products


@pytest.mark.parametrize("cutoffs, precision", [("[]", "32-true"), ("[]", "bf16-mixed"), ("[100, 400]", "32-true"),
                                                ("[100, 400]", "bf16-mixed")])
def test_the_training_step_waits_for_the_gpu_only_where_the_cpu_recorder_says(benchmark_script, cutoffs, precision):
    """CUDA's own sync counter (set_sync_debug_mode) around one step with the memory full agrees with the
    recorder: the adaptive softmax reads its cluster sizes back once when the loss groups its targets, and with
    the targets grouped on the host, as the training loop groups them, nothing waits at all."""
    host_syncs = benchmark_script("host_syncs")
    cfg = load_config("tiny", [f"model.cutoffs={cutoffs}", "model.dropout=0.1", "model.dropatt=0.1"])
    torch.manual_seed(0)
    model = build_fixed_model(cfg.model, 1000).cuda().train()
    optimizer = adam(model.parameters(), lr=1e-3, precision=precision)
    B, L = cfg.data.batch_size, cfg.data.seg_len
    host = zipf_ids(B * (5 * L + 1), 1000).view(B, -1)
    stream = host.cuda()
    groups = [model.group_targets(host[:, t * L + 1:(t + 1) * L + 1]) for t in range(5)]  # grouped on the host
    groups = [None if g is None else pinned(g, stream.device).to(stream.device) for g in groups]
    mems = None

    def step(t: int, grouped: bool) -> None:
        nonlocal mems
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            h, mems = model(stream[:, t * L:(t + 1) * L], mems)
            y = stream[:, t * L + 1:(t + 1) * L + 1]
            loss = model.nll(h, y, groups[t] if grouped else None).float().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        optimizer.step()

    for t in (0, 1):  # warm-up: the memory fills, kernels load, the optimiser makes its state
        step(t, grouped=True)
    torch.cuda.synchronize()
    with host_syncs.SyncRecorder() as recorder, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(2, grouped=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # only what waited: setting the mode also warns, once a process, that it is a prototype
    waited = [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(waited) == recorder.total == (0 if cutoffs == "[]" else 1), (waited, recorder.sites)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(3, grouped=True)  # raises at the first operation that would make the host wait
        step(4, grouped=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("forward", ["fair", "gumbel"])
def test_a_search_step_on_cuda_waits_for_the_gpu_nowhere(benchmark_script, tmp_path, forward):
    """CUDA's own sync counter over one whole loop iteration of a search under a latency budget (batch start to
    the next: the loop, the step, the logits, the callbacks), fair and gumbel (the default):
    nothing waits, as the CPU recorder says of the same iteration (tests/training/test_host_syncs.py)."""
    from parnas.strategies.costs import CostModel
    from parnas.strategies.search import build_search

    host_syncs, vocab = benchmark_script("host_syncs"), 1000
    cfg = load_config("tiny", ["train.accelerator=gpu", "train.max_steps=5", "train.log_every=5",
                               "search.par-gumbel-darts.latency_budget=0.9",
                               f"search.par-gumbel-darts.forward={forward}"])
    B, L = cfg.data.batch_size, cfg.data.seg_len
    ids = zipf_ids(B * L * 20, vocab).numpy().astype(np.int64)
    splits = {"train": ids, "valid": ids[:B * L * 4], "test": ids[:B * L * 4]}
    costs = CostModel({"attention": 3.0, "dense": 1.0, "identity": 0.0}, 1.0, "ms/step", cfg.model.n_blocks)
    search = build_search(cfg, splits, vocab, tmp_path, costs=costs)
    assert search.module.par.forward == forward
    record = host_syncs.RecordStep(3, cuda=True)
    search.trainer.callbacks.append(record)
    search.run()
    assert record.recorder.total == 0 and record.cuda_waits == [], (record.recorder.sites, record.cuda_waits)


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_forward_and_loss_compile_without_breaks_or_recompiles_on_cuda(graphs_made):
    """Off the CPU, dropout is torch's own (traced): with a full softmax, forward and loss are one graph, and no
    graph is made again once the memory is full."""
    import torch._dynamo

    cfg = load_config("tiny", ["model.cutoffs=[]", "model.dropout=0.1", "model.mem_len=32"])
    torch.manual_seed(0)
    model = build_fixed_model(cfg.model, 1000).cuda().train()
    B, L = cfg.data.batch_size, cfg.data.seg_len
    stream = zipf_ids(B * (12 * L + 1), 1000).view(B, -1).cuda()

    def step(x, y, mems):
        h, mems = model(x, mems)
        return model.nll(h, y).mean(), mems

    with torch.no_grad():
        _, mems = model(stream[:, :L])
        _, mems = model(stream[:, L:2 * L], mems)
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(step)(stream[:, :L], stream[:, 1:L + 1], mems)
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    made = graphs_made(step, stream, L, 12)
    assert made[2:] == [made[2]] * 10, made


def eager_and_compiled(mode: str, n_segments: int, *settings: str):
    """A tiny Transformer-XL on CUDA (dropout off, memory of 32), a copy compiled in ``mode``, a Zipf stream of
    ``n_segments`` segments and the segment length."""
    import copy

    from parnas.training.compiling import compile_model

    cfg = load_config("tiny", ["model.dropout=0.0", "model.mem_len=32", *settings])
    torch.manual_seed(0)
    eager = build_fixed_model(cfg.model, 1000).cuda().train()
    compiled = copy.deepcopy(eager)
    compile_model(compiled, mode)
    B, L = cfg.data.batch_size, cfg.data.seg_len
    return eager, compiled, zipf_ids(B * (n_segments * L + 1), 1000).view(B, -1).cuda(), L


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_train_compile_on_cuda_matches_eager_and_stops_compiling_once_the_memory_is_full(precision):
    """``train.compile=default`` on CUDA (Inductor's Triton kernels): the losses of eager's to a tolerance, and
    no graph compiled once the memory is full."""
    import torch._dynamo

    eager, compiled, stream, L = eager_and_compiled("default", 6)
    mems: dict = {"eager": None, "compiled": None}
    torch._dynamo.reset()
    try:
        for t in range(6):
            losses = {}
            with torch._dynamo.config.patch(error_on_recompile=t >= 3), \
                    torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                for name, model in (("eager", eager), ("compiled", compiled)):
                    h, mems[name] = model(stream[:, t * L:(t + 1) * L], mems[name])
                    losses[name] = model.nll(h, stream[:, t * L + 1:(t + 1) * L + 1]).float().mean()
            tolerance = 2e-2 if precision == "bf16-mixed" else 1e-4
            torch.testing.assert_close(losses["compiled"], losses["eager"], rtol=tolerance, atol=tolerance)
    finally:
        torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
@pytest.mark.parametrize("cutoffs", ["[]", "[100, 400]"])
def test_cuda_graphs_train_like_eager_and_hand_each_segment_an_intact_memory(cutoffs):
    """``train.compile=reduce-overhead``: forward, loss and their backward replayed as CUDA graphs (an adaptive
    softmax's tail clusters padded to the compiled model's capacities, as the data module pads a training batch),
    Adam stepping the weights in place between replays, an evaluation's replays in between. The losses, gradients
    and memories are eager's to a tolerance: no replay overwrote a memory the next segment attends to. And they
    are CUDA graphs: Inductor skipped none (a skip leaves the same numbers, each kernel launched from the host)."""
    import torch._dynamo

    from parnas.training.compiling import compile_counts

    eager, graphed, stream, L = eager_and_compiled("reduce-overhead", 8, f"model.cutoffs={cutoffs}")
    models = {"eager": eager, "graphed": graphed}
    optimizers = {name: adam(m.parameters(), lr=1e-3) for name, m in models.items()}
    mems: dict = dict.fromkeys(models)
    targets = [stream[:, t * L + 1:(t + 1) * L + 1].cpu() for t in range(8)]
    for y in targets:  # the capacities fitted to every segment, as the data module fits them
        graphed.group_targets(y, graphed.target_capacity)
    torch._dynamo.reset()
    skipped = compile_counts()[2]
    try:
        for t in range(8):
            x, y = stream[:, t * L:(t + 1) * L], stream[:, t * L + 1:(t + 1) * L + 1]
            losses, grads, evaluated = {}, {}, {}
            for name, model in models.items():
                groups = model.group_targets(targets[t], model.target_capacity)  # on the host
                h, mems[name] = model(x, mems[name])
                losses[name] = model.nll(h, y, None if groups is None else groups.to(y.device)).mean()
                optimizers[name].zero_grad(set_to_none=True)
                losses[name].backward()
                grads[name] = [p.grad.clone() for p in model.parameters()]
                optimizers[name].step()
                with torch.no_grad():  # an evaluation's own graphs between two training replays: from the
                    model.eval()  # training memory, full (so compiled) from the third segment on
                    evaluated[name] = model.nll(model(x, mems[name])[0], y).mean()
                    model.train()
            torch.testing.assert_close(losses["graphed"], losses["eager"], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(evaluated["graphed"], evaluated["eager"], rtol=1e-4, atol=1e-4)
            for a, b in zip(grads["eager"], grads["graphed"]):
                torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)
            for a, b in zip(mems["eager"], mems["graphed"]):
                assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-4, atol=1e-4)), t
        assert compile_counts()[2] == skipped, "Inductor skipped CUDA graphs: its warning says why"
    finally:
        torch._dynamo.reset()
