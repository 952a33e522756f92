"""Step times of whole fixed models, measured side by side in one process.

(Minimal version for ``parnas study``; the latency table replaces this file.)

:func:`time_layouts` builds each layout's fixed model at the run's shapes and
times it in alternating rounds (layout 1, 2, ..., n, then again), so a machine
that slows down or speeds up during the measurement shifts every layout alike;
each layout's figure is the median over rounds. Memory is carried from step to
step, as in training, so attention blocks attend over a full memory.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

from parnas.config import Config
from parnas.model import build_fixed_model

STEPS_PER_ROUND = 3
WARMUP_STEPS = 2


def zipf_tokens(vocab_size: int, shape: tuple[int, ...], generator: np.random.Generator) -> torch.Tensor:
    """Token ids drawn by rank frequency ~ 1/rank, like text: adaptive-softmax tails are hit as rarely as in text."""
    p = 1.0 / np.arange(1, vocab_size + 1)
    return torch.from_numpy(generator.choice(vocab_size, size=shape, p=p / p.sum()))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_layouts(layouts: Sequence[Sequence[str]], cfg: Config, vocab_size: int, mode: str = "train",
                 rounds: int = 5, device: torch.device | str | None = None) -> list[float]:
    """Median milliseconds per step of each layout's fixed model, in the order given.

    Both modes run on ``(data.batch_size, data.seg_len)`` batches. ``mode="train"``: forward, backward
    and an Adam step (with the run's clipping) in training mode; ``mode="inference"``: a forward pass
    and the head's log-likelihood without gradients. Every round times ``STEPS_PER_ROUND`` steps of
    every layout in turn, after ``WARMUP_STEPS`` untimed steps each.
    """
    if mode not in ("train", "inference"):
        raise ValueError(f"mode must be train or inference, not {mode!r}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    train = mode == "train"
    B, L = cfg.data.batch_size, cfg.data.seg_len
    gen = np.random.default_rng(0)
    x, y = (zipf_tokens(vocab_size, (B, L), gen).to(device) for _ in range(2))
    torch.manual_seed(0)
    runs = []
    for kinds in layouts:
        model = build_fixed_model(cfg.model, vocab_size, kinds).to(device).train(train)
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr) if train else None
        runs.append({"model": model, "optimizer": optimizer, "mems": None})

    def step(run: dict) -> None:
        model, optimizer = run["model"], run["optimizer"]
        if optimizer is None:
            with torch.inference_mode():
                h, run["mems"] = model(x, run["mems"])  # (B, L, D)
                model.nll(h, y)
            return
        h, run["mems"] = model(x, run["mems"])
        model.nll(h, y).mean().backward()
        if cfg.train.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for run in runs:
        for _ in range(WARMUP_STEPS):
            step(run)
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        for run, record in zip(runs, times):
            _sync(device)
            start = time.perf_counter()
            for _ in range(STEPS_PER_ROUND):
                step(run)
            _sync(device)
            record.append((time.perf_counter() - start) * 1e3 / STEPS_PER_ROUND)
    return [statistics.median(t) for t in times]
