"""benchmarks/gpu_step.py and its shapes, FLOPs and peaks (benchmarks/gpu_shapes.py) without a GPU: the FLOP
count against a hand count and torch's own counter, the shapes as valid models (on the meta device: no memory),
the models its flags add (built and stepped on the CPU), the peak table, and its one-line refusals."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from parnas.config import ModelConfig, load_config
from parnas.nn.model import build_fixed_model

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


@pytest.fixture
def gpu_step(benchmark_script):
    return benchmark_script("gpu_step")


@pytest.fixture
def gpu_shapes(benchmark_script):
    return benchmark_script("gpu_shapes")


def test_flops_per_token_match_a_hand_count(gpu_shapes):
    """D=8, F=16, L=4, M=4 (K=8), B=2, V=10, full softmax, one attention and one dense block:
    attention 6*64*(1+3*8/4) = 2688 (q, k and v in one product on all 8 rows), W_r 4*64*8/(2*4) = 256,
    scores 6*8*(3*8+1) = 1200; dense 12*8*16 = 1536;
    output 6*8*10 = 480. Adaptive, cutoffs [4], div 2, a quarter of the targets in the tail (6 ids):
    6*(8*(4+1) + 0.25*(8*4 + 4*6)) = 324 instead of 480."""
    cfg = ModelConfig(n_blocks=2, d_model=8, n_heads=2, d_ff=16, mem_len=4, cutoffs=())
    assert gpu_shapes.train_flops_per_token(cfg, ["attention", "dense"], 2, 4, 10) == 2688 + 256 + 1200 + 1536 + 480
    assert gpu_shapes.train_flops_per_token(cfg, ["identity", "identity"], 2, 4, 10) == 480
    assert gpu_shapes.train_flops_per_token(cfg, ["choice"], 2, 4, 10) == 2688 + 256 + 1200 + 1536 + 480
    adaptive = ModelConfig(n_blocks=2, d_model=8, n_heads=2, d_ff=16, mem_len=4, cutoffs=(4,), div_value=2.0)
    assert gpu_shapes.train_flops_per_token(adaptive, ["identity"] * 2, 2, 4, 10, [0.25]) == 324


@pytest.mark.parametrize("cutoffs", [(), (10, 30)])
@pytest.mark.parametrize("supernet", [False, True])
def test_flops_per_token_are_what_torch_counts_in_a_training_step(gpu_shapes, cutoffs, supernet):
    """torch's FlopCounterMode over forward and backward of a step with the memory full gives the formula
    exactly, for the fixed model and the supernet, full and adaptive softmax (tail clusters as the targets hit)."""
    from parnas.search_spaces import PARTransformerXLSpace
    from parnas.strategies.gumbel_darts import PARGumbelDARTS

    torch.manual_seed(0)
    V, B, L = 50, 2, 4
    cfg = load_config("tiny", ["model.n_blocks=3", "model.d_model=8", "model.n_heads=2", "model.d_ff=16",
                               "model.mem_len=4", "model.div_value=2", f"model.cutoffs={list(cutoffs)}"])
    if supernet:
        space = PARTransformerXLSpace(cfg.model, V, cfg.search.candidates)
        strategy = PARGumbelDARTS(cfg.search, cfg.search.settings, max_steps=1)
        model, kinds = strategy.mutate_model(space).train(), ["choice"] * 3
    else:
        kinds = ["attention", "dense", "attention"]
        model = build_fixed_model(cfg.model, V, kinds).train()
    tokens = torch.randint(0, V, (B, 2 * L + 1))
    _, mems = model(tokens[:, :L])  # fills the memory (mem_len == seg_len)
    x, y = tokens[:, L:2 * L], tokens[:, L + 1:]
    with FlopCounterMode(display=False) as counter:
        h, _ = model(x, mems)
        model.nll(h, y).mean().backward()
    fractions = gpu_shapes.cluster_fractions(y, V, cutoffs) if cutoffs else []
    assert counter.get_total_flops() == pytest.approx(
        gpu_shapes.train_flops_per_token(cfg.model, kinds, B, L, V, fractions) * B * L, rel=1e-12)


@pytest.mark.slow
def test_every_shape_builds_a_valid_fixed_model_and_supernet(gpu_shapes):
    from parnas.search_spaces import PARTransformerXLSpace
    from parnas.strategies.gumbel_darts import PARGumbelDARTS

    assert list(gpu_shapes.SHAPES) == ["wt2-par", "wt103-base", "nvidia-base", "long"]
    for name, shape in gpu_shapes.SHAPES.items():
        for precision in gpu_shapes.PRECISIONS:
            cfg = shape.config(precision)
            assert cfg.train.precision == ("32-true" if precision == "tf32" else precision)
        with torch.device("meta"):  # WikiText-103's vocabulary: 110M embedding weights, no memory taken
            fixed = build_fixed_model(cfg.model, shape.vocab, ["attention", "dense"] * shape.n_layers)
            space = PARTransformerXLSpace(cfg.model, shape.vocab, cfg.search.candidates)
            supernet = PARGumbelDARTS(cfg.search, cfg.search.settings, max_steps=1).mutate_model(space)
            x = torch.zeros(shape.batch, shape.seg_len, dtype=torch.long)
            for model in (fixed, supernet):
                h, mems = model(x)
                h, mems = model(x, mems)
                assert h.shape == (shape.batch, shape.seg_len, shape.d_model), name
                assert mems[0].shape == (shape.batch, shape.mem_len, shape.d_model), name
        assert len(fixed.blocks) == len(supernet.blocks) == 2 * shape.n_layers
        assert not fixed.cfg.tie_weights and hasattr(fixed.head, "adaptive") == bool(shape.cutoffs)
    wt2 = load_config("wt2-par", ["data.batch_size=32", "data.seg_len=128", "model.mem_len=128"])
    assert gpu_shapes.SHAPES["wt2-par"].config().model == wt2.model  # the preset at the GPU length the README names
    assert (wt2.data.vocab_size, wt2.data.batch_size, wt2.data.seg_len) == (12000, 32, 128)


def test_the_flags_add_their_models_in_order_each_in_its_precision(gpu_step, gpu_shapes):
    """--tf32 adds the Transformer-XL in TF32 beside the bf16 ones, before the compiled one; --twin adds each
    identity-bearing layout's twin without the identity blocks, of the same FLOPs (identity costs none)."""
    args = gpu_step.parse_args(["--shape", "wt103-base", "--compile", "default", "--tf32"])
    models = gpu_step.timed_models(gpu_shapes.SHAPES["wt103-base"], args)
    bf16 = "bf16-mixed"
    assert {name: m.precision for name, m in models.items()} == {
        "transformer-xl": bf16, "supernet": bf16, "txl, tf32": "tf32", "compiled (default)": bf16}
    assert models["txl, tf32"].kinds == models["transformer-xl"].kinds == ["attention", "dense"] * 16

    args = gpu_step.parse_args(["--shape", "wt2-par", "--sampled", "--fair", "--layout", "AIAIIIAIIDDD",
                                "--layout", "ADI", "--layout", "ADAD", "--twin"])
    models = gpu_step.timed_models(gpu_shapes.SHAPES["wt2-par"], args)
    assert list(models) == ["transformer-xl", "supernet", "supernet, sampled", "supernet, fair", "AIAIIIAIIDDD",
                            "ADI", "ADAD", "AAADDD", "AD"]
    assert gpu_step.twins(args.layout) == {"AIAIIIAIIDDD": "AAADDD", "ADI": "AD"}
    assert models["AAADDD"].kinds == ["attention"] * 3 + ["dense"] * 3
    model = gpu_shapes.SHAPES["wt2-par"].config().model
    flops = {name: gpu_shapes.train_flops_per_token(model, models[name].kinds, 32, 128, 12000, [0.2, 0.1])
             for name in ("AIAIIIAIIDDD", "AAADDD")}
    assert flops["AIAIIIAIIDDD"] == flops["AAADDD"] > 0


def test_a_layout_and_its_twin_build_the_models_they_name_and_step(gpu_step, gpu_shapes, monkeypatch):
    """What --layout LAYOUT --twin times, built on the CPU (``.cuda()`` made a no-op): the layout's blocks, the
    twin's without identity; one fp32 step of each trains its weights."""
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    args = gpu_step.parse_args(["--shape", "wt2-par", "--precision", "32-true", "--layout", "AIDI", "--twin"])
    shape = gpu_shapes.SHAPES["wt2-par"]
    cfg = shape.config("32-true")
    tokens = torch.randint(0, shape.vocab, (2, 9))
    for name, kinds in (("AIDI", ["attention", "identity", "dense", "identity"]), ("AD", ["attention", "dense"])):
        torch.manual_seed(0)
        net, step = gpu_step.timed_models(shape, args)[name].build(cfg, shape.vocab)
        assert net.block_kinds == kinds
        before = [p.detach().clone() for p in net.parameters()]
        step(tokens)
        assert any(not torch.equal(a, p) for a, p in zip(before, net.parameters()))


def test_the_fair_supernet_takes_the_searchs_fair_step(gpu_step, gpu_shapes, monkeypatch):
    """What --fair times, built on the CPU (``.cuda()`` made a no-op): the search's own fair step, which trains
    every candidate of every block in one step and moves every block's logits, counted as three forwards of the
    output layer and one run of each candidate."""
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    args = gpu_step.parse_args(["--shape", "wt2-par", "--precision", "32-true", "--fair", "--no-supernet"])
    shape = gpu_shapes.SHAPES["wt2-par"]
    cfg = shape.config("32-true")
    timed = gpu_step.timed_models(shape, args)["supernet, fair"]
    torch.manual_seed(0)
    net, step = timed.build(cfg, shape.vocab)
    choices = [m for m in net.modules() if hasattr(m, "_arch_alpha")]
    weights = {(b, n): [p.detach().clone() for p in c[n].parameters()] for b, c in enumerate(choices) for n in c.names}
    alphas = [c._arch_alpha.detach().clone() for c in choices]
    step(torch.randint(0, shape.vocab, (2, 9)))
    for (b, name), old in weights.items():
        assert all(not torch.equal(x, y) for x, y in zip(old, choices[b][name].parameters())), (b, name)
    assert all(not torch.equal(a, c._arch_alpha) for a, c in zip(alphas, choices))
    model = cfg.model
    flops = {kind: gpu_shapes.train_flops_per_token(model, [kind] * 12, 32, 128, 12000, [0.2, 0.1])
             for kind in ("choice", "fair")}
    one_output = gpu_shapes.train_flops_per_token(model, [], 32, 128, 12000, [0.2, 0.1])
    assert timed.kinds == ["fair"] * 12 and flops["fair"] == flops["choice"] + 2 * one_output


@pytest.mark.slow  # builds three full-size wt2-par supernets
def test_compile_supernet_adds_the_mixed_supernet_compiled_as_a_search_compiles_it(gpu_step, gpu_shapes, monkeypatch):
    """--compile MODE --compile-supernet: after the compiled Transformer-XL, the mixed and the fair supernet compiled
    in MODE, as ``train.compile`` compiles them in a search (built on the CPU, ``.cuda()`` made a no-op; not
    stepped)."""
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    args = gpu_step.parse_args(["--shape", "wt2-par", "--precision", "32-true", "--compile", "default",
                                "--compile-supernet"])
    shape = gpu_shapes.SHAPES["wt2-par"]
    models = gpu_step.timed_models(shape, args)
    assert list(models) == ["transformer-xl", "supernet", "compiled (default)", "supernet, compiled (default)",
                            "supernet, fair, compiled (default)"]
    assert models["supernet, compiled (default)"].kinds == models["supernet"].kinds == ["choice"] * 12
    assert models["supernet, fair, compiled (default)"].kinds == ["fair"] * 12
    for name in ("supernet, compiled (default)", "supernet, fair, compiled (default)"):
        net, _ = models[name].build(shape.config("32-true"), shape.vocab)
        assert "forward" in vars(net), name  # compile_model routes the forward in place
    plain, _ = models["supernet"].build(shape.config("32-true"), shape.vocab)
    assert "forward" not in vars(plain)


@pytest.mark.slow  # builds full-size wt2-par models
def test_eager_loss_adds_the_compiled_transformer_xl_whose_targets_are_not_padded(gpu_step, gpu_shapes, monkeypatch):
    """--compile MODE --eager-loss: beside the compiled Transformer-XL, whose training targets are padded to its
    capacities (its loss compiled), the same compiled model without capacities (its loss eager, as before the loss
    was compiled); built on the CPU, ``.cuda()`` made a no-op."""
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    args = gpu_step.parse_args(["--shape", "wt2-par", "--precision", "32-true", "--compile", "default",
                                "--eager-loss", "--no-supernet"])
    shape = gpu_shapes.SHAPES["wt2-par"]
    models = gpu_step.timed_models(shape, args)
    assert list(models) == ["transformer-xl", "compiled (default)", "compiled, loss eager (default)"]
    built = {name: models[name].build(shape.config("32-true"), shape.vocab)[0] for name in list(models)[1:]}
    y = torch.randint(0, shape.vocab, (2, 8))
    assert built["compiled (default)"].group_targets(y, built["compiled (default)"].target_capacity).valid is not None
    assert built["compiled, loss eager (default)"].target_capacity is None
    assert all("forward" in vars(net) for net in built.values())  # compile_model routes the forward in place


@pytest.mark.slow  # profiles training steps
def test_a_profiled_step_says_how_busy_it_kept_its_device_and_what_took_the_most(benchmark_script):
    """What ``--profile`` prints for a model, here for a tiny Transformer-XL's training step on the CPU (where the
    busy time is the aten ops' own): the wall and busy time a step, busy within wall, then the top ops by their
    own time, largest first, each op once, each share its time over the busy time, adding up to at most all of it.
    Which ops come first is the machine's business (load reorders them), not the summary's."""
    import re

    step_profile, train_step = benchmark_script("step_profile"), benchmark_script("train_step")
    cfg = load_config("tiny", [])
    model = build_fixed_model(cfg.model, 1000).train()
    step = train_step.training_step(model, [torch.optim.Adam(model.parameters())], list(model.parameters()), 0.25)
    tokens = torch.randint(0, 1000, (4, 17))
    step(tokens)

    def run(n):
        for _ in range(n):
            step(tokens)
    profiled = step_profile.profile_steps(run, 3, "cpu")
    lines = step_profile.summary("transformer-xl", profiled, 3, "cpu", top=5)
    head = re.match(r"  transformer-xl: ([\d.]+) ms a step \(wall, under the profiler\), aten ops' own time "
                    r"([\d.]+) ms \((\d+)%\)$", lines[0])
    assert head and 0 < float(head[2]) <= float(head[1]), lines[0]
    phases = re.findall(r"(\w[\w ]*?) ([\d.]+) ms", lines[1].removeprefix("    the host's time a step by phase: "))
    assert [p for p, _ in phases] == ["forward", "loss", "backward", "clip", "optimizer"], lines[1]
    rounding = 0.05 * (len(phases) + 1)  # each figure is printed to 0.1 ms
    assert sum(float(t) for _, t in phases) <= float(head[1]) + rounding and float(phases[0][1]) > 0, lines[1]
    assert lines[2] == "    the top 5 ops a step:"
    rows = [re.match(r"^ +([\d.]+) ms +([\d.]+)%  (aten::\w+)$", line) for line in lines[3:]]
    assert len(rows) == 5 and all(rows), lines
    ms = [float(r[1]) for r in rows]
    assert ms == sorted(ms, reverse=True) and sum(float(r[2]) for r in rows) <= 100.5
    assert len({r[3] for r in rows}) == 5, lines  # one row an op, its calls summed
    busy = float(head[2])  # each share is of the busy time in the head line, both as printed (to 0.1)
    assert all(abs(float(r[2]) - 100 * float(r[1]) / busy) <= 0.06 + float(r[2]) * 0.05 / busy for r in rows), lines


def test_a_profiled_gpu_step_counts_each_kernel_once(benchmark_script):
    """On a GPU the profiler lists a kernel twice: as its own event, and as device time of the op that launched it.
    The busy time and the top list count the kernels alone (as torch's profile table does), so a step that kept
    the GPU busy 3 ms of its 10 reads 30%, not 60%, and names the kernel, not the op; a line before says how many
    launches, graph replays and copies the host made a step, and one the host's time in each phase."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    step_profile = benchmark_script("step_profile")

    def event(key, device_type, device_ms, annotation=False, count=1):
        return SimpleNamespace(key=key, device_type=device_type, is_user_annotation=annotation, count=count,
                               self_device_time_total=device_ms * 1e3, self_cpu_time_total=0.01e3)

    events = [event("aten::mm", DeviceType.CPU, 2.0), event("ampere_bf16_gemm", DeviceType.CUDA, 2.0),
              event("aten::add", DeviceType.CPU, 1.0), event("elementwise_kernel", DeviceType.CUDA, 1.0),
              event("ProfilerStep", DeviceType.CUDA, 3.0, annotation=True),
              event("cudaLaunchKernel", DeviceType.CPU, 0.0, count=6), event("cudaGraphLaunch", DeviceType.CPU, 0.0,
                                                                              count=4),
              event("cudaMemcpyAsync", DeviceType.CPU, 0.0, count=2)]
    profiled = step_profile.Profiled(events, {"forward": 2.0e3, "loss": 4.0e3}, 0.010)
    lines = step_profile.summary("transformer-xl", profiled, 2, "cuda")
    assert lines[:4] == ["  transformer-xl: 5.0 ms a step (wall, under the profiler), device busy 1.5 ms (30%)",
                         "    the host queued it by 3 kernel launches, 2 CUDA-graph replays, 1 copies and fills",
                         "    the host's time a step by phase: forward 1.0 ms, loss 2.0 ms",
                         "    the top 10 kernels a step:"]
    assert [line.split()[-1] for line in lines[4:]] == ["ampere_bf16_gemm", "elementwise_kernel"]


def test_peaks_are_found_by_the_device_name_and_none_for_an_unknown_gpu(gpu_shapes):
    peak = gpu_shapes.peak_tflops
    assert peak("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989.4 and peak("NVIDIA H100 PCIe", "bf16-mixed") == 756.5
    assert peak("NVIDIA H200", "tf32") == 494.7 and peak("NVIDIA A100-SXM4-80GB", "32-true") == 19.5
    assert peak("NVIDIA L40S", "bf16-mixed") == 362.1 and peak("NVIDIA L4", "bf16-mixed") == 121.0
    assert peak("NVIDIA A10", "bf16-mixed") == 125.0 and peak("NVIDIA GeForce RTX 4090", "tf32") == 82.6
    assert peak("Tesla V100-SXM2-16GB", "bf16-mixed") is None


def test_without_cuda_it_says_so_in_one_line_and_exits_2(gpu_step, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_step.main(["--shape", "wt2-par"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and "no CUDA device" in captured.err


@pytest.mark.parametrize("args, needle", [(["--shape", "wt104"], "known: wt2-par, wt103-base, nvidia-base, long"),
                                          (["--precision", "fp8"], "--precision"), (["--steps", "0"], "--steps"),
                                          (["--compile", "cudagraphs"], "--compile"),
                                          (["--layout", "ADX"], "layout 'ADX' is not a string of A, D, I"),
                                          (["--tf32", "--precision", "tf32"], "--tf32"),
                                          (["--twin", "--layout", "ADAD"], "--twin"),
                                          (["--compile-supernet"], "--compile-supernet compiles the supernet"),
                                          (["--eager-loss"], "--eager-loss adds the Transformer-XL compiled")])
@pytest.mark.slow
def test_bad_arguments_are_one_line_and_exit_2(args, needle):
    run = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_step.py"), *args], capture_output=True, text=True,
                         timeout=120)
    err = run.stderr.strip()
    assert run.returncode == 2 and run.stdout == "" and len(err.splitlines()) == 1 and needle in err, err
