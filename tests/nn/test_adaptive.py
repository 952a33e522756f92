"""Adaptive input and the projected adaptive softmax tied to it: Dai et al.'s Transformer-XL, parameter for
parameter. The reference comparison imports their ``mem_transformer.py`` from a local checkout of
github.com/kimiyoung/transformer-xl's ``pytorch/`` folder named by PARNAS_TXL_REF, and skips without one."""

import os
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from parnas.config import ModelConfig, load_config
from parnas.errors import ConfigError
from parnas.nn.model import build_fixed_model

SEED = dict(n_blocks=12, d_model=128, n_heads=4, d_ff=512, cutoffs=(250, 2500), div_value=4.0, adaptive_input=True,
            share_position_bias=True)
WT103 = dict(n_blocks=32, d_model=410, n_heads=10, d_ff=2100, cutoffs=(20000, 40000, 200000), div_value=1.0,
             adaptive_input=True, tie_weights=True, tie_projs=(False, True, True, True), share_position_bias=True)


def parameters(vocab_size: int, **settings) -> int:
    with torch.device("meta"):  # nothing allocated: WT103 base is 151M parameters
        model = build_fixed_model(ModelConfig(**settings), vocab_size)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("vocab_size, settings, expected", [
    (12000, {**SEED, "tie_weights": True, "tie_projs": (False, True, True)}, 1_515_266),
    (12000, SEED, 1_700_386),
    (267_735, WT103, 151_107_538),
])
def test_parameter_counts_equal_dai_et_als(vocab_size, settings, expected):
    """MemTransformerLM's counts at the original TensorFlow PAR Transformer-XL's shapes (tied and untied) and at
    WikiText-103 base."""
    assert parameters(vocab_size, **settings) == expected


def small(div_value: float, **extra) -> ModelConfig:
    return ModelConfig(n_blocks=4, d_model=32, n_heads=2, d_ff=64, mem_len=8, dropout=0.0, cutoffs=(50, 150),
                       div_value=div_value, adaptive_input=True, share_position_bias=True, **extra)


@pytest.mark.parametrize("div_value", [1.0, 2.0])
@pytest.mark.parametrize("tied", [False, True])
def test_nll_is_the_log_prob_of_the_target_and_tied_weights_learn_from_both_ends(div_value, tied):
    torch.manual_seed(0)
    cfg = small(div_value, tie_weights=tied, tie_projs=(False, True, True) if tied else ())
    model = build_fixed_model(cfg, 300).eval()
    x, y = torch.randint(0, 300, (2, 12)), torch.randint(0, 300, (2, 12))
    h, _ = model(x)
    logp = model.log_probs(h)
    assert torch.allclose(logp.exp().sum(-1), torch.ones(2, 12), atol=1e-5)
    nll = model.nll(h, y)
    torch.testing.assert_close(nll, -logp.gather(-1, y[..., None]).squeeze(-1), atol=1e-5, rtol=1e-5)
    nll.sum().backward()
    head = model.head.projected
    assert (head.out_layers[0].weight is model.embed.layers[0].weight) == tied
    if div_value > 1:
        assert (head.out_projs[1] is model.embed.projs[1]) == tied and head.out_projs[0] is not model.embed.projs[0]


@pytest.mark.parametrize("settings", [dict(adaptive_input=False), dict(div_value=1.0), dict(div_value=4.0),
                                      dict(div_value=1.0, tie_weights=True, tie_projs=(False, True, True))])
def test_targets_grouped_on_the_host_give_the_loss_and_gradients_grouped_on_the_device(settings):
    """What the training loop does (the targets grouped where the batch is made, the groups moved with it) is the
    loss the device's own grouping gives, bit for bit, and so are the gradients: torch's adaptive softmax and the
    projected one, tied or not. Groups of another batch's shape are refused, not misread."""
    torch.manual_seed(0)
    model = build_fixed_model(replace(small(2.0), **settings), 300)
    x, y = torch.randint(0, 300, (3, 12)), (torch.rand(3, 12) ** 3 * 300).long()  # every cluster, most in the head
    groups = model.group_targets(y)
    assert sum(groups.sizes) == y.numel() and len(groups.sizes) == 3 and min(groups.sizes) > 0
    losses, grads = [], []
    for given in (None, groups):
        model.zero_grad()
        nll = model.nll(model(x)[0], y, given)
        nll.sum().backward()
        losses.append(nll.detach())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert torch.equal(*losses) and all(torch.equal(a, b) for a, b in zip(*grads)) and len(grads[0]) == len(grads[1])
    with pytest.raises(ValueError, match="target groups of 36 rows for 24 targets"):
        model.nll(model(x[:2])[0], y[:2], groups)


def test_a_capacity_grows_by_a_sixteenth_of_the_rows_only_when_a_batch_needs_it():
    """Fixed capacities are what keep a compiled loss's shapes: they hold every count seen, rounded up to a
    sixteenth of the rows (multiples of 8), never shrink, never exceed the rows, and each batch size has its own."""
    from parnas.nn.adaptive import TargetCapacity

    capacity = TargetCapacity()
    assert capacity.fit(4096, (894, 587)) == (1024, 768)  # wt2-par's 32 x 128 batch, tails' mean counts
    assert capacity.fit(4096, (1015, 0)) == (1024, 768)  # held: nothing recompiles
    assert capacity.fit(4096, (1025, 100)) == (1280, 768)  # grown by the quantum
    assert capacity.fit(32, (0, 31)) == (0, 32) and capacity.fit(32, (3, 32)) == (8, 32)  # quantum 8, at most 32
    assert capacity.by_rows[4096] == (1280, 768)


@pytest.mark.parametrize("settings", [dict(adaptive_input=False), dict(div_value=4.0),
                                      dict(div_value=1.0, tie_weights=True, tie_projs=(False, True, True))])
def test_targets_padded_to_fixed_capacities_give_the_same_loss_and_gradients(settings):
    """Padded tail clusters (row 0 standing in, masked) change no loss and no gradient, torch's adaptive softmax's
    or the projected one's, including a batch with no row in a cluster whose capacity is not 0; the shapes stay
    the first batch's, and the fair step's copies stacked keep each copy's padding masked."""
    from parnas.nn.adaptive import TargetCapacity
    from parnas.strategies.fair import stacked_groups

    torch.manual_seed(0)
    model = build_fixed_model(replace(small(2.0), **settings), 300)
    capacity = TargetCapacity()
    x = torch.randint(0, 300, (3, 12))
    first = torch.randint(0, 300, (3, 12))
    first[0, 0] = 0  # row 0, which padding stands in for, a shortlist target: out of every tail cluster's range
    batches = [first, torch.where(first < 150, first, 7), (torch.rand(3, 12) ** 3 * 300).long() * (first > 0)]
    def loss_and_grads(groups, y, copies=1):
        model.zero_grad()
        nll = model.nll(model(x.repeat(copies, 1))[0], y.repeat(copies, 1), groups)
        nll.sum().backward()
        return nll.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]

    shapes = set()
    for y in batches:
        padded = model.group_targets(y, capacity)
        shapes.add((padded.sizes, padded.order.shape))
        assert padded.sizes[0] == 0 and int(padded.valid.sum()) == sum(model.group_targets(y).sizes[1:])
        expected, expected_grads = loss_and_grads(model.group_targets(y), y)
        for copies, groups in ((1, padded), (2, stacked_groups(padded, 2, y.numel()))):
            nll, grads = loss_and_grads(groups, y, copies)
            torch.testing.assert_close(nll, expected.repeat(copies, 1), rtol=1e-6, atol=1e-6)
            for a, b in zip(expected_grads, grads, strict=True):
                torch.testing.assert_close(b, a * copies, rtol=1e-5, atol=1e-6)
    assert len(shapes) == 1, shapes
    assert batches[1].ge(150).sum() == 0  # the second batch has no row in the last cluster, which has a capacity


def test_padded_entries_are_scored_against_targets_inside_their_clusters_range():
    """A padded entry stands in with row 0, whose target is another cluster's: the CPU's gather reads an index out
    of range without a word, a GPU's asserts. Each tail cluster's targets, padding included, are in its range."""
    from parnas.nn.adaptive import TargetCapacity, add_tail_nll, group_targets

    edges = [0, 50, 150, 300]

    class InRange(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, target):
            assert 0 <= int(target.min()) and int(target.max()) < logits.size(1), (target, logits.shape)
            return logits[:, 0]

    y = torch.tensor([0, 60, 61, 200, 5, 6, 7, 8])  # row 0 in the shortlist; tail 1 two rows, tail 2 one
    groups = group_targets(y, edges[1:-1], TargetCapacity())
    assert groups.sizes == (0, 8, 8) and groups.valid.sum() == 3
    add_tail_nll(torch.zeros(8), torch.randn(8, 4), y, groups, edges,
                 lambda i, h: torch.randn(len(h), edges[i + 1] - edges[i]), InRange)


def test_the_adaptive_input_is_each_ids_own_clusters_embedding():
    """Every id looked up in every cluster's table, masked, is the id's own cluster's embedding projected."""
    torch.manual_seed(0)
    embed = build_fixed_model(small(4.0), 300).embed
    ids = torch.tensor([[0, 49, 50, 149, 150, 299]])
    expected = [embed.layers[c].weight[i - low] @ embed.projs[c].t() for i in ids[0].tolist()
                for c, low in [(0, 0) if i < 50 else (1, 50) if i < 150 else (2, 150)]]
    torch.testing.assert_close(embed(ids)[0], torch.stack(expected))


def test_bf16_mixed_loss_with_the_tied_head_is_the_fp32_loss():
    torch.manual_seed(0)
    model = build_fixed_model(small(2.0, tie_weights=True, tie_projs=(False, True, True)), 300).eval()
    x, y = torch.randint(0, 300, (4, 16)), torch.randint(0, 300, (4, 16))
    fp32 = model.nll(model(x)[0], y).mean()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = model.nll(model(x)[0], y).float().mean()
    assert bf16.dtype == torch.float32 and abs(bf16.item() - fp32.item()) < 0.02 * fp32.item()


@pytest.mark.parametrize("settings, needle", [
    (["model.adaptive_input=true", "model.cutoffs=[]"], "model.adaptive_input needs model.cutoffs"),
    (["model.tie_weights=true"], "needs model.adaptive_input=true"),
    (["model.adaptive_input=true", "model.tie_projs=[false, true]"], "model.tie_projs has 2 entries"),
    (["model.tie_projs=[false, true, true]"], "set model.adaptive_input"),
    (["model.adaptive_input=true", "model.div_value=2.5"], "must be a whole number"),
    (["model.adaptive_input=true", "model.div_value=64"], "clusters 0 wide"),
])
def test_settings_that_cannot_be_built_are_refused(settings, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config("tiny", settings)


# --- against Dai et al.'s code, weights copied --------------------------------------------------------------------

REF = os.environ.get("PARNAS_TXL_REF")


def reference_class():
    sys.path[:0] = [REF, str(Path(REF) / "utils")]
    cuda, torch.version.cuda = torch.version.cuda, torch.version.cuda or "0.0"  # read at its import
    try:
        from mem_transformer import MemTransformerLM
    finally:
        torch.version.cuda = cuda
    return MemTransformerLM


def copy_into(ours, theirs, cfg: ModelConfig) -> None:
    """MemTransformerLM's weights into parnas's model (attention and dense blocks alternate)."""
    ours_state = ours.state_dict()
    new = {}
    for name, value in theirs.state_dict().items():
        if name.startswith("word_emb.emb_layers."):
            new[name.replace("word_emb.emb_layers.", "embed.layers.")] = value
        elif name.startswith("word_emb.emb_projs."):
            new[name.replace("word_emb.emb_projs.", "embed.projs.")] = value
        elif name.startswith("crit."):
            new[name.replace("crit.", "head.projected.")] = value
        elif name in ("r_w_bias", "r_r_bias"):
            for i in range(0, cfg.n_blocks, 2):
                new[f"blocks.{i}.{'u' if name == 'r_w_bias' else 'v'}"] = value
        elif name.startswith("layers."):
            layer, rest = int(name.split(".")[1]), name.split(".", 2)[2]
            a, d = f"blocks.{2 * layer}.", f"blocks.{2 * layer + 1}."
            if rest == "dec_attn.qkv_net.weight":
                new[a + "qkv.weight"] = value  # the same rows: queries, keys, values
            else:
                new.update({a + "r.weight": value} if rest == "dec_attn.r_net.weight" else
                           {a + "out.weight": value} if rest == "dec_attn.o_net.weight" else
                           {a + rest.split(".", 1)[1].replace("layer_norm", "norm"): value}
                           if rest.startswith("dec_attn.layer_norm") else
                           {d + "net." + rest.split("CoreNet.", 1)[1]: value} if "CoreNet" in rest else
                           {d + "norm." + rest.rsplit(".", 1)[1]: value})
    assert set(new) >= set(ours_state) - {k for k in ours_state if k.startswith("head.projected.out_layers")}
    ours.load_state_dict({k: v for k, v in new.items() if k in ours_state}, strict=False)


@pytest.mark.skipif(not REF, reason="PARNAS_TXL_REF (a checkout of transformer-xl's pytorch/ folder) not set")
@pytest.mark.parametrize("div_value", [1.0, 4.0])
def test_log_probabilities_equal_mem_transformer_lms_with_its_weights(div_value):
    MemTransformerLM = reference_class()
    cfg = ModelConfig(n_blocks=4, d_model=64, n_heads=2, d_ff=96, mem_len=8, dropout=0.0, cutoffs=(50, 150),
                      div_value=div_value, adaptive_input=True, tie_weights=True, tie_projs=(False, True, True),
                      share_position_bias=True)
    torch.manual_seed(0)
    theirs = MemTransformerLM(300, 2, 2, 64, 32, 96, 0.0, 0.0, tie_weight=True, d_embed=64, div_val=int(div_value),
                              tie_projs=[False, True, True], pre_lnorm=False, tgt_len=12, ext_len=0, mem_len=8,
                              cutoffs=[50, 150], same_length=False, attn_type=0, clamp_len=-1, sample_softmax=-1)
    for p in theirs.parameters():  # its constructor leaves several torch.Tensor(...) uninitialised
        torch.nn.init.normal_(p, std=0.1)
    for layer in theirs.layers:  # it builds uint8 masks, which masked_fill no longer takes
        attn = layer.dec_attn
        attn.forward = types.MethodType(
            lambda self, w, r, rw, rr, attn_mask=None, mems=None, inner=attn.forward:
            inner(w, r, rw, rr, attn_mask=None if attn_mask is None else attn_mask.bool(), mems=mems), attn)
    theirs.crit.keep_order = True
    ours = build_fixed_model(cfg, 300)
    copy_into(ours, theirs, cfg)
    theirs.double().eval(), ours.double().eval()
    stream = torch.randint(0, 300, (2, 25))
    mems_theirs, mems_ours = tuple(), None
    for t in (0, 12):
        x, y = stream[:, t:t + 12], stream[:, t + 1:t + 13]
        ret = theirs(x.t().contiguous(), y.t().contiguous(), *mems_theirs)
        nll_theirs, mems_theirs = ret[0].t(), tuple(ret[1:])  # (B, L)
        h, mems_ours = ours(x, mems_ours)
        torch.testing.assert_close(ours.nll(h, y).double(), nll_theirs, atol=1e-5, rtol=1e-5)
