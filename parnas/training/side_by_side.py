"""Models timed side by side: every target of several models, in one process, in alternating rounds.

Runs timed in their own processes at different moments compare the machine's load as much as the models; timed
round by round, a load that comes and goes slows every model alike. ``parnas study`` and ``parnas compare`` judge
speed by these timings.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from parnas.config import TARGET_LABELS, Config, ModelConfig
from parnas.training.latency import relative_spread, time_layout_rounds
from parnas.training.latency_table import MODES, device_name, target_memories


def time_side_by_side(cfg: Config, rounds: int, layouts: Mapping[str, tuple[Sequence[str], ModelConfig | None]],
                      vocab_size: int, device: torch.device,
                      progress: Callable[[str, int, int, str], None] | None = None) -> dict[str, Any]:
    """ms per step of every target of every layout (name -> its kinds and its model settings, None for ``cfg``'s),
    in ``rounds`` alternating rounds on ``device``: ``{"<target>_step_ms": {name: median}}`` and
    ``{"<target>_spread": {name: spread}}`` (:func:`relative_spread`), with what they were timed with and the
    1-minute load average after them. ``progress(stage, i, n, line)`` hears of each target and of a long phase."""
    timing: dict[str, Any] = {"device": device_name(device), "threads": torch.get_num_threads(),
                              "torch": torch.__version__, "rounds": rounds, "batch_size": cfg.data.batch_size,
                              "seg_len": cfg.data.seg_len, "mem_len": cfg.model.mem_len,
                              "memory": target_memories(cfg)}
    for i, mode in enumerate(MODES):
        def line(text: str, i: int = i) -> None:  # a warm-up or rounds running long: how far along
            if progress is not None:
                progress("timing", i + 1, len(MODES), text)

        line(f"{TARGET_LABELS[mode]}s of {len(layouts)} layouts, {rounds} alternating rounds on {timing['device']} ...")
        times = time_layout_rounds([kinds for kinds, _ in layouts.values()], cfg, vocab_size, mode=mode,
                                   rounds=rounds, device=device, models=[model for _, model in layouts.values()],
                                   progress=line)
        timing[f"{mode}_step_ms"] = {name: statistics.median(t) for name, t in zip(layouts, times)}
        timing[f"{mode}_spread"] = {name: relative_spread(t, t) for name, t in zip(layouts, times)}
    try:
        timing["load"] = round(os.getloadavg()[0], 2)  # the 1-minute load average the rounds ended in
    except OSError:  # not every system says
        timing["load"] = None
    return timing


def timed_tokens_per_s(timing: Mapping[str, Any], name: str, mode: str) -> float:
    """Tokens a second of ``name`` at ``mode``: a train or inference step handles a batch of segments, a
    generation step one token."""
    tokens = 1 if mode == "generate" else timing["batch_size"] * timing["seg_len"]
    return tokens * 1e3 / timing[f"{mode}_step_ms"][name]
