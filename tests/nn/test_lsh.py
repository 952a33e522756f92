"""The ``lsh`` block kind (Reformer's LSH attention): exact where it must be, causal, and usable everywhere a kind
is (memory, generation, search, latency)."""

import math

import pytest
import torch

from parnas.config import load_config
from parnas.errors import ConfigError
from parnas.nn.lsh import SELF, LSHAttentionBlock

B, L, D, H = 2, 8, 16, 2


def full_shared_qk_attention(block: LSHAttentionBlock, h, mem):
    """Causal attention over [memory; segment] with shared QK (unit keys), self visible only as a last resort."""
    c = torch.cat([mem, h], dim=1)
    K, M, Dh = c.size(1), mem.size(1), D // H
    qk = block.qk(c).view(B, K, H, Dh).transpose(1, 2)
    v = block.v(c).view(B, K, H, Dh).transpose(1, 2)
    scores = qk @ torch.nn.functional.normalize(qk, dim=-1).transpose(-1, -2) / math.sqrt(Dh)  # (B, H, K, K)
    future = torch.ones(K, K, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf")).masked_fill(torch.eye(K, dtype=torch.bool), SELF)
    a = (scores.softmax(-1) @ v)[:, :, M:].transpose(1, 2).reshape(B, L, D)
    return block.norm(h + block.out(a))


@pytest.mark.parametrize("memory", [0, L])
def test_one_bucket_and_one_round_is_full_shared_qk_attention(memory):
    torch.manual_seed(0)
    block = LSHAttentionBlock(D, H, 0.0, 0.0, n_buckets=1, n_hashes=1, chunk_len=L).double().eval()
    h, mem = torch.randn(B, L, D, dtype=torch.float64), torch.randn(B, memory, D, dtype=torch.float64)
    torch.testing.assert_close(block(h, mem, None), full_shared_qk_attention(block, h, mem), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_buckets, n_hashes, chunk_len", [(4, 1, 4), (4, 3, 4), (8, 2, 2)])
def test_no_output_depends_on_a_later_position(n_buckets, n_hashes, chunk_len):
    """Hashing may move keys between chunks, but a query's output never draws on a later position: its gradient
    with respect to every later input is zero."""
    torch.manual_seed(0)
    block = LSHAttentionBlock(D, H, 0.0, 0.0, n_buckets, n_hashes, chunk_len).eval()
    h, mem = torch.randn(B, L, D, requires_grad=True), torch.randn(B, L, D, requires_grad=True)
    out = block(h, mem, None)
    probe = torch.randn(D)  # a LayerNorm's outputs sum to a constant: read a random direction instead
    for i in range(L):
        grad_h, grad_mem = torch.autograd.grad((out[:, i] * probe).sum(), (h, mem), retain_graph=True)
        assert (grad_h[:, i + 1:] == 0).all(), i
        assert grad_h[:, i].abs().max() > 0 and grad_mem.abs().max() > 0  # it sees itself and the memory


def test_evaluation_is_deterministic_and_training_draws_new_rotations():
    torch.manual_seed(0)
    block = LSHAttentionBlock(D, H, 0.0, 0.0, 4, 2, 4)
    h, mem = torch.randn(B, L, D), torch.randn(B, L, D)
    block.eval()
    assert torch.equal(block(h, mem, None), block(h, mem, None))
    block.train()
    torch.manual_seed(1)
    first = block(h, mem, None)
    torch.manual_seed(1)
    assert torch.equal(first, block(h, mem, None))  # reseeded, as every training step is


def test_a_model_with_lsh_blocks_keeps_memory_trains_and_decodes_one_token_at_a_time(run_layout):
    """Decoding runs 1-token segments against a memory the chunks do not divide (padded)."""
    model, h, mems = run_layout("[lsh, dense, attention, lsh]", "model.lsh.chunk_len=8")
    h.sum().backward()
    assert all(p.grad is not None for p in model.blocks[0].parameters())
    assert mems[0].shape == (4, 16, 32) and mems[3].shape == (4, 16, 32)


@pytest.mark.parametrize("settings, needle", [
    (["model.lsh.n_buckets=3"], "model.lsh.n_buckets must be even"),
    (["model.lsh.n_buckets=32"], "must not exceed data.seg_len"),
    (["model.lsh.chunk_len=5"], "model.lsh.chunk_len (5) must divide data.seg_len"),
    (["model.lsh.n_hashes=0"], "model.lsh.n_hashes must be >= 1"),
])
def test_lsh_settings_that_cannot_work_are_refused(settings, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config("tiny", ["model.blocks=[lsh, dense, attention, dense]", *settings])


@pytest.mark.slow  # times a latency table of four kinds
def test_lsh_is_a_search_candidate_and_has_a_latency():
    from parnas.training.latency import measure_table

    cfg = load_config("tiny", ["search.candidates=[attention, lsh, dense, identity]", "model.lsh.chunk_len=8"])
    table = measure_table(cfg, 500, ["attention", "lsh", "dense", "identity"], rounds=2, steps=1)
    assert set(table.kinds_ms) == {"attention", "lsh", "dense", "identity"}
    assert all(v >= 0 for v in table.kinds_ms["lsh"].values())
