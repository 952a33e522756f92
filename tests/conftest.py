"""Shared fixtures: a private cache per test session (its tokenizers kept across runs), and small slices of
WikiText-2."""

import os
from pathlib import Path

import pytest

# Inductor compiles a graph's kernels in a pool of one process per core, each loading torch first: for the
# tests' tiny graphs on a 2-core machine it costs more than it saves. Read when torch._inductor.config is first
# imported, so set here.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

WT2 = Path(os.environ.get("PARNAS_DATA_DIR") or "/nonexistent") / "wikitext-2"
needs_wt2 = pytest.mark.skipif(not (WT2 / "train.txt").is_file(), reason="WikiText-2 not found under PARNAS_DATA_DIR")


def tokenizer_store(config: pytest.Config) -> Path | None:
    """Where tokenizers outlive a test run: pytest's cache folder (``.pytest_cache``, emptied by
    ``pytest --cache-clear`` and ``make clean``), in a subfolder named by the source of the module that trains them.
    Inside it the product's own cache keys each tokenizer by its corpus's sha256 and its settings and checks it
    when it loads it (a damaged one is built again), so the store is verified, not trusted; a change to how
    tokenizers are built starts a new subfolder, and the old ones are removed. None without pytest's cache."""
    import hashlib
    import shutil

    if getattr(config, "cache", None) is None:
        return None
    import parnas.data.tokenizer as module

    version = hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()[:12]
    root = config.cache.mkdir("parnas-tokenizers")
    for old in root.iterdir():
        if old.name != version:
            shutil.rmtree(old, ignore_errors=True)
    (root / version).mkdir(exist_ok=True)
    return root / version


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory, pytestconfig) -> Path:
    """The session's private cache: latency tables and remembered corpus folders start empty in every run, but its
    ``tokenizers/`` is the store kept across runs, so a tokenizer is trained only by the first test that needs it,
    once per checkout and corpus."""
    cache = tmp_path_factory.getbasetemp() / "parnas-cache"
    cache.mkdir(exist_ok=True)
    store = tokenizer_store(pytestconfig)
    if store is not None:
        (cache / "tokenizers").symlink_to(store, target_is_directory=True)
    return cache


@pytest.fixture(scope="session")
def wt2_tokenizer(session_cache) -> None:
    """The presets' WikiText-2 tokenizer in the cache, trained quietly if it is not there yet: trained on a corpus
    that large, it says so in a line on stderr, which would otherwise land in the output of the test that first
    needed it (a refusal's one line among them). Tests that check what a command over WikiText-2 prints ask for it."""
    import contextlib
    import io

    if not (WT2 / "train.txt").is_file():
        return
    from parnas.config import load_config
    from parnas.data.tokenizer import build_tokenizer

    with contextlib.redirect_stderr(io.StringIO()):
        for preset in ("tiny", "wt2-cpu"):
            build_tokenizer(load_config(preset).data, WT2, session_cache)


@pytest.fixture(autouse=True)
def private_cache(session_cache, monkeypatch, request):
    """Tokenizers and token ids go to a per-session cache, never ~/.cache. A slow test may run the presets on the
    whole of WikiText-2: it gets that tokenizer first (no fast test reads more than a slice)."""
    monkeypatch.setenv("PARNAS_CACHE_DIR", str(session_cache))
    if request.node.get_closest_marker("slow"):
        request.getfixturevalue("wt2_tokenizer")


@pytest.fixture(scope="session")
def wt2_slice(tmp_path_factory) -> Path:
    """The first lines of WikiText-2's splits (about 170k train / 20k valid / 26k test words)."""
    if not (WT2 / "train.txt").is_file():
        pytest.skip("WikiText-2 not found under PARNAS_DATA_DIR")
    folder = tmp_path_factory.mktemp("wt2-slice")
    for split, lines in (("train", 3000), ("valid", 400), ("test", 400)):
        with open(WT2 / f"{split}.txt") as src:
            (folder / f"{split}.txt").write_text("".join(line for _, line in zip(range(lines), src)))
    return folder


@pytest.fixture
def shrunk_search_yaml(tmp_path, wt2_slice):
    """``search.yaml`` shrunk to tiny trials of ``trials`` trials on the slice (FLOPs priced, so nothing is timed),
    its experiments under ``tmp_path``: what the tests that start NNI run. Returns the file's path."""
    import yaml

    repo = Path(__file__).resolve().parents[1]

    def write(trials: int) -> Path:
        config = yaml.safe_load((repo / "search.yaml").read_text())
        config["searchSpace"].pop("search.par-gumbel-darts.latency_budget")
        config.update(
            trialCommand=(f"parnas search --config tiny --set data.path={wt2_slice} --set data.vocab_size=300 "
                          "--set 'model.cutoffs=[100, 200]' --set train.max_steps=20 --set train.eval_every=10 "
                          "--set search.log_every=5 --set search.penalty_cost=flops"),
            trialCodeDirectory=str(repo), maxTrialNumber=trials, trialConcurrency=1,
            experimentWorkingDirectory=str(tmp_path / "experiments"))
        path = tmp_path / "search.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    return write


@pytest.fixture(scope="session")
def wt2_short_eval(wt2_slice, tmp_path_factory) -> Path:
    """The WikiText-2 slice's training text (its tokenizers are the slice's) with 40-line validation and test
    splits: a run's evaluations take a fraction of a second. For runs that tests only read."""
    folder = tmp_path_factory.mktemp("wt2-short-eval")
    (folder / "train.txt").write_text((wt2_slice / "train.txt").read_text())
    for split in ("valid", "test"):
        lines = (wt2_slice / f"{split}.txt").read_text().splitlines(keepends=True)
        (folder / f"{split}.txt").write_text("".join(lines[:40]))
    return folder


@pytest.fixture(scope="session")
def micro(wt2_slice, tmp_path_factory) -> Path:
    """A few kB of WikiText-2, read byte by byte (char tokenizer): runs of a few steps take seconds."""
    folder = tmp_path_factory.mktemp("micro")
    for split, size in (("train", 12_000), ("valid", 3_000), ("test", 3_000)):
        text = (wt2_slice / f"{split}.txt").read_text()[:size]
        (folder / f"{split}.txt").write_text(text[:text.rindex("\n") + 1])
    return folder


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tests must pass on a loaded 2-core machine: two threads per process there oversubscribe the cores
    and can make a tiny step 50x slower. One thread keeps every test's time what it is on an idle machine;
    the commands tests run take it from ``OMP_NUM_THREADS``, as a user's would."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def benchmark_script():
    """``benchmark_script(name)`` imports the script ``benchmarks/<name>.py`` as it runs (its folder on sys.path:
    the scripts import each other's helpers). Not named ``benchmark``: pytest-benchmark, installed on the GPU
    images, owns that fixture name and aborts the whole session when another fixture returns something else."""
    import importlib
    import sys

    folder = str(Path(__file__).parents[1] / "benchmarks")
    sys.path.insert(0, folder)
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(folder)


@pytest.fixture
def micro_corpus(micro, tmp_path):
    """``micro`` in a folder of the test's own, which the test may change: a pass over its streams takes only a
    few dozen steps."""
    import shutil

    return shutil.copytree(micro, tmp_path / "micro")


@pytest.fixture
def small_corpus(wt2_short_eval, tmp_path):
    """``wt2_short_eval`` in a folder of the test's own, which the test may change."""
    import shutil

    return shutil.copytree(wt2_short_eval, tmp_path / "corpus")


@pytest.fixture
def kill_at():
    """``kill_at(step)``: a Lightning callback that stops the run dead when step ``step`` ends (the checkpoint
    before it, and its validation, are on disk), as a killed process would."""
    import pytorch_lightning as pl

    class Kill(pl.Callback):
        def __init__(self, step: int) -> None:
            self.step = step

        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == self.step:
                raise RuntimeError(f"killed at step {self.step}")

    return Kill


@pytest.fixture
def graphs_made():
    """``graphs_made(step, stream, seg_len, steps)``: compile ``step(x, y, mems) -> (loss, mems)`` with a backend
    that only counts the graphs Dynamo captures, train ``steps`` segments of ``stream`` (B, T) through it,
    and return how many graphs existed after each step."""
    import torch
    import torch._dynamo

    def run(step, stream, seg_len, steps):
        graphs, made, mems = [], [], None

        def count(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(step, backend=count)
        try:
            for t in range(steps):
                x, y = stream[:, t * seg_len:(t + 1) * seg_len], stream[:, t * seg_len + 1:(t + 1) * seg_len + 1]
                loss, mems = compiled(x, y, mems)
                loss.backward()
                made.append(len(graphs))
        finally:
            torch._dynamo.reset()
        return made
    return run


@pytest.fixture
def run_layout():
    """``run_layout(blocks, *settings)``: a tiny fixed model of these blocks (500 tokens), its forward pass over a
    (4, 16) batch, and a check that it then decodes tokens one at a time with its memory (as ``parnas generate``).
    Returns (model, h, mems) of the forward pass, in training mode."""
    import torch

    from parnas.config import load_config
    from parnas.nn.model import build_fixed_model

    def run(blocks: str, *settings: str):
        cfg = load_config("tiny", [f"model.blocks={blocks}", *settings])
        torch.manual_seed(0)
        model = build_fixed_model(cfg.model, 500)
        x = torch.randint(0, 500, (4, 16))
        h, mems = model(x)
        model.eval()
        with torch.no_grad():
            out, memory = model(x[:1, :5])
            for _ in range(3):
                out, memory = model(model.log_probs(out[:, -1]).argmax(-1, keepdim=True), memory)
        assert out.shape == (1, 1, cfg.model.d_model) and torch.isfinite(out).all()
        return model.train(), h, mems
    return run


@pytest.fixture(autouse=True)
def threads_environment(monkeypatch):
    """What a command sets for its threads (the environment's OMP_NUM_THREADS, OpenMP's wait policy, torch's
    threads) undone after each test."""
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ["OMP_WAIT_POLICY"])
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def steady_latency_timing():
    """A latency table a test times counts as steady, however busy the machine (tests must pass on a loaded
    one): what a busy machine does to the cache is tested with its load and spread injected
    (test_latency_cache.py)."""
    from parnas.training import latency, latency_cache

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(latency_cache, "SPREAD_LIMIT", float("inf"))
        mp.setattr(latency, "runnable_elsewhere", lambda: 0.0)
        yield
