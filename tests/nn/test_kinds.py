"""The built-in block kinds beyond PAR's three: each computes its source's formula, is causal through
the whole model with memory, keeps memory equivalence where it promises it, and (compressive) keeps the
compressed memory its rate and function say; shared kinds share their weights."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from parnas import kinds
from parnas.config import ModelConfig
from parnas.kinds.builtin import CompressiveSettings, ConvSettings, MoESettings
from parnas.nn.blocks import sinusoid
from parnas.nn.model import build_fixed_model
from parnas.search_spaces import PARTransformerXLSpace, fixed_model

VOCAB = 97
NEW_KINDS = ("conv", "glu", "sqrelu", "compressive", "shared", "attention_half", "attention_quarter", "dense_half",
             "dense_double", "moe")


TOP_2 = MoESettings(top_k=2)


def tiny(conv_kernel=5, compress_rate=2, compress_len=4, compress_fn="conv", moe=TOP_2, **kw) -> ModelConfig:
    settings = {"conv": ConvSettings(conv_kernel), "compressive": CompressiveSettings(compress_rate, compress_len,
                                                                                      compress_fn), "moe": moe}
    values = dict(n_blocks=4, d_model=32, n_heads=4, d_ff=48, mem_len=8, dropout=0.0, cutoffs=(20, 60),
                  kind_settings=settings) | kw
    return ModelConfig(**values)


def make(layout, **kw):
    torch.manual_seed(0)
    model = build_fixed_model(tiny(n_blocks=len(layout), **kw), VOCAB, layout).eval()
    with torch.no_grad():  # non-zero biases, so every parameter takes part in the checks
        for p in model.parameters():
            if p.dim() == 1 or p.dim() == 2 and p.shape[0] == 4:
                p.normal_(std=0.3)
    return model


def log_probs(model, x, mems=None):
    h, mems = model(x, mems)
    return model.log_probs(h), mems


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_causality_changing_token_t_never_changes_earlier_outputs(kind):
    model = make(("attention", kind, kind, "dense"), mem_len=6)
    mems = None
    for _ in range(3):  # a full memory (and, for compressive, a compressed one)
        _, mems = log_probs(model, torch.randint(0, VOCAB, (2, 7)), mems)
    if kind == "compressive":
        assert mems[-2].size(1) > 0
    x = torch.randint(0, VOCAB, (2, 7))
    base, _ = log_probs(model, x, mems)
    for t in (0, 3, 6):
        changed = x.clone()
        changed[:, t] = (changed[:, t] + 1) % VOCAB
        out, _ = log_probs(model, changed, mems)
        torch.testing.assert_close(out[:, :t], base[:, :t], atol=0, rtol=0)
        assert not torch.allclose(out[:, t:], base[:, t:])


@pytest.mark.parametrize("kind", ["conv", "glu", "sqrelu", "shared", "attention_half", "dense_double", "moe"])
def test_memory_equivalence_segment_pair_equals_one_long_pass(kind):
    L = 6  # conv: mem_len >= kernel - 1 carries the whole left context
    ample = MoESettings(capacity_factor=4.0)  # no routing dropped, whatever the segment's length
    model = make((kind, "attention", kind, "dense"), mem_len=L, moe=ample)
    x = torch.randint(0, VOCAB, (3, 2 * L))
    whole, _ = log_probs(model, x)
    first, mems = log_probs(model, x[:, :L])
    second, _ = log_probs(model, x[:, L:], mems)
    torch.testing.assert_close(first, whole[:, :L], atol=1e-5, rtol=0)
    torch.testing.assert_close(second, whole[:, L:], atol=1e-5, rtol=0)


def test_conv_is_a_glu_then_a_causal_depthwise_separable_convolution():
    block = make(("conv",), conv_kernel=4).blocks[0]
    h = torch.randn(2, 9, 32)
    u = F.glu(block.gate(h), dim=-1).transpose(1, 2)  # (B, D, L)
    conv = F.conv1d(F.pad(u, (3, 0)), block.depthwise.weight, block.depthwise.bias, groups=32)  # causal, zeros left
    expected = block.norm(h + block.pointwise(conv.transpose(1, 2)))
    torch.testing.assert_close(block(h, h[:, :0], None), expected)


def test_glu_is_swiglu_at_two_thirds_width_and_sqrelu_is_dense_with_relu_squared():
    h = torch.randn(2, 5, 32)
    glu = make(("glu",)).blocks[0]
    w, v = glu.wv.weight.chunk(2)
    torch.testing.assert_close(glu(h, h[:, :0], None), glu.norm(h + (F.silu(h @ w.T) * (h @ v.T)) @ glu.w2.weight.T))
    assert w.shape == (2 * 48 // 3, 32)
    sq = make(("sqrelu",)).blocks[0]
    expected = sq.norm(h + sq.w2(F.relu(sq.w1(h)) ** 2))
    torch.testing.assert_close(sq(h, h[:, :0], None), expected)


def test_feed_forward_variants_hold_as_many_weights_as_dense():
    def count(kind):
        return sum(p.numel() for p in make((kind,)).blocks[0].parameters())

    D, d_ff = 32, 48
    assert count("sqrelu") == count("dense")
    assert 2 * D * d_ff - 3 * D <= count("glu") - 2 * D <= 2 * D * d_ff  # matrices only (LayerNorm aside)


# --- compressive ---------------------------------------------------------------------------------

def stream(model, x, L):
    """Feed x (B, T) in segments of L; the memories after the last one."""
    mems = None
    for t in range(0, x.size(1), L):
        _, mems = model(x[:, t:t + L], mems)
    return mems


@pytest.mark.parametrize("fn", ["mean", "max", "conv"])
@pytest.mark.parametrize("L, c", [(4, 2), (4, 3), (1, 3)])  # c not dividing L: groups span segments
def test_compressed_memory_is_f_c_of_the_evicted_states_in_groups_of_c(fn, L, c):
    mem_len, n_cm, T = 4, 3, 24
    model = make(("compressive",), mem_len=mem_len, compress_rate=c, compress_len=n_cm, compress_fn=fn)
    block = model.blocks[0]
    x = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        compressed, pending = stream(model, x, L)[1:]
        states = model.embed(x) * 32 ** 0.5  # what entered block 0 (dropout 0)
        evicted = states[:, :T - mem_len]  # the plain memory keeps the last mem_len
        n = evicted.size(1) // c * c
        groups = evicted[:, :n].transpose(1, 2)  # (B, D, n)
        expected = {"mean": lambda g: F.avg_pool1d(g, c), "max": lambda g: F.max_pool1d(g, c),
                    "conv": lambda g: block.compressor(g)}[fn](groups).transpose(1, 2)[:, -n_cm:]
    torch.testing.assert_close(compressed, expected)
    torch.testing.assert_close(pending, evicted[:, n:])


def test_the_block_attends_its_compressed_memory_and_evaluation_carries_it():
    from parnas.training.evaluation import evaluate

    model = make(("compressive", "dense"), mem_len=4, compress_fn="mean")
    x = torch.randint(0, VOCAB, (2, 12))
    mems = stream(model, x, 4)
    assert mems[2].shape == (2, 4, 32)  # block 0's compressed memory: 8 evicted states at c=2
    y = torch.randint(0, VOCAB, (2, 4))
    with_memory, _ = log_probs(model, y, mems)
    without, _ = log_probs(model, y, mems[:2] + [mems[2][:, :0], mems[3]])
    assert not torch.allclose(with_memory, without)
    # evaluate() passes the memories from segment to segment: its NLL is the streamed one
    batches = [(x[:, t:t + 4], (x[:, t:t + 4] + 1) % VOCAB) for t in range(0, 12, 4)]
    mems, total = None, 0.0
    for xb, yb in batches:
        h, mems = model(xb, mems)
        total += model.nll(h, yb).double().sum().item()
    assert evaluate(model, batches).nll == pytest.approx(total, rel=1e-6)


def test_attention_reconstruction_loss_trains_only_the_compression():
    model = make(("compressive",), mem_len=4, compress_fn="conv").train()
    block = model.blocks[0]
    mems = None
    for _ in range(2):
        _, mems = model(torch.randint(0, VOCAB, (2, 4)), mems)
    assert torch.is_tensor(model.aux_loss) and model.aux_loss > 0
    model.aux_loss.backward()
    assert block.compressor.weight.grad.abs().sum() > 0
    assert all(p.grad is None for name, p in model.named_parameters() if "compressor" not in name)
    model.eval()
    model(torch.randint(0, VOCAB, (2, 4)), mems)
    assert model.aux_loss == 0.0  # evaluation computes none


def synthetic_run(*overrides):
    from parnas.config import load_config

    cfg = load_config("tiny", ["model.n_blocks=2", "model.cutoffs=[]", "model.mem_len=8", "data.seg_len=8",
                               "train.max_steps=6", "train.eval_every=10000", "model.compressive.fn=conv",
                               "model.compressive.rate=4", *overrides])
    tokens = np.random.default_rng(0).integers(0, VOCAB, 4000).astype(np.int32)
    return cfg, {"train": tokens, "valid": tokens[:400], "test": tokens[:400]}


def test_aux_loss_trains_the_compression_in_training(tmp_path):
    from parnas.training.data_module import SegmentData
    from parnas.training.task import LanguageModelTask
    from parnas.training.trainer import build_trainer, position_restored_by_task

    cfg, splits = synthetic_run("model.blocks=[compressive,dense]")
    model = build_fixed_model(cfg.model, VOCAB)
    before = model.blocks[0].compressor.weight.detach().clone()  # only the reconstruction loss reaches it
    task = LanguageModelTask(cfg.train)
    task.set_model(model)
    with position_restored_by_task():
        build_trainer(cfg.train, tmp_path, enable_progress_bar=False, callbacks=[]).fit(
            task, datamodule=SegmentData(splits, 8, 8, 8))
    assert not torch.equal(before, model.blocks[0].compressor.weight)


def test_aux_loss_trains_the_compression_in_search(tmp_path):
    from parnas.strategies.search import build_search

    cfg, splits = synthetic_run("search.candidates=[attention,compressive]")
    search = build_search(cfg, splits, VOCAB, tmp_path)
    compressors = [m.compressor for m in search.supernet.modules() if hasattr(m, "compressor")]
    before = [c.weight.detach().clone() for c in compressors]
    search.run()
    assert len(compressors) == 2 and all(not torch.equal(b, c.weight) for b, c in zip(before, compressors))


# --- shared weights ------------------------------------------------------------------------------

def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_shared_blocks_hold_one_set_of_weights_whatever_the_depth():
    four = make(("shared",) * 4)
    one = make(("shared", "identity", "identity", "identity"))
    assert parameters(four) == parameters(one)
    assert all(b.core is four.blocks[0].core for b in four.blocks)
    unshared = make(("attention", "dense") * 4)  # the same layer, 4 times, untied
    assert parameters(unshared) - parameters(make(("identity",) * 4)) == 4 * (parameters(one) - parameters(
        make(("identity",) * 4)))
    h, pos = torch.randn(2, 3, 32), sinusoid(3, 32)  # the timestep signal tells the depths apart
    assert not torch.allclose(four.blocks[0](h, h[:, :0], pos), four.blocks[1](h, h[:, :0], pos))


def test_the_supernet_and_the_fixed_model_share_one_module_per_shared_kind():
    cfg = tiny(n_blocks=3)
    with_shared = PARTransformerXLSpace(cfg, VOCAB, ("attention", "dense", "shared"))
    without = PARTransformerXLSpace(cfg, VOCAB, ("attention", "dense"))
    layer = parameters(make(("shared",))) - parameters(make(("identity",)))
    assert parameters(with_shared) - parameters(without) == layer  # one layer, not one per depth
    model = fixed_model(cfg, VOCAB, {"block_0": "shared", "block_1": "dense", "block_2": "shared"})
    assert model.block_kinds == ["shared", "dense", "shared"]
    assert model.blocks[0].core is model.blocks[2].core
    _, mems = model(torch.randint(0, VOCAB, (2, 4)))
    assert [m is not None for m in mems] == [True, False, True]


def test_a_checkpoint_from_before_the_new_settings_still_resumes():
    from types import SimpleNamespace

    from parnas import architecture
    from parnas.config import Config
    from parnas.errors import ConfigError
    from parnas.training.resume import check_resumable

    cfg = Config()
    record = architecture.make_record({"block_0": "attention"}, tiny(n_blocks=1), VOCAB)
    old = cfg.to_dict()
    for key in ("conv", "compressive"):
        del old["model"][key]  # what a checkpoint written before these settings holds
    checkpoint = {"parnas": {"architecture": record, "tokenizer": {"sha256": "x"}, "config": old}}
    check_resumable(checkpoint, cfg, record, SimpleNamespace(sha256="x"), "last.ckpt")
    changed = Config(model=ModelConfig(kind_settings={"compressive": CompressiveSettings(rate=5)}))
    with pytest.raises(ConfigError, match="model.compressive.rate=3"):
        check_resumable(checkpoint, changed, record, SimpleNamespace(sha256="x"), "last.ckpt")


def test_every_kind_that_attends_is_an_attention_block_in_summaries_and_studies():
    from parnas.study.verdicts import attention_early

    layout = ["attention", "attention_half", "attention_quarter", "lsh", "dense", "dense_half", "moe", "identity"]
    assert kinds.attending(layout) == 4 and kinds.attending(["conv", "glu", "nope"]) == 0
    assert attention_early("QDDN") is True and attention_early("DNQF") is False and attention_early("NNWE") is None


@pytest.mark.parametrize("kind", [k for k in kinds.names() if k not in ("attention", "dense", "identity")])
def test_every_kind_trains_under_bf16_autocast(kind):
    """``train.precision: bf16-mixed`` on any device: a layout holding the kind steps under bf16 autocast (on the
    CPU here, as on a GPU) with a finite loss and a gradient for every weight the kind owns (the compressive
    memory's compression through its own auxiliary loss, as training adds it). A kind that adds
    bf16 products into an fp32 buffer (the mixture of experts' dispatch did) fails here before a GPU retrain."""
    model = make(("attention", kind, "dense"), moe=MoESettings(top_k=2, capacity_factor=1.0))
    model.train()
    x = torch.randint(0, VOCAB, (4, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, mems = model(x[:, :6])
        h, _ = model(x[:, 6:], mems)
        loss = model.nll(h[:, :-1], x[:, 7:]).float().mean() + getattr(model, "aux_loss", 0.0)  # as the task adds
    loss.backward()
    assert torch.isfinite(loss)
    block = model.blocks[1]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in block.parameters()), kind
