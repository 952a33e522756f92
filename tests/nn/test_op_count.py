"""The host's work per training step, as aten ops dispatched, must not grow: on a GPU a small model's step is
bound by one dispatch and launch per op (``benchmarks/op_count.py`` counts them at Dai et al.'s shape)."""

from parnas.config import load_config

# non-view aten ops of one forward, loss and backward (CPU, torch 2.13) of the tiny model below; lower them when
# a change cuts ops, never raise them
BUDGET = {"transformer-xl": 242, "supernet (mixed)": 522}


def tiny():
    return load_config("tiny", ["model.cutoffs=[20, 40]", "data.batch_size=2", "data.seg_len=8", "model.mem_len=8"])


def test_a_training_step_dispatches_no_more_ops_than_its_budget(benchmark_script):
    op_count = benchmark_script("op_count")
    counted = {name: sum(ops.values()) for name, ops in op_count.counts(tiny(), 64).items()}
    assert set(counted) == set(BUDGET)
    for name, budget in BUDGET.items():
        assert counted[name] <= budget, f"{name}: {counted[name]} non-view aten ops per step, over its budget {budget}"
        assert counted[name] > budget // 2, f"{name}: {counted[name]} ops: lower its budget to match"


def test_the_counter_leaves_views_out_and_counts_backward(benchmark_script):
    import torch

    op_count = benchmark_script("op_count")
    x = torch.randn(4, 4, requires_grad=True)

    def work():
        y = (x.view(16).t() * 2).sum()  # view and t are views: mul and sum count, and their backward's
        y.backward()

    counted = op_count.count_ops(work)
    assert "view" not in counted and "t" not in counted
    assert counted["mul"] >= 2 and counted["sum"] == 1  # the backward's mul by 2 as well
    assert "expand" not in counted  # sum's backward expands: a view too


def test_attention_compiles_to_one_graph_and_its_causal_bias_is_made_in_it():
    """Dynamo warned of the ``functools.lru_cache`` around the causal mask and guarded on what it held: under
    compile the mask is made in the graph, in eager mode it is made once per shape."""
    import warnings

    import torch
    import torch._dynamo

    from parnas.nn.blocks import AttentionBlock, causal_bias

    torch.manual_seed(0)
    block = AttentionBlock(d_model=16, n_heads=2, dropout=0.0, dropatt=0.0)
    h, mem, pos = torch.randn(2, 6, 16), torch.randn(2, 4, 16), torch.randn(10, 16)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch._dynamo.explain(block)(h, mem, pos)
    torch._dynamo.reset()
    assert out.graph_count == 1 and out.graph_break_count == 0, out.break_reasons
    assert not [w for w in caught if "lru_cache" in str(w.message)]
    made = causal_bias(6, 4, torch.device("cpu"), torch.float32)
    assert causal_bias(6, 4, torch.device("cpu"), torch.float32) is made  # eager: one per shape
    expected = torch.zeros(6, 10).masked_fill_(torch.ones(6, 10, dtype=torch.bool).triu_(5), float("-inf"))
    torch.testing.assert_close(made, expected, atol=0, rtol=0)
    compiled = torch.compile(block, backend="eager", fullgraph=True)  # the mask made in the graph: same output
    torch.testing.assert_close(compiled(h, mem, pos), block(h, mem, pos))
    torch._dynamo.reset()


# a tiny model's losses, hidden states and gradients over three segments (memory carried), recorded before
# queries, keys and values became one projection: fusing them cut ops and changed no number
BEFORE = {"0.0": ([4.656296730041504, 4.611413955688477, 4.611897945404053], 128.16710141319464, 418.8201842997223),
          "0.1": ([4.657513618469238, 4.615818023681641, 4.597348213195801], 124.34515843977906, 401.79461943916976)}


def three_segments(dropout):
    """(losses, sum of |gradients|, sum of |last hidden states|) of a tiny model at a fixed seed."""
    import torch

    from parnas.nn.model import build_fixed_model

    cfg = load_config("tiny", ["model.cutoffs=[20, 40]", "data.batch_size=2", "data.seg_len=8", "model.mem_len=8",
                               f"model.dropout={dropout}", "model.n_blocks=4"])
    torch.manual_seed(0)
    model = build_fixed_model(cfg.model, 64).train()
    x = torch.randint(64, (2, 17), generator=torch.Generator().manual_seed(1))
    mems, losses = None, []
    for t in range(3):
        h, mems = model(x[:, 8 * min(t, 1):8 * min(t, 1) + 8], mems)
        loss = model.nll(h, x[:, 8 * min(t, 1) + 1:8 * min(t, 1) + 9]).float().mean()
        loss.backward()
        losses.append(loss.item())
    grads = sum(p.grad.double().abs().sum().item() for p in model.parameters() if p.grad is not None)
    return losses, grads, h.double().abs().sum().item(), model


def test_the_fused_projection_changes_no_number():
    import pytest
    import torch

    from parnas.nn.blocks import rel_shift

    for dropout, (losses, grads, hidden) in BEFORE.items():
        now = three_segments(dropout)
        assert now[0] == pytest.approx(losses, rel=1e-6, abs=0) and now[2] == pytest.approx(hidden, rel=1e-6)
        assert now[1] == pytest.approx(grads, rel=1e-6)
    state = three_segments("0.0")[3].state_dict()
    assert "blocks.0.qkv.weight" in state and "blocks.0.q.weight" not in state
    scores = torch.randn(2, 3, 4, 1 + 7)
    assert rel_shift(scores).untyped_storage().data_ptr() == scores.untyped_storage().data_ptr()  # no copy


def test_cuda_graphs_off_cuda_are_refused_in_one_line_before_anything_is_written(capsys, tmp_path):
    import pytest
    import torch

    from parnas.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the graphs would be captured")
    out = tmp_path / "run"
    code = main(["retrain", "--config", "tiny", "--set", "train.compile=reduce-overhead", "--arch", "transformer-xl",
                 "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "train.compile=reduce-overhead replays CUDA graphs, which need CUDA" in err and "on the CPU" in err
    assert not out.exists()


def test_cuda_graphs_of_a_kind_that_reads_back_to_the_host_are_refused_in_one_line_before_any_model(capsys,
                                                                                                  tmp_path):
    """Adaptive computation reads a halting flag back every step: a CUDA graph cannot hold it, on any machine."""
    from parnas.cli import main

    out = tmp_path / "run"
    code = main(["train", "--config", "tiny", "--set", "model.n_blocks=2", "--set", "model.blocks=[ut, dense]",
                 "--set", "train.compile=reduce-overhead", "--set", f"train.out_dir={out}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "train.compile=reduce-overhead" in err and "ut blocks read values back to the host" in err, err
    assert not out.exists()
