"""The fixed model under torch.compile, on the CPU: where Dynamo breaks the graph, and no recompiles once the
memory is full. Dynamo only (a backend that runs the captured graphs as they are): what is counted is the
tracing, which is the same on every device, except the CPU's own dropout path (``keep_mask``). Then what
``train.compile`` reports after its first step, whether the training graphs are fit to become CUDA graphs (traced
on the ``meta`` device, the path off the CPU), and Inductor's compiled model against eager."""

import collections
import re

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from parnas.config import load_config
from parnas.nn.model import build_fixed_model
from parnas.training.latency import zipf_ids

VOCAB, B, L = 1000, 8, 16
# causal_bias is an lru_cache of (L, M, device, dtype): Dynamo traces through it, building the mask in the graph
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")


def model_and_step(*overrides):
    cfg = load_config("tiny", ["model.mem_len=32", *overrides])  # the memory fills over two segments
    torch.manual_seed(0)
    model = build_fixed_model(cfg.model, VOCAB).train()

    def step(x, y, mems):
        h, mems = model(x, mems)
        return model.nll(h, y).mean(), mems
    return model, step


def breaks(step, model):
    """(graph count, {(reason, function where it broke): count}) of one step with the memory full."""
    x, y = torch.randint(0, VOCAB, (B, L)), torch.randint(0, VOCAB, (B, L))
    with torch.no_grad():
        mems = None
        for _ in range(3):
            _, mems = model(x, mems)
    torch._dynamo.reset()
    out = torch._dynamo.explain(step)(x, y, mems)
    torch._dynamo.reset()
    where = collections.Counter((r.reason.splitlines()[0], r.user_stack[-1].name) for r in out.break_reasons)
    return out.graph_count, out.graph_break_count, where


def test_a_compiled_model_runs_compiled_exactly_when_its_memory_is_full():
    """What decides whether a segment runs compiled (:func:`memory_full`): the memory it is handed holds all the
    model keeps in training (``mem_len``), or in evaluation (its own length); a model with no memory to fill,
    none of whose blocks attends or whose memory length is 0, always does."""
    from parnas.training.compiling import memory_full

    model, _ = model_and_step()  # mem_len 32, segments of 16
    model.evaluate_with(mem_len=64)
    x = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        mems, lengths, full = None, [], []
        for _ in range(3):
            full.append(memory_full(model, mems))
            lengths.append(next((m.size(1) for m in mems or [] if m is not None), 0))
            _, mems = model(x, mems)
        assert lengths == [0, 16, 32] and full == [False, False, True]
        model.eval()
        assert not memory_full(model, mems)  # 32 of evaluation's 64
        assert memory_full(model, model(x, model(x, mems)[1])[1])
    dense = build_fixed_model(load_config("tiny").model, VOCAB, ["dense", "dense"])
    assert memory_full(dense, None) and memory_full(dense, dense(x)[1])
    no_memory = build_fixed_model(load_config("tiny", ["model.mem_len=0"]).model, VOCAB)
    assert memory_full(no_memory, None)


@pytest.mark.slow
def test_forward_and_loss_are_one_graph_with_a_full_softmax_and_no_dropout():
    model, step = model_and_step("model.cutoffs=[]", "model.dropout=0.0")
    assert breaks(step, model)[:2] == (1, 0)


@pytest.mark.slow  # a compile or a training run of seconds: `make test` runs it, `make test-fast` not
def test_an_adaptive_input_is_part_of_the_forwards_one_graph():
    """The adaptive input looks every id up in each cluster's table, masked: no data-dependent size (a count of
    each cluster's ids) breaks the forward's graph."""
    model, _ = model_and_step("model.cutoffs=[100, 400]", "model.adaptive_input=true", "model.div_value=2",
                              "model.dropout=0.0")
    assert breaks(lambda x, y, mems: model(x, mems), model)[:2] == (1, 0)


@pytest.mark.slow
def test_graphs_break_only_at_the_adaptive_softmax_clusters_and_the_cpu_dropout():
    """A loss given no host-made target groups groups them itself, and the clusters' sizes are data-dependent;
    the CPU's dropout draws with ``random_``, which Dynamo does not trace (off the CPU dropout is
    ``F.dropout``, which it does)."""
    model, step = model_and_step("model.cutoffs=[100, 400]", "model.dropout=0.1")
    _, count, where = breaks(step, model)
    assert count > 0 and {fn for _, fn in where} == {"group_by_cluster", "keep_mask"}, where
    model, step = model_and_step("model.cutoffs=[100, 400]", "model.dropout=0.0")
    assert {fn for _, fn in breaks(step, model)[2]} == {"group_by_cluster"}


@pytest.mark.parametrize("cutoffs", ["[]", "[100, 400]"])
@pytest.mark.slow
def test_no_recompiles_once_the_memory_is_full(graphs_made, cutoffs):
    """Graphs are made while the memory grows (0, 16, then 32 states); over ten more segments of other tokens
    (other cluster sizes in the adaptive softmax) none is made again."""
    _, step = model_and_step(f"model.cutoffs={cutoffs}", "model.dropout=0.1")
    made = graphs_made(step, zipf_ids(B * (L * 13 + 1), VOCAB).view(B, -1), L, 13)
    assert made[2] > 0 and made[2:] == [made[2]] * 11, made


def test_the_line_after_a_compiled_first_step_says_what_was_compiled_and_what_missed_cuda_graphs():
    """What ``compiled: step N took ...`` adds: the graphs compiled and the graph breaks since training
    began, and for ``reduce-overhead`` whether Inductor left any graph without CUDA graphs, read from the counter
    that Inductor's own skip report bumps (the report alone is one log warning among many, and the step it slows
    runs anyway)."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    from parnas.training.compiling import compile_counts, compiled_since

    def broken(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    torch._dynamo.reset()
    try:
        before = compile_counts()
        torch.compile(broken, backend="eager")(torch.ones(3))
        assert compiled_since(before, "default") == "2 graphs, 1 graph break (TORCH_LOGS=graph_breaks says where)"
        assert compiled_since(before, "reduce-overhead").endswith(", replayed as CUDA graphs")
        assert compiled_since(compile_counts(), "default") == "0 graphs, no graph breaks"
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to a test of the report")
        assert compiled_since(before, "reduce-overhead").endswith(
            ", CUDA graphs skipped 1 time: those parts launch each kernel from the host (Inductor's warning says why)")
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["transformer-xl", "mixed supernet", "fair supernet, stacked"])
def test_the_compiled_training_graphs_are_fit_for_cuda_graphs(model, benchmark_script):
    """Three of the reasons Inductor leaves a graph without CUDA graphs (``reduce-overhead``), silently but for a
    log warning: the graph writes into one of its inputs, makes a tensor on the CPU, or holds an op Inductor will
    not record (a value read back, a size that depends on data: Inductor's own test of a graph). The training
    graphs, forward and backward, of the fixed model and of a compiled search's supernets, and of their loss (its
    tail clusters padded to fixed capacities, as a compiled model's training batches are) have none: the memory,
    the parameters, tau and the fair step's routes are read in them (tau and the routes are set in place between
    steps, outside the graphs), and traced on the ``meta`` device (the path off the CPU: torch's dropout, padded
    operands) every tensor is there. The meta device runs SDPA's math path, not CUDA's kernels: those, a GPU
    checks (``test_cuda_graphs_train_like_eager...``)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import TracingContext
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    from parnas.training.compiling import compile_model
    from parnas.training.task import adam

    written, devices, unsafe = [], set(), []

    def devices_of(gm):  # and any op Inductor will not record in a CUDA graph (a read back, a data-dependent size)
        devices.update(str(n.meta["val"].device) for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor))
        unsafe.append(get_first_incompatible_cudagraph_node(gm))
        return gm

    def forward_compiler(gm, inputs):  # what AOT autograd found the graph writes, by input index
        written.append(list(TracingContext.get().fw_metadata.mutated_inp_runtime_indices))
        return devices_of(gm)

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, inputs: devices_of(gm))
    cfg = load_config("tiny", ["model.dropout=0.1", "model.mem_len=16", "model.cutoffs=[100, 400]"])
    torch.manual_seed(0)
    if model == "transformer-xl":
        net = build_fixed_model(cfg.model, VOCAB).train()
    else:  # the search's supernet, as the op counter builds it
        net = benchmark_script("op_count").supernet(cfg, VOCAB)
    net = net.to("meta")
    compile_model(net, "default", backend)
    weights = [p for name, p in net.named_parameters() if not name.endswith("_arch_alpha")]
    if model.startswith("fair"):
        step = benchmark_script("search_step").fair_step(net, [adam(weights, lr=1e-3)], weights, 0.25, stacked=True)
    else:
        step = benchmark_script("train_step").training_step(net, [adam(weights, lr=1e-3)], weights, 0.25)
    torch._dynamo.reset()
    try:
        tokens = torch.randint(0, VOCAB, (2, 9))
        # the targets grouped on the host, as the data module groups a compiled model's training batches
        groups = net.group_targets(tokens[:, 1:], net.target_capacity).to(torch.device("meta"))
        for _ in range(4):  # the memory empty and filling (eager), then full twice (compiled once)
            step(tokens.to("meta"), groups)
    finally:
        torch._dynamo.reset()
    assert len(written) == 2 and written == [[]] * 2, written  # the forward's, the loss's
    assert devices == {"meta"}, devices
    assert len(unsafe) == 4 and not any(unsafe), unsafe  # 2 forward graphs, 2 backward


# --- train.compile: the fixed model under Inductor (torch.compile's default backend, C++ on the CPU) ------------

@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_the_compiled_model_trains_like_the_eager_one_and_compiles_only_its_first_segment_with_a_full_memory(mode):
    """Same losses and gradients as eager over six segments, dropout on (the CPU's dropout draws stay eager, in
    the same order), each model's targets grouped as the data module groups a training batch (the compiled
    model's tail clusters padded to its capacities, so its loss is compiled too). The two segments that fill the
    memory compile nothing (they run eager); the third, the first with a full memory, compiles the model and its
    loss; no later one compiles anything, though each segment's clusters hold other counts. (CUDA graphs, which
    reduce-overhead adds on a GPU, are tested there.)"""
    import copy

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from parnas.nn.model import TransformerXL
    from parnas.training.compiling import compile_model
    from parnas.training.task import unpack, with_target_groups

    eager, _ = model_and_step("model.dropout=0.1")
    compiled = copy.deepcopy(eager)
    compile_model(compiled, mode)
    stream = zipf_ids(B * (L * 6 + 1), VOCAB).view(B, -1)
    segments = [(stream[:, t * L:(t + 1) * L], stream[:, t * L + 1:(t + 1) * L + 1]) for t in range(6)]
    for _, y in segments:  # the capacities grown to the stream's largest counts, as a run's first batches grow them
        compiled.group_targets(y, compiled.target_capacity)
    held = {int(compiled.group_targets(y, compiled.target_capacity).valid.sum()) for _, y in segments}
    assert len(held) > 1  # the segments' tail clusters hold different counts of rows
    mems, made, before = {"eager": None, "compiled": None}, [], counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    try:
        for t, segment in enumerate(segments):
            losses = {}
            with torch._dynamo.config.patch(error_on_recompile=t >= 3):
                for name, model in (("eager", eager), ("compiled", compiled)):
                    x, y, groups = unpack(with_target_groups(model, segment, training=True))
                    torch.manual_seed(t)
                    h, mems[name] = model(x, mems[name])
                    losses[name] = model.nll(h, y, groups).mean()
                    model.zero_grad(set_to_none=True)
                    losses[name].backward()
            torch.testing.assert_close(losses["compiled"], losses["eager"], rtol=1e-5, atol=1e-6)
            for (key, a), b in zip(eager.named_parameters(), compiled.parameters()):
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=f"segment {t}: {key}")
            for a, b in zip(mems["eager"], mems["compiled"]):
                assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-5, atol=1e-6))
            made.append(counters["stats"]["unique_graphs"] - before)
        assert made[:2] == [0, 0] and made[2] > 0 and made[2:] == [made[2]] * 4, made
        assert len(_debug_get_cache_entry_list(TransformerXL.nll.__code__)) == 1  # one of the loss, for segments 2-5
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
def test_a_compiled_retrain_resumes_to_the_same_weights(micro_corpus, kill_at, tmp_path, capsys):
    """``train.compile`` changes no checkpoint key and no step: a killed compiled run resumes exactly. Its first
    step with a full memory (the second: its first fills it, eager) compiles, and its first validation batch with
    one; that is said before training starts, and each is timed after it."""
    import json

    from parnas import architecture
    from parnas.config import DataConfig, ModelConfig
    from parnas.data.corpora import load_splits
    from parnas.retrain.run import retrain
    from parnas.training import checkpoint as ckpt

    vocab = load_splits(DataConfig(path=str(micro_corpus), tokenizer="char"))[0].vocab_size
    model = ModelConfig(n_blocks=3, d_model=32, n_heads=2, d_ff=64, mem_len=16, dropout=0.1, cutoffs=(20, 40))
    record = architecture.make_record({architecture.label(i): k for i, k in enumerate(["attention", "dense",
                                                                                        "identity"])},
                                      model, vocab, tokenizer={"kind": "char", "vocab_size": vocab})
    arch = tmp_path / "arch.json"
    arch.write_text(json.dumps(record))
    common = [f"data.path={micro_corpus}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "data.seg_len=16",
              "train.max_steps=6", "train.eval_every=3", "train.ckpt_every=3", "train.compile=default"]
    torch._dynamo.reset()
    try:
        whole = retrain(str(arch), "tiny", [*common, f"train.out_dir={tmp_path / 'whole'}"])
        said = capsys.readouterr().out.splitlines()
        start = said.index(next(line for line in said if line.startswith(
            "compiling the model (train.compile=default): the first step with a full memory builds")))
        took = [line for line in said[start + 1:] if line.startswith("compiled: ")]  # memory 16, segments of 16
        assert [line.split(" took ")[0] for line in took] == ["compiled: step 2",
                                                               "compiled: validation batch 2 at step 3"], said
        assert all(re.search(r" took \d+\.\d s \(\d+ graphs?, (no|\d+) graph breaks?", line) for line in took), said
        split = [*common, f"train.out_dir={tmp_path / 'split'}"]
        with pytest.raises(RuntimeError, match="killed"):
            retrain(str(arch), "tiny", split, callbacks=[kill_at(4)])
        resumed = retrain(str(arch), "tiny", split, resume=True)
        assert counters["stats"]["unique_graphs"] > 0
    finally:
        torch._dynamo.reset()
    a, b = (ckpt.load(tmp_path / run / "checkpoints/last.ckpt") for run in ("whole", "split"))
    assert a["global_step"] == b["global_step"] == 6
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
    assert whole["val_ppl"] == resumed["val_ppl"]


@pytest.mark.slow
def test_a_compiled_models_evaluation_compiles_in_its_warm_up_not_in_the_timed_pass(monkeypatch):
    """The evaluation speed a run reports excludes compiling: the untimed warm-up reaches the first segment with
    a full memory (here the fourth: an evaluation memory of three segments), where a compiled model compiles, and
    the split's last, shorter segment compiles nothing (it runs eager: a set of graphs for one segment)."""

    from parnas.training import evaluation
    from parnas.training.compiling import compile_counts, compile_model
    from parnas.training.data_module import SegmentData

    model, _ = model_and_step("model.eval_mem_len=48", "model.dropout=0.0")  # segments of 16
    compile_model(model, "default", backend="eager")
    split = zipf_ids(4 * (16 * 8 + 6), VOCAB).numpy()  # 4 streams of 8 segments of 16 and one of 5
    data = SegmentData({"valid": split}, 4, 4, 16)
    made, evaluate = [], evaluation.evaluate

    def counted(*args):
        before = compile_counts()[0]
        result = evaluate(*args)
        made.append(compile_counts()[0] - before)
        return result

    monkeypatch.setattr(evaluation, "evaluate", counted)
    torch._dynamo.reset()
    try:
        evaluation.split_metrics(model, data, "valid")
    finally:
        torch._dynamo.reset()
    assert made[0] > 0 and made[1:] == [0], made  # the warm-up compiled; the timed pass did not
