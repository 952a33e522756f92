"""Off the CPU the model pads three kinds of matrix operand to multiples of 8 for the GPU's fast kernels: a head of
41, the position table's 1+K columns and the output head's logits. Padding must change no number: each is checked
here padded on the CPU (a module's ``pad_multiple`` set to 8) against the same module unpadded, and the padded
shapes on the ``meta`` device, where the rule pads as it does on a GPU."""

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from parnas.config import ModelConfig
from parnas.nn.alignment import PAD_MULTIPLE, pad_multiple, padded_logits, set_pad_multiple
from parnas.nn.blocks import AttentionBlock, causal_bias, rel_shift, sinusoid
from parnas.nn.model import build_fixed_model


class Products(TorchFunctionMode):
    """The operand shapes of every ``torch.bmm`` (``bmm``) and the weight shape of every ``F.linear`` (``linear``)."""

    def __init__(self):
        super().__init__()
        self.bmm, self.linear = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.bmm:
            self.bmm.append((tuple(args[0].shape), tuple(args[1].shape)))
        elif func is F.linear:
            self.linear.append(tuple(args[1].shape))
        return func(*args, **(kwargs or {}))


def test_operands_are_padded_off_the_cpu_unless_a_module_says_otherwise():
    block = AttentionBlock(d_model=82, n_heads=2, dropout=0.0, dropatt=0.0)
    assert pad_multiple(block, torch.device("cpu")) == 1
    assert pad_multiple(block, torch.device("cuda")) == pad_multiple(block, torch.device("meta")) == PAD_MULTIPLE == 8
    block.pad_multiple = 1
    assert pad_multiple(block, torch.device("cuda")) == 1
    block.pad_multiple = 8
    assert pad_multiple(block, torch.device("cpu")) == 8


@pytest.mark.parametrize("d_model, n_heads, M", [(82, 2, 3), (32, 2, 4), (32, 2, 0)],
                         ids=["heads of 41", "heads of 16", "no memory"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_an_attention_block_padded_for_the_gpu_computes_what_it_does_unpadded(d_model, n_heads, M, training):
    """Output and every gradient the same; padded, the position product's operands are multiples of 8 wide."""
    torch.manual_seed(0)
    block = AttentionBlock(d_model, n_heads, dropout=0.0, dropatt=0.0).train(training)
    with torch.no_grad():
        block.u.normal_()
        block.v.normal_()
    L, Dh = 5, d_model // n_heads
    h, mem, pos = torch.randn(2, L, d_model, requires_grad=True), torch.randn(2, M, d_model), sinusoid(M + L, d_model)

    def run(multiple):
        block.pad_multiple = multiple
        with Products() as products:
            out = block(h, mem, pos)
        out.square().sum().backward()
        grads = {name: p.grad.clone() for name, p in block.named_parameters()} | {"h": h.grad.clone()}
        block.zero_grad()
        h.grad = None
        return out.detach(), grads, products.bmm[0]  # the first product: the position scores

    padded, unpadded = run(8), run(1)
    (q, r), (q1, r1) = padded[2], unpadded[2]
    assert q[-1] % 8 == r[1] % 8 == r[2] % 8 == 0 and r[2] >= 1 + M + L
    assert (q1[-1], r1[1], r1[2]) == (Dh, Dh, 1 + M + L)
    torch.testing.assert_close(padded[0], unpadded[0], atol=1e-5, rtol=1e-5)
    for name, grad in unpadded[1].items():
        torch.testing.assert_close(padded[1][name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("M", [0, 3])
def test_the_shift_of_a_wider_table_reads_no_padding_where_a_query_looks(M):
    """Columns after the table's 1+K (padding) are never read where the causal mask lets a query look, and the shift
    stays a view."""
    L, K = 4, M + 4
    table = torch.randn(2, 3, L, 1 + K)
    wide = torch.cat([table, torch.full((2, 3, L, 7), float("nan"))], dim=-1)  # 1+K+7 columns
    visible = causal_bias(L, M, table.device, table.dtype) == 0  # (L, K)
    torch.testing.assert_close(rel_shift(wide, K)[..., visible], rel_shift(table)[..., visible], atol=0, rtol=0)
    assert rel_shift(wide, K).shape == rel_shift(table).shape == (2, 3, L, K)
    assert rel_shift(wide, K).untyped_storage().data_ptr() == wide.untyped_storage().data_ptr()


def test_padded_logits_score_and_differentiate_as_the_unpadded_ones():
    torch.manual_seed(0)
    h, weight, bias = torch.randn(6, 5, requires_grad=True), torch.randn(9, 5, requires_grad=True), torch.randn(9)
    y = torch.randint(9, (6,))
    padded = padded_logits(h, weight, bias, 8)
    assert padded.shape == (6, 16) and torch.isneginf(padded[:, 9:]).all()
    padded_loss = F.cross_entropy(padded, y)
    padded_grads = torch.autograd.grad(padded_loss, [h, weight])
    loss = F.cross_entropy(F.linear(h, weight, bias), y)
    torch.testing.assert_close(padded_loss, loss)
    for got, want in zip(padded_grads, torch.autograd.grad(loss, [h, weight])):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(padded_logits(h, weight, None, 8)[:, :9], F.linear(h, weight))


HEADS = {  # vocabulary 45: a full softmax of 45 logits, adaptive heads of 7 + 2 (shortlist and two tail entries)
    "projected, tied (Dai et al.'s layout)": dict(cutoffs=(7, 20), div_value=1.0, adaptive_input=True,
                                                  tie_weights=True, tie_projs=(False, True, True)),
    "projected, narrower tails": dict(cutoffs=(7, 20), div_value=2.0, adaptive_input=True, tie_weights=True),
    "torch's adaptive": dict(cutoffs=(7, 20), div_value=2.0),
    "full softmax": dict(cutoffs=()),
}


def head_model(head, d_model=20, n_heads=2):
    torch.manual_seed(0)
    cfg = ModelConfig(n_blocks=2, d_model=d_model, n_heads=n_heads, d_ff=32, mem_len=4, dropout=0.0, **head)
    return build_fixed_model(cfg, 45, ["attention", "dense"])


def adam_losses(model, tokens, lr, bf16=False):
    """The losses of an Adam step on each (B, L+1) segment of ``tokens`` in turn, the memory carried (forward and
    loss under CUDA's bf16 autocast if ``bf16``)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses, mems = [], None
    for batch in tokens:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            h, mems = model(batch[:, :-1], mems)
            y = batch[:, 1:]
            loss = model.nll(h, y, model.group_targets(y)).float().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("head", HEADS.values(), ids=HEADS.keys())
def test_a_model_padded_for_the_gpu_trains_as_it_does_unpadded(head):
    """Two Adam steps of a whole model, the memory carried: the same losses and weights padded or not; padded,
    the output head's logits are 16 (adaptive) or 48 (full softmax) wide."""
    tokens = torch.randint(45, (3, 2, 7), generator=torch.Generator().manual_seed(1))

    def train(multiple):
        model = head_model(head)
        set_pad_multiple(model, multiple)
        with Products() as products:
            losses = adam_losses(model, tokens, 1e-2)
        return losses, model.state_dict(), {rows for rows, _ in products.linear}

    padded, unpadded = train(8), train(1)
    width = 16 if head["cutoffs"] else 48
    assert width in padded[2] and width not in unpadded[2]
    assert padded[0] == pytest.approx(unpadded[0], rel=1e-5)
    for name, weight in unpadded[1].items():
        torch.testing.assert_close(padded[1][name], weight, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("head", HEADS.values(), ids=HEADS.keys())
def test_off_the_cpu_a_model_at_odd_widths_pads_as_it_goes(head):
    """A model with heads of 41 on the ``meta`` device (no GPU, nothing allocated), the library's rule as it is:
    the position product and the output head's logits reach their products padded to multiples of 8, and
    forward, loss and backward come back shaped as the unpadded."""
    with torch.device("meta"):
        model = head_model(head, d_model=82, n_heads=2)
    y = torch.randint(45, (2, 6))
    groups = model.group_targets(y)
    x, y = torch.randint(45, (2, 6), device="meta"), y.to("meta")
    with Products() as products:
        h, mems = model(x)
        loss = model.nll(h, y, None if groups is None else groups.to(torch.device("meta"))).mean()
    loss.backward()
    (q, r), = products.bmm
    assert (q[-1], r[1], r[2]) == (48, 48, 8)  # heads of 41 and 1 + 6 columns
    assert (16 if head["cutoffs"] else 48) in {rows for rows, _ in products.linear}
    assert h.shape == (2, 6, 82) and loss.shape == () and all(p.grad is not None for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("head", HEADS.values(), ids=HEADS.keys())
def test_on_cuda_a_model_padded_by_default_trains_as_it_does_unpadded(head):
    """The rule as a user gets it on a GPU (padded, bf16 autocast) against the same model unpadded."""
    tokens = torch.randint(45, (3, 4, 33), generator=torch.Generator().manual_seed(1)).cuda()

    def train(multiple):
        model = head_model(head, d_model=82, n_heads=2).cuda()
        set_pad_multiple(model, multiple)
        return adam_losses(model, tokens, 1e-3, bf16=True)

    assert train(None) == pytest.approx(train(1), rel=2e-2)


@pytest.mark.slow  # a compile of seconds: `make test` runs it, `make test-fast` not
def test_a_compiled_model_padded_computes_what_the_eager_one_does():
    """The padded shapes through Dynamo and Inductor (on the CPU, padding forced): the wider position table's
    shifted view and the padded heads compile, and the compiled model's losses are eager's."""
    from parnas.training.compiling import compile_model

    tokens = torch.randint(45, (3, 2, 9), generator=torch.Generator().manual_seed(1))
    losses = {}
    for name in ("eager", "compiled"):
        model = head_model(HEADS["projected, tied (Dai et al.'s layout)"], d_model=82, n_heads=2)
        set_pad_multiple(model, 8)
        compile_model(model, "none" if name == "eager" else "default")
        losses[name] = adam_losses(model, tokens, 1e-2)
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-5)
