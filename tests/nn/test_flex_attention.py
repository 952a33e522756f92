"""``model.attention_kernel=flex``: FlexAttention reads the relative-position scores inside the kernel and computes
what the CPU path (and SDPA) compute, forward and backward; the setting is checked and travels like a speed switch.

FlexAttention has no backward on the CPU, and the block takes its own path there; so the CPU tests call
:func:`parnas.nn.blocks.flex` itself: compiled (Inductor's CPU kernel) without gradients, and eager with torch's
device check lifted for the backward (torch's reference implementation, whose gradients the GPU kernel must
match). The same block on CUDA, both kernels side by side, is the GPU test at the end.
"""

import math

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

from parnas.config import ModelConfig
from parnas.errors import ConfigError
from parnas.nn import blocks
from parnas.nn.blocks import AttentionBlock, causal_bias, flex, rel_shift, sinusoid
from parnas.training.resume import RESUMABLE_CHANGES
from tests.gpu.test_gpu import assert_same_block_results, block_forward_backward


def attention_inputs(H=2, B=3, L=8, M=12, Dh=16, grad=False):
    """q (H, B, L, Dh), k and v (H, B, K, Dh), unshifted position scores (H, B, L, 1+K) with the zero column."""
    torch.manual_seed(0)
    K = M + L
    q, k, v = torch.randn(H, B, L, Dh), torch.randn(H, B, K, Dh), torch.randn(H, B, K, Dh)
    position = torch.cat([torch.zeros(H, B, L, 1), torch.randn(H, B, L, K)], dim=-1)
    return [t.requires_grad_(grad) for t in (q, k, v, position)]


def cpu_path(q, k, v, position, scale):
    """What the block computes on the CPU: the shifted, masked position bias, then softmax(bias + scale q k^T) v."""
    H, B, L, Dh = q.shape
    K = k.size(2)
    block = AttentionBlock(d_model=H * Dh, n_heads=H, dropout=0.0, dropatt=0.0)
    bias = torch.add(causal_bias(L, K - L, q.device, q.dtype), rel_shift(position), alpha=scale)
    return block._attend(q, k, v, bias, scale)


# Inductor's CPU FlexAttention kernel (torch 2.13) at 8 keys and no memory gave wrong or NaN rows on an AMD EPYC
# CPU, depending on the thread count and on what was compiled before it in the process, while the eager reference
# agreed; the flex path runs off the CPU only, where the GPU test checks it at every memory length
CPU_KERNEL_FLAKY = pytest.mark.xfail(reason="Inductor's CPU flex kernel at 8 keys, no memory", strict=False)


@pytest.mark.parametrize("M, Dh", [(12, 16), pytest.param(0, 16, marks=CPU_KERNEL_FLAKY), (20, 41)])
@pytest.mark.slow
def test_the_compiled_flex_kernel_computes_what_the_cpu_path_does(M, Dh):
    """The kernel a compiled model gets: each query sees exactly the keys up to its own position, each score
    offset by the position score at its distance (no memory, a memory longer than the segment, heads of 41)."""
    q, k, v, position = attention_inputs(M=M, Dh=Dh)
    scale = 1 / math.sqrt(Dh)
    with torch.no_grad():
        torch.testing.assert_close(flex(q, k, v, position, scale), cpu_path(q, k, v, position, scale),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # a compile or a training run of seconds: `make test` runs it, `make test-fast` not
def test_the_flex_kernel_is_compiled_once_per_shape():
    """Every attention block calls it with fresh tensors and a fresh position closure every step: nothing is
    compiled again for them."""
    from torch._dynamo.utils import counters

    with torch.no_grad():
        flex(*attention_inputs(M=4), 0.25)
        graphs = counters["stats"]["unique_graphs"]
        for _ in range(3):
            flex(*attention_inputs(M=4), 0.25)  # fresh tensors, a fresh closure
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("M", [12, 0])
def test_flex_gradients_reach_the_position_scores_as_the_cpu_path_sends_them(monkeypatch, M):
    """The relative-position scores are a captured tensor of the kernel, not an input: their gradient (and so
    W_r's and the position bias v's) must still come back, equal to the CPU path's, and so must q's, k's and v's."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)  # torch's reference backward
    monkeypatch.setattr(blocks, "compiled_flex_attention", lambda: flex_module.flex_attention)  # run it eagerly
    q, k, v, position = attention_inputs(M=M, grad=True)
    scale = 0.25
    out = flex(q, k, v, position, scale)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, position), grad)
    want = torch.autograd.grad(cpu_path(q, k, v, position, scale), (q, k, v, position), grad)
    for name, a, b in zip("q k v position".split(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    assert got[3][..., 0].abs().max() == 0  # the zero column scores no pair


def test_the_blocks_flex_path_places_everything_on_the_models_device(monkeypatch):
    """Off the CPU the block takes the flex path; on the ``meta`` device (no GPU needed) it must hand FlexAttention
    q, k, v and the position scores on the model's device, build its block mask there, and give an output and a
    gradient shaped and placed like the input (heads of 41, a memory)."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)  # torch's reference backward
    monkeypatch.setattr(blocks, "compiled_flex_attention", lambda: flex_module.flex_attention)  # run it eagerly
    handed = []

    def recorded(q, k, v, position, scale):
        handed.append([t.device.type for t in (q, k, v, position)])
        return flex(q, k, v, position, scale)

    monkeypatch.setattr(blocks, "flex", recorded)
    torch._dynamo.reset()  # eager FlexAttention traces itself; a trace made for other shapes would go dynamic here
    meta = torch.device("meta")
    block = AttentionBlock(d_model=410, n_heads=10, dropout=0.0, dropatt=0.0, kernel="flex").to(meta)
    h = torch.randn(2, 6, 410, device=meta, requires_grad=True)
    out = block(h, torch.randn(2, 4, 410, device=meta), sinusoid(10, 410, meta))
    out.sum().backward()
    assert handed == [["meta"] * 4]
    assert out.shape == h.shape and out.device == meta and h.grad.shape == h.shape and h.grad.device == meta


def test_flex_is_refused_with_attention_dropout_and_unknown_kernels_are_named():
    with pytest.raises(ConfigError, match=r"^model.attention_kernel=flex has no attention dropout: set model.dropatt"):
        ModelConfig(attention_kernel="flex", dropatt=0.1)
    with pytest.raises(ConfigError, match=r"^model.attention_kernel must be one of sdpa, flex, not 'triton'$"):
        ModelConfig(attention_kernel="triton")
    with pytest.raises(ValueError, match="no attention dropout"):
        AttentionBlock(d_model=32, n_heads=2, dropout=0.0, dropatt=0.1, kernel="flex")


def test_the_kernel_is_a_speed_switch_every_attention_block_takes_and_a_resume_may_change():
    """The same weights and function: a run trained with one kernel resumes with the other, and every block that
    attends (PAR's, the Universal Transformer's, the variants') is built with the configured kernel."""
    from parnas.nn.model import build_fixed_model

    assert "model.attention_kernel" in RESUMABLE_CHANGES
    layout = ["attention", "ut", "shared", "compressive"]
    settings = dict(n_blocks=4, d_model=32, n_heads=2, d_ff=64, cutoffs=())
    model = build_fixed_model(ModelConfig(**settings, attention_kernel="flex"), 50, layout)
    attentions = [m for m in model.modules() if isinstance(m, AttentionBlock)]
    assert len(attentions) == 4 and all(m.kernel == "flex" for m in attentions)
    sdpa_model = build_fixed_model(ModelConfig(**settings), 50, layout)
    assert model.state_dict().keys() == sdpa_model.state_dict().keys()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flex_trains_like_sdpa_on_cuda(precision, compiled):
    """One block, the same weights and inputs, forward and backward with either kernel: the same output and
    gradients, at Dai et al.'s heads of 41 and a memory longer than the segment; and in a compiled forward."""
    torch.manual_seed(0)
    block = AttentionBlock(d_model=410, n_heads=10, dropout=0.0, dropatt=0.0).cuda()
    h = torch.randn(4, 48, 410, device="cuda", requires_grad=True)
    mem, pos = torch.randn(4, 80, 410, device="cuda"), sinusoid(128, 410, torch.device("cuda"))
    call = torch.compile(block, dynamic=False) if compiled else block

    def run(kernel):
        block.kernel = kernel
        return block_forward_backward(call, block, h, mem, pos, precision)

    assert_same_block_results(run("flex"), run("sdpa"), precision)
