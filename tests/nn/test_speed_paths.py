"""The faster training paths compute what the paths they replaced computed.

The previous paths are written out here as they were in the library (torch's
dropout, rel-shift by a padded copy, a fresh causal mask, SDPA, memory by
concatenation, ``nn.AdaptiveLogSoftmaxWithLoss``'s forward, torch's default
Adam): with dropout off the two agree to 1e-5; with it on they draw from the
same distribution (keep-rate, scale, mean over many draws).
"""

import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from parnas.config import ModelConfig
from parnas.nn.blocks import (
    AttentionBlock,
    DenseBlock,
    Dropout,
    ReLUDropout,
    causal_bias,
    dropout,
    rel_shift,
    relu_dropout,
    sdpa,
)
from parnas.nn.model import build_fixed_model
from parnas.training.task import adam

VOCAB = 97


# --- the previous paths -----------------------------------------------------------------------

def old_rel_shift(x):
    *batch, L, K = x.shape
    x = F.pad(x, (1, 0)).view(*batch, K + 1, L)[..., 1:, :]
    return x.reshape(*batch, L, K)


def old_attention(self, h, mem, pos):
    B, L, D = h.shape
    M, H, Dh = mem.size(1), self.n_heads, self.d_head
    K = M + L
    c = torch.cat([mem, h], dim=1)
    q = F.linear(c[:, M:], self.q_weight).view(B, L, H, Dh).transpose(1, 2)
    k, v = F.linear(c, self.kv_weight).view(B, K, 2, H, Dh).permute(2, 0, 3, 1, 4)
    r = self.r(pos).view(K, H, Dh).permute(1, 2, 0)
    scale = 1.0 / math.sqrt(Dh)
    position = old_rel_shift((q + self.v[:, None]) @ r)
    future = torch.ones(L, K, dtype=torch.bool).triu_(M + 1)
    bias = (position * scale).masked_fill_(future, float("-inf"))
    a = F.scaled_dot_product_attention(q + self.u[:, None], k, v, attn_mask=bias, scale=scale)
    a = self.out(a.transpose(1, 2).reshape(B, L, D))
    return self.norm(h + F.dropout(a, self.drop.p, self.training))


def old_dropout(self, x):
    return F.dropout(x, self.p, self.training)


def old_relu_dropout(self, x):
    return F.dropout(F.relu(x), self.p, self.training)


def old_update(self, mem, h):
    both = torch.cat([mem, h], dim=1)
    return both[:, max(0, both.size(1) - self.mem_len):].detach()


def old_nll(self, h, y, groups=None):
    return -self.adaptive(h.reshape(-1, h.size(-1)), y.reshape(-1)).output.view(y.shape)


def previous(model):
    """``model`` with every replaced part back on its previous path (same weights)."""
    for m in model.modules():
        if isinstance(m, AttentionBlock):
            m.forward = types.MethodType(old_attention, m)
        elif type(m) is ReLUDropout:
            m.forward = types.MethodType(old_relu_dropout, m)
        elif type(m) is Dropout:
            m.forward = types.MethodType(old_dropout, m)
    model._update = types.MethodType(old_update, model)
    if hasattr(model.head, "adaptive"):
        model.head.nll = types.MethodType(old_nll, model.head)
    return model


def pair(layout, dropout=0.0, cutoffs=(20, 60), mem_len=8):
    """The same model twice: on the current paths and on the previous ones."""
    cfg = ModelConfig(n_blocks=len(layout), d_model=32, n_heads=4, d_ff=48, mem_len=mem_len, dropout=dropout,
                      cutoffs=cutoffs, blocks=tuple(layout))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = build_fixed_model(cfg, VOCAB)
        with torch.no_grad():  # non-zero u, v so the position and content biases take part
            for name, p in model.named_parameters():
                if name.endswith((".u", ".v")):
                    p.normal_(std=0.5)
        models.append(model.train())
    return models[0], previous(models[1])


# --- with dropout off: the same numbers ---------------------------------------------------------

@pytest.mark.parametrize("layout", [("attention", "dense") * 2, ("attention", "identity", "dense", "attention")])
def test_training_step_matches_the_previous_path_with_dropout_off(layout):
    new, old = pair(layout)
    torch.manual_seed(1)
    segments = torch.randint(0, VOCAB, (3, 4, 13))  # 3 segments of 12 tokens (+1 target), memory 8
    mems_new = mems_old = None
    for tokens in segments:
        x, y = tokens[:, :-1], tokens[:, 1:]
        h_new, mems_new = new(x, mems_new)
        h_old, mems_old = old(x, mems_old)
        torch.testing.assert_close(new.log_probs(h_new), old.log_probs(h_old), atol=1e-5, rtol=0)
        nll_new, nll_old = new.nll(h_new, y), old.nll(h_old, y)
        torch.testing.assert_close(nll_new, nll_old, atol=1e-5, rtol=0)
        for a, b in zip(mems_new, mems_old):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.shape == b.shape and not a.requires_grad
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        grads_new = torch.autograd.grad(nll_new.mean(), list(new.parameters()), allow_unused=True)
        grads_old = torch.autograd.grad(nll_old.mean(), list(old.parameters()), allow_unused=True)
        for a, b in zip(grads_new, grads_old):
            if a is None or b is None:  # a tail cluster no target fell in
                assert a is None or not a.any()
                continue
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("M", [0, 7])
def test_cpu_attention_equals_sdpa_the_path_off_the_cpu(M):
    torch.manual_seed(0)
    block = AttentionBlock(d_model=24, n_heads=3, dropout=0.0, dropatt=0.0)
    with torch.no_grad():
        block.u.normal_()
        block.v.normal_()
    h, mem, pos = torch.randn(2, 5, 24), torch.randn(2, M, 24), torch.randn(M + 5, 24)
    ours = block(h, mem, pos)
    block._attend = lambda q, k, v, bias, scale: sdpa(q, k, v, bias, scale, 0.0)  # what CUDA runs
    torch.testing.assert_close(block(h, mem, pos), ours, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, old_attention(block, h, mem, pos), atol=1e-5, rtol=1e-5)


class SdpaCalls(TorchFunctionMode):
    """What reaches ``F.scaled_dot_product_attention``: each call's head size (``seen``), and its query's shape
    and device with its mask's device (``calls``)."""

    def __init__(self):
        super().__init__()
        self.seen, self.calls = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.seen.append(args[0].size(-1))
            self.calls.append((tuple(args[0].shape), args[0].device.type, kwargs["attn_mask"].device.type))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("n_heads, multiple", [(3, 8), (2, 8), (3, 1)])
def test_sdpa_pads_odd_heads_for_the_fused_kernels_and_computes_the_same(n_heads, multiple):
    """Heads of 41 (Dai et al.'s WikiText-103 base) would keep SDPA on its unfused math path on a GPU: they reach
    it padded to a multiple of 8 (1: as they are), with the output and every gradient unchanged."""
    torch.manual_seed(0)
    block = AttentionBlock(d_model=41 * n_heads, n_heads=n_heads, dropout=0.0, dropatt=0.0)
    block.pad_multiple = multiple
    with torch.no_grad():
        block.u.normal_()
        block.v.normal_()
    h, mem, pos = torch.randn(2, 5, 41 * n_heads), torch.randn(2, 4, 41 * n_heads), torch.randn(9, 41 * n_heads)
    h.requires_grad_()
    sizes = SdpaCalls()
    block._attend = lambda q, k, v, bias, scale: sdpa(q, k, v, bias, scale, 0.0, block.pad_multiple)  # off the CPU
    with sizes:
        padded = block(h, mem, pos)
    padded.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in block.named_parameters()} | {"h": h.grad.clone()}
    block.zero_grad()
    h.grad = None
    del block._attend  # the CPU's own path: no SDPA, no padding
    block.pad_multiple = None
    unpadded = block(h, mem, pos)
    unpadded.square().sum().backward()
    assert sizes.seen == [48 if multiple == 8 else 41]
    torch.testing.assert_close(padded, unpadded, atol=1e-5, rtol=1e-5)
    for name, p in [*block.named_parameters(), ("h", h)]:
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_gpu_attention_path_places_and_shapes_its_padded_heads_on_any_device():
    """The path off the CPU, run on the ``meta`` device (no GPU, nothing allocated): at Dai et al.'s WikiText-103
    base widths SDPA gets heads of 48 on the model's device, and output and gradient come back shaped and placed
    like the input."""
    with torch.device("meta"):
        block = AttentionBlock(d_model=410, n_heads=10, dropout=0.1, dropatt=0.1)
        h, mem, pos = torch.randn(2, 6, 410, requires_grad=True), torch.randn(2, 4, 410), torch.randn(10, 410)
    seen = SdpaCalls()
    with seen:
        out = block(h, mem, pos)
    out.sum().backward()
    assert seen.calls == [((2, 10, 6, 48), "meta", "meta")]
    assert out.shape == h.shape == h.grad.shape and out.device.type == h.grad.device.type == "meta"


@pytest.mark.parametrize("M", [0, 3])
def test_rel_shift_view_equals_the_padded_copy(M):
    L = 4
    scores = torch.randn(2, 3, L, M + L)
    padded = F.pad(scores, (1, 0))  # what a zero column in front of the position table yields
    torch.testing.assert_close(rel_shift(padded), old_rel_shift(scores), atol=0, rtol=0)


def test_causal_bias_made_in_inference_mode_serves_training():
    causal_bias.cache_clear()
    with torch.inference_mode():
        made = causal_bias(6, 2, torch.device("cpu"), torch.float32)
    assert not made.is_inference()
    expected = torch.zeros(6, 8).masked_fill_(torch.ones(6, 8, dtype=torch.bool).triu_(3), float("-inf"))
    torch.testing.assert_close(made, expected)
    block = AttentionBlock(d_model=8, n_heads=2, dropout=0.0, dropatt=0.0)
    h = torch.randn(1, 6, 8, requires_grad=True)
    block(h, torch.randn(1, 2, 8), torch.randn(8, 8)).sum().backward()  # the cached bias in a training graph
    assert h.grad is not None and causal_bias(6, 2, torch.device("cpu"), torch.float32) is made


@pytest.mark.parametrize("mem_len,seg_len", [(8, 12), (8, 5), (8, 8), (0, 5)])
def test_memory_is_the_last_mem_len_states_entering_each_attention_block(mem_len, seg_len):
    new, old = pair(("attention", "dense"), mem_len=mem_len)
    mems_new = mems_old = None
    for _ in range(3):
        x = torch.randint(0, VOCAB, (2, seg_len))
        _, mems_new = new(x, mems_new)
        _, mems_old = old(x, mems_old)
        assert mems_new[0].shape == mems_old[0].shape
        torch.testing.assert_close(mems_new[0], mems_old[0], atol=1e-6, rtol=0)


def test_head_nll_and_its_gradient_equal_torchs_adaptive_softmax():
    new, _ = pair(("dense",))
    head = new.head
    h, y = torch.randn(300, 32, requires_grad=True), torch.randint(0, VOCAB, (300,))
    ours, torchs = head.nll(h, y), -head.adaptive(h, y).output
    torch.testing.assert_close(ours, torchs, atol=1e-5, rtol=0)
    weights = torch.rand(300)  # any upstream gradient, not only a mean
    g_ours = torch.autograd.grad((ours * weights).sum(), [h, *head.parameters()])
    g_torch = torch.autograd.grad((torchs * weights).sum(), [h, *head.parameters()])
    for a, b in zip(g_ours, g_torch):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_fused_adam_steps_like_torchs_default_adam():
    torch.manual_seed(0)
    params = [torch.randn(40, 30, requires_grad=True), torch.randn(30, requires_grad=True)]
    twins = [p.detach().clone().requires_grad_() for p in params]
    fused, plain = adam(params, lr=1e-2), torch.optim.Adam(twins, lr=1e-2)
    assert fused.defaults["fused"]
    for _ in range(5):
        grads = [torch.randn_like(p) for p in params]
        for ps, opt in ((params, fused), (twins, plain)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(params, twins):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# --- with dropout on: the same distribution -------------------------------------------------------

@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keeps_with_probability_1_minus_p_and_keeps_the_mean(p):
    n = 2_000_000
    x = torch.ones(n, requires_grad=True)
    torch.manual_seed(0)
    out = dropout(x, p, True)
    kept = out != 0
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * sigma
    assert abs(F.dropout(torch.ones(n), p).ne(0).float().mean().item() - (1 - p)) < 5 * sigma  # torch's, alike
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / (1 - p)))  # inverted scaling
    assert abs(out.mean().item() - 1.0) < 5 * sigma / (1 - p)
    assert abs(kept[1:].float().mul(kept[:-1]).mean().item() - (1 - p) ** 2) < 10 * sigma  # neighbours independent
    grad = torch.randn(n)
    out.backward(grad)
    torch.testing.assert_close(x.grad, grad * kept / (1 - p))  # backward uses the same mask


def test_dropout_masks_follow_the_seed_and_differ_between_calls():
    x = torch.ones(1000)
    torch.manual_seed(3)
    a, b = dropout(x, 0.3, True), dropout(x, 0.3, True)
    torch.manual_seed(3)
    assert torch.equal(dropout(x, 0.3, True), a) and not torch.equal(a, b)


def test_dropout_is_the_identity_in_evaluation_and_at_p_zero():
    x = torch.randn(10)
    assert dropout(x, 0.5, False) is x and dropout(x, 0.0, True) is x
    torch.testing.assert_close(relu_dropout(x, 0.5, False), F.relu(x))


def test_relu_dropout_is_dropout_of_relu_with_the_same_draws():
    x = torch.randn(5000)
    x[:10] = 0.0  # the ReLU's kink: no gradient, as torch's relu
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(5)
    fused = relu_dropout(x1, 0.2, True)
    torch.manual_seed(5)
    plain = dropout(F.relu(x2), 0.2, True)
    torch.testing.assert_close(fused, plain, atol=0, rtol=0)
    grad = torch.randn(5000)
    fused.backward(grad)
    plain.backward(grad)
    torch.testing.assert_close(x1.grad, x2.grad, atol=0, rtol=0)


def test_dense_block_with_dropout_has_the_previous_mean_output():
    torch.manual_seed(0)
    block = DenseBlock(d_model=16, d_ff=64, dropout=0.3).train()
    h = torch.randn(4, 8, 16)
    draws = 400
    with torch.no_grad():
        new = torch.stack([block(h, h[:, :0], h[0]) for _ in range(draws)])
        for m in block.modules():
            if isinstance(m, (Dropout, ReLUDropout)):
                m.forward = types.MethodType(old_relu_dropout if type(m) is ReLUDropout else old_dropout, m)
        old = torch.stack([block(h, h[:, :0], h[0]) for _ in range(draws)])
    stderr = (new.var(0) / draws + old.var(0) / draws).sqrt()
    z = (new.mean(0) - old.mean(0)) / stderr
    assert z.abs().mean() < 1.0  # |N(0,1)| averages 0.8; a biased path would sit far above
    assert (new.std(0) / old.std(0)).median().sub(1).abs() < 0.1


def test_blocks_keep_their_checkpoint_keys():
    """Checkpoints written before the ReLU and its dropout became one module still load."""
    dense = DenseBlock(d_model=8, d_ff=16, dropout=0.1)
    assert set(dense.state_dict()) == {"net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias",
                                       "norm.weight", "norm.bias"}
    attention = AttentionBlock(d_model=8, n_heads=2, dropout=0.1, dropatt=0.0)
    assert set(attention.state_dict()) == {"qkv.weight", "r.weight", "u", "v", "out.weight",
                                           "norm.weight", "norm.bias"}


@pytest.mark.parametrize("part", ["dropout", "attention", "memory", "head", "clusters", "identity", "adam"])
def test_each_previous_path_of_the_training_benchmark_still_takes_a_step(benchmark_script, part):
    """``benchmarks/train_step.py --ablate`` times parnas with one part on its previous path; each must still run
    the model's step as it is called now (the loss given the targets' host groups among them)."""
    from parnas.config import load_config
    from parnas.training.latency import zipf_ids

    train_step = benchmark_script("train_step")
    cfg = load_config("tiny", ["model.dropout=0.1"])
    B, L = cfg.data.batch_size, cfg.data.seg_len
    step = train_step.parnas_step(cfg, 1000, list(cfg.model.layout), (part,))
    tokens = zipf_ids(B * (2 * L + 1), 1000).view(B, -1)
    for t in (0, L):
        step(tokens[:, t:t + L + 1])
