"""What a study measures once its runs are done: side-by-side timings of the layouts, and a layout's
perplexities over its retrain seeds."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from parnas.config import Config
from parnas.study.table import mean_of, seed_spread


def over_seeds(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One layout's metrics over its retrain seeds: the first run's, with val/test ppl their mean over the seeds
    whose perplexity is finite, ``val_ppl_std`` (None for one seed) and ``val_ppl_seeds``, each seed's."""
    out = dict(runs[0])
    for key in ("val_ppl", "test_ppl"):
        seeds = [r.get(key) for r in runs]
        out[key], out[f"{key}_seeds"] = mean_of(seeds), seeds
    out["val_ppl_std"] = seed_spread(out["val_ppl_seeds"])
    return out


def measure(cfg: Config, layouts: Mapping[str, tuple[Sequence[str], int | None]], vocab_size: int,
            progress: Callable[[str, int, int, str], None]) -> dict[str, Any]:
    """Train step, inference segment and generated-token times of every layout (key -> its kinds and its
    ``d_model``, None for the config's), side by side in this process (:mod:`parnas.training.side_by_side`), in the
    latency module's :data:`~parnas.training.latency.MIN_ROUNDS` alternating rounds, its least for a steady median;
    ``target`` names the one the verdicts judge by (``search.latency_target``)."""
    from parnas.study.front import width_model
    from parnas.training.devices import training_device
    from parnas.training.latency import MIN_ROUNDS
    from parnas.training.side_by_side import time_side_by_side

    models = {code: (kinds, width_model(cfg.model, d) if d else None) for code, (kinds, d) in layouts.items()}
    device = training_device(cfg.train)  # where the retrains ran
    return {**time_side_by_side(cfg, MIN_ROUNDS, models, vocab_size, device, progress),
            "target": cfg.search.latency_target}


def priced_by_table(timing: Mapping[str, Any], cfg: Config, layouts: Mapping[str, tuple[Sequence[str], int | None]],
                    vocab_size: int) -> dict[str, Any]:
    """``timing`` with the step times of every target ``search.latency_table`` prices replaced by its predictions, so
    the study's costs are the target device's, as its searches' were; what was measured here stays under
    ``measured``, a target the table lacks keeps this machine's times, and ``priced_by`` says which."""
    from parnas.training.devices import training_device
    from parnas.training.latency_table import MODES, load_table_for, table_key

    kinds = sorted({k for layout, _ in layouts.values() for k in layout} | {"identity"})
    key = table_key(cfg, vocab_size, kinds, training_device(cfg.train))
    table = load_table_for(cfg.search.latency_table, key, target=cfg.search.latency_target)
    out = dict(timing, measured={m: timing[f"{m}_step_ms"] for m in MODES if f"{m}_step_ms" in timing},
               priced_by={"table": str(cfg.search.latency_table), "device": table.key["device"],
                          "targets": list(table.modes)})
    for mode in table.modes:
        out[f"{mode}_step_ms"] = {code: table.predict(layout, mode) for code, (layout, _) in layouts.items()}
    return out
