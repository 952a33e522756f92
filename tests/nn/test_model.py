"""Properties of the Transformer-XL core a user relies on: causality, memory, the attention maths."""

import math

import pytest
import torch

from parnas.config import ModelConfig
from parnas.nn.blocks import AttentionBlock, sinusoid
from parnas.nn.model import TransformerXL, build_fixed_model

VOCAB = 97
LAYOUTS = [("attention", "dense", "attention", "dense"), ("attention", "identity", "dense", "attention")]


def tiny(mem_len: int = 8, cutoffs=(20, 60), **kw) -> ModelConfig:
    return ModelConfig(n_blocks=4, d_model=32, n_heads=4, d_ff=48, mem_len=mem_len, dropout=0.0,
                       cutoffs=cutoffs, **kw)


def make(layout, **kw) -> TransformerXL:
    torch.manual_seed(0)
    model = build_fixed_model(tiny(**kw), VOCAB, layout).eval()
    with torch.no_grad():  # non-zero biases so u and v take part in every check
        for p in model.parameters():
            if p.dim() == 2 and p.shape[0] == 4:
                p.normal_(std=0.5)
    return model


def log_probs(model, x, mems=None):
    h, mems = model(x, mems)
    return model.log_probs(h), mems


@pytest.mark.parametrize("layout", LAYOUTS)
def test_causality_changing_token_t_never_changes_earlier_outputs(layout):
    model = make(layout)
    x = torch.randint(0, VOCAB, (2, 12))
    _, mems = log_probs(model, torch.randint(0, VOCAB, (2, 12)))  # a non-empty memory too
    base, _ = log_probs(model, x, mems)
    for t in (0, 5, 11):
        changed = x.clone()
        changed[:, t] = (changed[:, t] + 1) % VOCAB
        out, _ = log_probs(model, changed, mems)
        torch.testing.assert_close(out[:, :t], base[:, :t], atol=0, rtol=0)
        assert not torch.allclose(out[:, t:], base[:, t:])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_memory_equivalence_segment_pair_equals_one_long_pass(layout):
    L = 10
    model = make(layout, mem_len=L)
    x = torch.randint(0, VOCAB, (3, 2 * L))
    whole, _ = log_probs(model, x)
    first, mems = log_probs(model, x[:, :L])
    second, _ = log_probs(model, x[:, L:], mems)
    torch.testing.assert_close(first, whole[:, :L], atol=1e-5, rtol=0)
    torch.testing.assert_close(second, whole[:, L:], atol=1e-5, rtol=0)


def test_memory_is_kept_only_for_attention_blocks_and_capped_at_mem_len():
    model = make(("attention", "dense", "identity", "attention"), mem_len=6)
    _, mems = model(torch.randint(0, VOCAB, (2, 4)))
    assert [m is None for m in mems] == [False, True, True, False]
    assert mems[0].shape == (2, 4, 32)
    _, mems = model(torch.randint(0, VOCAB, (2, 4)), mems)
    assert mems[0].shape == (2, 6, 32) and not mems[0].requires_grad


def test_zero_memory_length_keeps_no_past():
    model = make(LAYOUTS[0], mem_len=0)
    x = torch.randint(0, VOCAB, (2, 5))
    _, mems = model(x)
    assert all(m is None or m.size(1) == 0 for m in mems)
    torch.testing.assert_close(log_probs(model, x, mems)[0], log_probs(model, x)[0])


def reference_attention(block: AttentionBlock, h, mem):
    """Dai et al.'s relative attention written out with einsum and explicit distances."""
    B, L, D = h.shape
    M, H, Dh = mem.size(1), block.n_heads, block.d_head
    c = torch.cat([mem, h], 1)
    q = torch.einsum("bld,ed->ble", h, block.q_weight).view(B, L, H, Dh)
    k, v = torch.einsum("bkd,ed->bke", c, block.kv_weight).view(B, M + L, 2, H, Dh).unbind(2)
    table = sinusoid(M + L, D).flip(0)  # row d = distance d
    distance = (M + torch.arange(L))[:, None] - torch.arange(M + L)[None, :]  # (L, K)
    r = torch.einsum("ijd,ed->ije", table[distance.clamp(min=0)], block.r.weight).view(L, M + L, H, Dh)
    content = torch.einsum("bihd,bjhd->bhij", q + block.u, k)
    position = torch.einsum("bihd,ijhd->bhij", q + block.v, r)
    scores = (content + position) / math.sqrt(Dh)
    scores = scores.masked_fill(distance < 0, float("-inf"))
    a = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v).reshape(B, L, D)
    return block.norm(h + torch.einsum("bld,ed->ble", a, block.out.weight))


@pytest.mark.parametrize("M", [0, 7])
def test_sdpa_attention_equals_einsum_reference(M):
    torch.manual_seed(1)
    block = AttentionBlock(d_model=24, n_heads=3, dropout=0.0, dropatt=0.0).eval()
    with torch.no_grad():
        block.u.normal_()
        block.v.normal_()
    h, mem = torch.randn(2, 5, 24), torch.randn(2, M, 24)
    out = block(h, mem, sinusoid(M + 5, 24))
    torch.testing.assert_close(out, reference_attention(block, h, mem), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cutoffs", [(20, 60), ()])
def test_nll_is_the_log_prob_of_the_target(cutoffs):
    model = make(LAYOUTS[0], cutoffs=cutoffs)
    x, y = torch.randint(0, VOCAB, (2, 6)), torch.randint(0, VOCAB, (2, 6))
    h, _ = model(x)
    lp = model.log_probs(h)
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(2, 6))
    torch.testing.assert_close(model.nll(h, y), -lp.gather(-1, y[..., None]).squeeze(-1), atol=1e-5, rtol=1e-5)


def test_tied_weights_share_the_embedding():
    model = build_fixed_model(tiny(cutoffs=(), tie_weights=True), VOCAB)
    assert model.head.proj.weight is model.embed.weight


def test_block_kinds_follow_the_layout():
    model = build_fixed_model(tiny(), VOCAB, ["dense", "identity", "attention"])
    assert model.block_kinds == ["dense", "identity", "attention"]
    assert build_fixed_model(tiny(), VOCAB).block_kinds == ["attention", "dense"] * 2


def test_decided_identity_blocks_are_never_called_and_change_nothing(monkeypatch):
    """A fixed model does not visit its identity blocks: the same outputs and memories as a model whose identity
    blocks run."""
    from parnas.nn.blocks import IdentityBlock

    layout = ("attention", "identity", "dense", "identity")
    model, x = make(layout), torch.randint(0, VOCAB, (2, 12))
    skipped_out, skipped_mems = log_probs(model, x)
    model._skipped = [False] * len(layout)  # every block visited, as before identity blocks were skipped
    visited_out, visited_mems = log_probs(model, x)
    assert torch.equal(skipped_out, visited_out)
    assert [m is None for m in skipped_mems] == [m is None for m in visited_mems] == [False, True, True, True]
    monkeypatch.setattr(IdentityBlock, "forward", lambda *args: pytest.fail("an identity block was called"))
    log_probs(make(layout), x)


def test_evaluating_on_the_cpu_computes_what_training_computes():
    """On the CPU an attention block in eval mode attends with SDPA's fused kernel (it reads q, k and v in place),
    in training mode with its own product (SDPA's path for a bias that needs gradients is slower): both give the
    same hidden states and memory, segment after segment, so a validation perplexity measures the network that
    trained."""
    torch.manual_seed(0)
    model = build_fixed_model(tiny(), VOCAB, LAYOUTS[1])
    x = torch.randint(0, VOCAB, (3, 6))
    mems = None
    for _ in range(3):  # the memory fills, then slides
        h_train, mems_train = model.train()(x, mems)
        with torch.inference_mode():
            h_eval, mems_eval = model.eval()(x, mems)
        torch.testing.assert_close(h_eval, h_train.detach(), rtol=1e-5, atol=1e-5)
        for a, b in zip(mems_eval, mems_train):  # None: a block that keeps no memory
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5)
        mems = [None if m is None else m.detach() for m in mems_train]
