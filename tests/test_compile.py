"""The fixed model under torch.compile, on the CPU: where Dynamo breaks the graph, and no recompiles once the
memory is full. Dynamo only (a backend that runs the captured graphs as they are): what is counted is the
tracing, which is the same on every device, except the CPU's own dropout path (``keep_mask``)."""

import collections

import pytest
import torch
import torch._dynamo

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


def test_forward_and_loss_are_one_graph_with_a_full_softmax_and_no_dropout():
    model, step = model_and_step("model.cutoffs=[]", "model.dropout=0.0")
    assert breaks(step, model)[:2] == (1, 0)


@pytest.mark.slow
def test_graphs_break_only_at_the_adaptive_softmax_clusters_and_the_cpu_dropout():
    """The adaptive softmax's per-cluster ``nonzero`` has a data-dependent size; the CPU's dropout draws with
    ``random_``, which Dynamo does not trace (off the CPU dropout is ``F.dropout``, which it does)."""
    model, step = model_and_step("model.cutoffs=[100, 400]", "model.dropout=0.1")
    _, count, where = breaks(step, model)
    assert count > 0 and {fn for _, fn in where} == {"_adaptive_nll", "keep_mask"}, where
    model, step = model_and_step("model.cutoffs=[100, 400]", "model.dropout=0.0")
    assert {fn for _, fn in breaks(step, model)[2]} == {"_adaptive_nll"}


@pytest.mark.parametrize("cutoffs", ["[]", "[100, 400]"])
@pytest.mark.slow
def test_no_recompiles_once_the_memory_is_full(graphs_made, cutoffs):
    """Graphs are made while the memory grows (0, 16, then 32 states); over ten more segments of other tokens
    (other cluster sizes in the adaptive softmax) none is made again."""
    _, step = model_and_step(f"model.cutoffs={cutoffs}", "model.dropout=0.1")
    made = graphs_made(step, zipf_ids(B * (L * 13 + 1), VOCAB).view(B, -1), L, 13)
    assert made[2] > 0 and made[2:] == [made[2]] * 11, made
