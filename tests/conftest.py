"""Shared fixtures: a private cache per test session, and small slices of WikiText-2."""

import os
from pathlib import Path

import pytest

WT2 = Path(os.environ.get("PARNAS_DATA_DIR") or "/nonexistent") / "wikitext-2"
needs_wt2 = pytest.mark.skipif(not (WT2 / "train.txt").is_file(), reason="WikiText-2 not found under PARNAS_DATA_DIR")


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """Tokenizers and token ids go to a per-session cache, never ~/.cache."""
    monkeypatch.setenv("PARNAS_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "parnas-cache"))


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
    and can make a tiny step 50x slower. One thread keeps every test's time what it is on an idle machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
