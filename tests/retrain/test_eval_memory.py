"""The evaluation memory (``model.eval_mem_len``, ``model.clamp_len``): every reader keeps it, and unset it changes
nothing."""

import json
from dataclasses import replace

import pytest
import torch

from parnas.cli import main
from parnas.config import generation_memory, load_config
from parnas.nn.blocks import sinusoid
from parnas.nn.model import TransformerXL, build_fixed_model, full_memory_steps
from parnas.retrain.evaluate import Sampling, generate
from parnas.retrain.load import load_trained
from parnas.retrain.run import retrain
from parnas.training import latency, latency_table

VOCAB = 64


def tiny(*overrides: str):
    return load_config("tiny", ["model.n_blocks=2", "model.cutoffs=[]", "data.batch_size=2", "data.seg_len=8",
                                "model.mem_len=8", *overrides])


def memories_kept(model: TransformerXL, segments: int, seg_len: int = 8) -> int:
    """States each attention block's memory holds after ``segments`` segments, in the model's current mode."""
    mems = None
    with torch.no_grad():
        for _ in range(segments):
            _, mems = model(torch.randint(0, VOCAB, (2, seg_len)), mems)
    return next(m.size(1) for m in mems if m is not None)


def test_a_model_keeps_the_training_memory_in_training_and_the_evaluation_memory_in_evaluation():
    model = build_fixed_model(tiny("model.eval_mem_len=24").model, VOCAB)
    assert memories_kept(model.train(), 6) == 8
    assert memories_kept(model.eval(), 6) == 24
    model.evaluate_with(mem_len=0)  # as --mem-len 0: no memory
    assert memories_kept(model.eval(), 2) == 0


def test_unset_the_evaluation_memory_is_each_readers_old_default_and_changes_no_figure():
    cfg = load_config("wt2-cpu")
    assert cfg.model.eval_mem_len is None and cfg.model.clamp_len == 0
    assert cfg.model.evaluation_memory == cfg.model.mem_len == 32
    assert generation_memory(cfg.model, cfg.data.seg_len) == cfg.model.mem_len + cfg.data.seg_len == 64
    unset, same = (tiny(*extra).model for extra in ((), ("model.eval_mem_len=8",)))
    torch.manual_seed(0)
    a = build_fixed_model(unset, VOCAB).eval()
    b = build_fixed_model(same, VOCAB).eval()
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        (ha, ma), (hb, mb) = a(x), b(x)
        ha, ma = a(x, ma)
        hb, mb = b(x, mb)
    assert torch.equal(ha, hb) and all(torch.equal(p, q) for p, q in zip(ma, mb) if p is not None)
    assert memories_kept(a, 4) == 8
    # the latency targets keep the memories they kept before: mem_len, mem_len, mem_len + seg_len
    assert latency_table.target_memories(tiny()) == {"train": 8, "inference": 8, "generate": 16}


def test_clamp_len_reads_the_clamped_distance_beyond_it_and_changes_nothing_within():
    table, clamped = sinusoid(12, 16), sinusoid(12, 16, clamp_len=5)  # rows: distances 11, ..., 0
    assert torch.equal(clamped[-6:], table[-6:])  # distances 0..5 as they were
    assert all(torch.equal(row, table[-6]) for row in clamped[:-6])  # 6..11 read distance 5's
    torch.manual_seed(0)
    model = build_fixed_model(tiny().model, VOCAB).eval()
    x = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        plain = model(x, model(x)[1])[0]
        model.evaluate_with(clamp_len=16)  # no distance beyond 15 in [memory of 8; segment of 8]
        assert torch.equal(model(x, model(x)[1])[0], plain)
        model.evaluate_with(clamp_len=3)
        assert not torch.allclose(model(x, model(x)[1])[0], plain)


def test_the_latency_targets_are_timed_at_the_evaluation_memory_and_cached_per_memory():
    cfg = tiny("model.eval_mem_len=24")
    assert latency_table.target_memories(cfg) == {"train": 8, "inference": 24, "generate": 24}
    for mode, kept in latency_table.target_memories(cfg).items():
        stepper = latency._Stepper(["attention", "dense"], cfg, VOCAB, mode, torch.device("cpu"))
        stepper.steps(full_memory_steps(cfg.model, cfg.data.seg_len, stepper.memory) if mode != "generate" else 1)
        assert stepper.memory == kept and next(m.size(1) for m in stepper.mems if m is not None) == kept, mode
    key = latency_table.table_key(cfg, VOCAB, ["attention", "dense", "identity"], torch.device("cpu"))
    others = [tiny(*s) for s in ((), ("model.eval_mem_len=48",))]
    assert all(latency_table.table_key(c, VOCAB, ["attention", "dense", "identity"], torch.device("cpu")) != key
               for c in others)  # a table cached at another memory is not this one
    clamped = tiny("model.eval_mem_len=24", "model.clamp_len=8")  # a clamp costs nothing: the same table
    assert latency_table.table_key(clamped, VOCAB, ["attention", "dense", "identity"], torch.device("cpu")) == key
    assert any("model.eval_mem_len 48 (table) vs 24 (run)" in d for d in latency_table.shape_differences(
        latency_table.table_key(others[1], VOCAB, ["attention"], torch.device("cpu")), key))


def test_the_validation_a_search_judges_by_keeps_the_evaluation_memory(monkeypatch, tmp_path):
    from parnas.strategies.search import final_evaluation
    from tests.strategies.test_search import run

    kept = {True: set(), False: set()}
    forward = TransformerXL.forward

    def spy(self, x, mems=None):
        h, new = forward(self, x, mems)
        kept[self.training].add(next(m.size(1) for m in new if m is not None))
        return h, new

    monkeypatch.setattr(TransformerXL, "forward", spy)
    search = run(tmp_path, "model.eval_mem_len=40", "train.max_steps=3", "search.penalty_cost=flops")
    kept[True].clear()  # the training steps kept mem_len (8); now the evaluation alone
    kept[False].clear()
    result = final_evaluation(search)  # the supernet's val ppl, then the exported architecture's
    assert max(kept[False]) == 40 and not kept[True]
    assert result.val_ppl > 0 and result.supernet_val_ppl > 0


@pytest.fixture(scope="module")
def checkpoint(wt2_short_eval, tmp_path_factory):
    """A tiny retrain with an evaluation memory of 40 states (training keeps 16)."""
    run = tmp_path_factory.mktemp("evalmem") / "run"
    with pytest.MonkeyPatch.context() as mp:  # module scope: set the private cache ourselves
        mp.setenv("PARNAS_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "parnas-cache"))
        retrain("transformer-xl", "tiny", [f"data.path={wt2_short_eval}", "data.vocab_size=300",
                                           "model.cutoffs=[100, 200]", "train.max_steps=4", "train.eval_every=4",
                                           "model.eval_mem_len=40",
                                           f"train.out_dir={run}"])
    return run


def test_evaluate_and_generate_default_to_the_checkpoints_evaluation_memory(checkpoint, tmp_path, capsys):
    metrics, last = json.loads((checkpoint / "metrics.json").read_text()), checkpoint / "checkpoints/last.ckpt"
    assert metrics["eval_mem_len"] == 40  # the perplexity training recorded says its memory
    assert main(["evaluate", str(last)]) == 0
    result = json.loads((last.parent / "last.ckpt.valid-mem40.json").read_text())
    assert result["mem_len"] == 40 and result["ppl"] == metrics["val_ppl"]  # the same figure
    assert "(memory 40," in capsys.readouterr().out
    assert main(["evaluate", str(last), "--mem-len", "16", "--clamp-len", "20"]) == 0
    overridden = json.loads((last.parent / "last.ckpt.valid-mem16.json").read_text())
    assert overridden["mem_len"] == 16 and overridden["clamp_len"] == 20 and overridden["ppl"] != result["ppl"]
    assert "positions clamped at 20" in capsys.readouterr().out
    trained = load_trained(last, torch.device("cpu"), tmp_path)
    generate(trained, "The", Sampling(tokens=3))
    assert trained.model.eval_mem_len == 40  # not mem_len + seg_len (32)
    generate(trained, "The", Sampling(tokens=3, mem_len=12))  # --mem-len still overrides
    assert trained.model.eval_mem_len == 12


def test_a_retrain_takes_the_evaluation_memory_from_the_architecture_it_retrains(checkpoint):
    from parnas import architecture
    from parnas.retrain.run import resolve_config

    record = architecture.read(checkpoint / "architecture.json")
    assert record["model"]["eval_mem_len"] == 40
    assert resolve_config(record, "tiny", []).model.eval_mem_len == 40
    assert resolve_config(record, "tiny", ["model.eval_mem_len=64"]).model.evaluation_memory == 64
    assert replace(resolve_config(record, "tiny", []).model, eval_mem_len=None).evaluation_memory == 16
