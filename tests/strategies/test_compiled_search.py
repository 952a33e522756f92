"""A search's supernet under ``train.compile``: with ``forward: gumbel`` every step runs every candidate of every
block, one static graph that Dynamo captures whole. It must train as the eager supernet does while tau anneals
(tau is an input of the graphs, not a constant they were specialised on: no recompile a step), evaluate an
exported layout without compiling for it, and be refused, in one line, where the step is not static."""

import copy
import json

import pytest
import torch
import torch._dynamo
import torch._inductor.config
from torch._dynamo.utils import counters

from parnas.cli import main
from parnas.config import load_config
from parnas.search_spaces import PARTransformerXLSpace
from parnas.strategies.gumbel_darts import PARGumbelDARTS, tau_at
from parnas.strategies.supernet_export import exported
from parnas.strategies.temperature import GumbelSoftmax
from parnas.training.compiling import compile_model
from parnas.training.latency import zipf_ids
from parnas.training.task import adam

VOCAB = 1000
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")


def supernets(mode: str, device: str = "cpu", *settings: str) -> tuple[dict, object, int]:
    """An eager gumbel supernet and its compiled copy (tiny preset, two blocks: dropout 0, memory filling over two
    segments; then ``settings``), a Zipf token stream and the segment length."""
    cfg = load_config("tiny", ["model.mem_len=32", "model.n_blocks=2", "search.par-gumbel-darts.forward=gumbel",
                               *settings])
    torch.manual_seed(0)
    space = PARTransformerXLSpace(cfg.model, VOCAB, cfg.search.candidates)
    eager = PARGumbelDARTS(cfg.search, cfg.search.settings, max_steps=1).mutate_model(space).to(device).train()
    compiled = copy.deepcopy(eager)
    compile_model(compiled, mode)
    L = cfg.data.seg_len
    stream = zipf_ids(cfg.data.batch_size * (L * 8 + 1), VOCAB).view(cfg.data.batch_size, -1).to(device)
    return {"eager": eager, "compiled": compiled}, stream, L


def grouped_as_in_training(model, stream: torch.Tensor, L: int, steps: int) -> list:
    """Each of ``steps`` segments' targets grouped on the host as the data module groups a training batch: a
    compiled model's tail clusters padded to its capacities, fitted first to every segment (so its loss is
    compiled once), an eager model's as they come; moved to the stream's device."""
    targets = [stream[:, t * L + 1:(t + 1) * L + 1].cpu() for t in range(steps)]
    for y in targets:
        model.group_targets(y, model.target_capacity)
    return [model.group_targets(y, model.target_capacity).to(stream.device) for y in targets]


def train_side_by_side(models: dict, stream: torch.Tensor, L: int, steps: int, tolerance: dict) -> None:
    """``steps`` Adam steps of each model on the same segments, tau annealed from 1 to 0.1 as a search does: the
    losses, the logits' and the weights' gradients and the memories are eager's to ``tolerance``; from the fourth
    segment (the memory full) nothing is compiled again."""
    optimizers = {name: adam(m.parameters(), lr=1e-3) for name, m in models.items()}
    groups = {name: grouped_as_in_training(m, stream, L, steps) for name, m in models.items()}
    mems: dict = dict.fromkeys(models)
    for t in range(steps):
        x, y = stream[:, t * L:(t + 1) * L], stream[:, t * L + 1:(t + 1) * L + 1]
        losses, grads = {}, {}
        with torch._dynamo.config.patch(error_on_recompile=t >= 3):
            for name, model in models.items():
                for softmax in (m for m in model.modules() if isinstance(m, GumbelSoftmax)):
                    softmax.set_tau(tau_at(t, steps, 1.0, 0.1))
                torch.manual_seed(t)  # the Gumbel noise: eager's draws, in the graph too (fallback_random)
                h, mems[name] = model(x, mems[name])
                losses[name] = model.nll(h, y, groups[name][t]).mean()
                optimizers[name].zero_grad(set_to_none=True)
                losses[name].backward()
                grads[name] = {key: p.grad.clone() for key, p in model.named_parameters() if p.grad is not None}
                optimizers[name].step()
        torch.testing.assert_close(losses["compiled"], losses["eager"], **tolerance)
        assert grads["compiled"].keys() == grads["eager"].keys() and any("_arch_alpha" in k for k in grads["eager"])
        for key, grad in grads["eager"].items():
            torch.testing.assert_close(grads["compiled"][key], grad, rtol=1e-3, atol=1e-5, msg=f"step {t}: {key}")
        for a, b in zip(mems["eager"], mems["compiled"]):
            assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, **tolerance)), t


@pytest.mark.slow  # a compile of seconds: `make test` runs it, `make test-fast` not
def test_a_compiled_gumbel_supernet_trains_like_the_eager_one_while_tau_anneals():
    models, stream, L = supernets("default")
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(fallback_random=True):
            # its loss compiled too: Inductor's softmax gradients differ from eager's in the last bits, which Adam
            # turns into weights, and memories, apart by up to 1e-5 after five steps (the losses stay equal)
            train_side_by_side(models, stream, L, 6, dict(rtol=1e-4, atol=1e-5))
        made = counters["stats"]["unique_graphs"]
        assert made > 0  # compiled indeed (the third segment, the first with a full memory)
        x, y = stream[:, :L], stream[:, 1:L + 1]
        layout = ["attention", "identity"]
        nll = {}
        for name, model in models.items():  # the exported layout with the supernet's weights, in eval mode
            choices = [m for m in model.modules() if hasattr(m, "_arch_alpha")]
            model.eval()
            with torch.no_grad(), exported(choices, layout):
                mems = None
                for _ in range(3):  # the third segment's memory full: compiled, were it not run eager
                    h, mems = model(x, mems)
                nll[name] = model.nll(h, y).mean()
        torch.testing.assert_close(nll["compiled"], nll["eager"], rtol=1e-5, atol=1e-6)
        assert counters["stats"]["unique_graphs"] == made  # run eager: no graphs for a layout
    finally:
        torch._dynamo.reset()


def fair_side_by_side(fair_step, models: dict, stream: torch.Tensor, L: int, steps: int, tolerance: dict) -> None:
    """``steps`` fair steps of each model on the same segments: ``eager`` as sub-steps, ``compiled`` stacked (as a
    compiled search runs them). Weights, logits and memories stay eager's to ``tolerance`` (no dropout: the
    two compute the same); from the fourth segment (the memory full) nothing is compiled again, though every
    step routes the copies by new permutations."""
    steps_of = {}
    for name, model in models.items():
        weights = [p for key, p in model.named_parameters() if not key.endswith("_arch_alpha")]
        alphas = [p for key, p in model.named_parameters() if key.endswith("_arch_alpha")]
        optimizers = [adam(weights, lr=1e-3), torch.optim.Adam(alphas, lr=1e-2, betas=(0.5, 0.999))]
        steps_of[name] = fair_step(model, optimizers, weights, 0.25, stacked=name == "compiled")
    groups = {name: grouped_as_in_training(m, stream, L, steps) for name, m in models.items()}
    for t in range(steps):
        with torch._dynamo.config.patch(error_on_recompile=t >= 3):
            for name, step in steps_of.items():
                step(stream[:, t * L:(t + 1) * L + 1], groups[name][t])
        for (key, a), b in zip(models["eager"].named_parameters(), models["compiled"].parameters()):
            torch.testing.assert_close(b, a, **tolerance, msg=f"step {t}: {key}")


@pytest.mark.parametrize("candidates", ["[attention,ut,dense]", "[moe,dense,identity]", "[shared,glu,identity]"])
def test_stacked_sub_steps_compute_what_the_sub_steps_do_with_each_kinds_own_losses(benchmark_script, candidates):
    """Eager, kinds whose blocks leave losses of their own (adaptive computation's pondering, a mixture's balance)
    or share weights across depth: each copy's loss carries what its candidates left, as its sub-step's did, so
    the logits learn the same."""
    models, stream, L = supernets("none", "cpu", f"search.candidates={candidates}")
    fair_side_by_side(benchmark_script("search_step").fair_step, models, stream, L, 4, dict(rtol=1e-4, atol=1e-5))


@pytest.mark.slow
def test_a_compiled_fair_supernet_steps_as_its_eager_sub_steps_do(benchmark_script):
    models, stream, L = supernets("default")
    torch._dynamo.reset()
    try:
        fair_side_by_side(benchmark_script("search_step").fair_step, models, stream, L, 6, dict(rtol=1e-4, atol=1e-5))
        assert counters["stats"]["unique_graphs"] >= 3
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_cuda_graphed_fair_supernet_steps_as_its_eager_sub_steps_do(benchmark_script):
    models, stream, L = supernets("reduce-overhead", "cuda")
    torch._dynamo.reset()
    try:
        fair_side_by_side(benchmark_script("search_step").fair_step, models, stream, L, 8, dict(rtol=1e-3, atol=1e-4))
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_cuda_graphed_gumbel_supernet_trains_like_the_eager_one():
    """``train.compile=reduce-overhead``: the supernet's forward, loss and their backward replayed as CUDA
    graphs, tau changing between replays; eager's losses, gradients and memories to a tolerance; and every graph a
    CUDA graph (Inductor skipped none)."""
    from parnas.training.compiling import compile_counts

    models, stream, L = supernets("reduce-overhead", "cuda")
    torch._dynamo.reset()
    skipped = compile_counts()[2]
    try:
        with torch._inductor.config.patch(fallback_random=True):
            train_side_by_side(models, stream, L, 8, dict(rtol=1e-4, atol=1e-4))
        assert compile_counts()[2] == skipped, "Inductor skipped CUDA graphs: its warning says why"
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("settings, said", [
    (["search.par-gumbel-darts.forward=sampled"], "and a sampled supernet runs other candidates from step to step: "
     "set search.par-gumbel-darts.forward to gumbel or fair to compile the supernet"),
    (["search.par-gumbel-darts.forward=gumbel", "search.candidates=[attention,ut]", "train.accelerator=gpu"],
     "train.compile=reduce-overhead replays the supernet's step as CUDA graphs, and ut blocks read values back"),
])
def test_a_compiled_search_that_is_not_one_static_step_is_refused_in_one_line(capsys, tmp_path, settings, said):
    mode = "reduce-overhead" if "train.accelerator=gpu" in settings else "default"
    args = ["search", "--config", "tiny", "--dry-run", "--set", f"train.compile={mode}",
            "--set", f"search.out_dir={tmp_path / 'run'}"]
    for setting in settings:
        args += ["--set", setting]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def compiled_search(micro, forward: str, *settings: str) -> list[str]:
    """``parnas search``'s arguments: tiny with two blocks, on the micro corpus, ``forward``, compiled, 8 steps, then
    ``settings``."""
    args = ["search", "--config", "tiny", "--set", f"data.path={micro}", "--set", "data.tokenizer=char",
            "--set", "model.cutoffs=[20, 40]", "--set", "model.n_blocks=2",
            "--set", f"search.par-gumbel-darts.forward={forward}", "--set", "train.compile=default",
            "--set", "train.max_steps=8", "--set", "train.eval_every=4", "--set", "train.threads=1"]
    for setting in settings:
        args += ["--set", setting]
    return args


@pytest.mark.slow
def test_a_compiled_search_stopped_and_resumed_is_the_uninterrupted_one(micro, tmp_path):
    """Stopped after its first evaluation and checkpoint, then resumed: the same history, step for step (the
    graphs' own random draws come from the generators the step seeds). Fair, a one-process search's default: its
    sub-steps stacked, routed by the step's permutations."""
    assert main(compiled_search(micro, "fair", "model.dropout=0.1", f"search.out_dir={tmp_path / 'whole'}")) == 0
    parts = compiled_search(micro, "fair", "model.dropout=0.1", f"search.out_dir={tmp_path / 'parts'}",
                            "train.ckpt_every=4")
    assert main([*parts, "--set", "train.stop_at=4"]) == 0
    assert main([*parts, "--resume"]) == 0
    histories = [[json.loads(line) for line in (tmp_path / run / "history.jsonl").read_text().splitlines()]
                 for run in ("whole", "parts")]
    assert [h["step"] for h in histories[0]] == [4, 8] and histories[1] == histories[0]


@pytest.mark.slow
def test_a_compiled_gumbel_search_says_it_compiles_and_exports(capsys, tmp_path, micro):
    """``parnas search --set train.compile=default`` with ``forward: gumbel``, on the CPU: a line before the first
    step says it compiles, one after says how long it took, and the search evaluates, picks and exports as an eager
    one, its checkpoint holding the same keys. The final pick's short retrains run eager: no line of theirs says
    they compile."""
    base = compiled_search(micro, "gumbel", "search.par-gumbel-darts.select.steps=[4]",
                           "search.par-gumbel-darts.latency_budget=0.8")
    for mode in ("none", "default"):
        assert main([*base, "--set", f"train.compile={mode}", "--set", f"search.out_dir={tmp_path / mode}"]) == 0
    out = capsys.readouterr().out
    assert out.count("compiling the model (train.compile=default)") == 1 and "compiled: step 2 took" in out
    assert out.count("final pick, round 1/1: ") >= 4  # both searches' picks retrained their entrants
    assert out.count("architecture ") >= 2 and (tmp_path / "default" / "architecture.json").exists()
    keys = {mode: set(torch.load(tmp_path / mode / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"])
            for mode in ("none", "default")}
    assert keys["default"] == keys["none"]


@pytest.mark.slow
def test_search_step_times_the_compiled_models_beside_the_eager_ones(benchmark_script, monkeypatch, capsys):
    """``benchmarks/search_step.py --compile default`` (tiny, one round of one step): the compiled Transformer-XL
    and gumbel and fair supernets are timed in the same rounds as the eager ones, and their ratios printed. The
    supernets at the shapes and Inductor settings the tests above compile them with (``supernets``): Inductor
    builds their kernels once in a run of this file."""
    search_step = benchmark_script("search_step")
    monkeypatch.setattr("sys.argv", ["search_step.py", "--config", "tiny", "--set", "model.mem_len=32",
                                     "--set", "model.n_blocks=2", "--vocab-size", str(VOCAB), "--steps", "1",
                                     "--rounds", "1", "--warmup", "1", "--compile", "default"])
    with torch._inductor.config.patch(fallback_random=True):
        search_step.main()
    out = capsys.readouterr().out
    for name in ("transformer-xl", "supernet, gumbel", "supernet, fair", "transformer-xl, default",
                 "supernet, gumbel, default", "supernet, fair, default"):
        assert any(line.startswith(f"{name} ") and line.endswith(" ms/step") for line in out.splitlines()), name
    for name in ("gumbel", "fair"):
        assert f"step supernet, {name}, default / transformer-xl, default: " in out
        assert f"step supernet, {name}, default / supernet, {name}: " in out


def test_a_stacked_fair_step_runs_where_the_model_is(benchmark_script):
    """On the ``meta`` device (the GPU's paths: torch's dropout, the targets grouped on the host and moved): the
    routes, the copies' groups and auxiliary losses and the memory carried on all land on the model's device,
    B rows of memory a block, step after step."""
    from parnas.strategies.fair import fair_loss
    from parnas.strategies.sampled import RoutedMixedLayer

    cfg = load_config("tiny", ["model.dropout=0.1", "search.candidates=[attention,moe,identity]"])
    space = PARTransformerXLSpace(cfg.model, VOCAB, cfg.search.candidates)
    supernet = PARGumbelDARTS(cfg.search, cfg.search.settings, max_steps=1).mutate_model(space).to("meta").train()
    tokens = torch.randint(0, VOCAB, (8, 17))
    groups = supernet.group_targets(tokens[:, 1:]).to(torch.device("meta"))
    task = benchmark_script("search_step").FairTask(supernet)
    layers = [m for m in supernet.modules() if isinstance(m, RoutedMixedLayer)]
    meta = tokens.to("meta")
    for _ in range(3):
        loss, surrogate = fair_loss(layers, task, (meta[:, :-1], meta[:, 1:], groups), True, stacked=True)
        (loss + surrogate).backward()
        assert loss.device.type == "meta" and loss.shape == ()
        assert all(m.device.type == "meta" and m.size(0) == 8 for m in task.mems if m is not None)
