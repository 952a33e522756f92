"""Which cost model a search prices its blocks with: FLOPs, this machine's latency table, a table timed elsewhere,
or the table a resumed search started with; and the exported architecture's predicted latency against
Transformer-XL's and the budget, as architecture.json records it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from parnas.config import Config
from parnas.data.corpora import load_splits
from parnas.errors import ParnasError
from parnas.strategies.costs import CostModel, flops_model, latency_costs
from parnas.strategies.nni_trial import experiment_folder
from parnas.strategies.par_settings import latency_budget
from parnas.training.devices import check_devices, training_device
from parnas.training.latency_cache import (
    cache_path,
    check_cache,
    describe,
    experiment_table,
    latency_table,
    newest_covering,
    unsteady,
)
from parnas.training.latency_table import (
    MODES,
    LatencyTable,
    check_targets,
    load_table_for,
    read_table,
    table_key,
    target_memories,
)

PINNED_TABLE = "latency_table.json"  # in the run directory: the table a search started with


def cost_kinds(cfg: Config) -> list[str]:
    """The kinds a search prices: its candidates and Transformer-XL's (the reference)."""
    return sorted(set(cfg.search.candidates) | {"attention", "dense"})


def time_latency_table(cfg: Config, *, refresh: bool = False, targets: Sequence[str] = MODES) -> LatencyTable:
    """``parnas latency``: the table a search with ``cfg`` would time on this machine (its cache's, unless
    ``refresh``), of ``targets`` (all three by default), for ``search.latency_table`` on any machine. Checks the
    targets, the device and the data first, as a search."""
    targets = check_targets(targets)
    check_devices(cfg.train)
    tokenizer, _ = load_splits(cfg.data)
    cfg.model.check_vocab(tokenizer.vocab_size)
    return latency_table(cfg, tokenizer.vocab_size, cost_kinds(cfg), training_device(cfg.train), refresh=refresh,
                         targets=targets)[0]


def check_latency_table(cfg: Config) -> list[str]:
    """``parnas latency --check``: how far this machine's cached table for ``cfg`` is from a timing taken now."""
    check_devices(cfg.train)
    tokenizer, _ = load_splits(cfg.data)
    cfg.model.check_vocab(tokenizer.vocab_size)
    return check_cache(cfg, tokenizer.vocab_size, cost_kinds(cfg), training_device(cfg.train))


def cost_model(cfg: Config, vocab_size: int, device: torch.device, pinned: Path | None = None,
               warn: Callable[[str], None] | None = None) -> tuple[CostModel, dict[str, Any] | None]:
    """Block costs for the candidates and Transformer-XL's kinds (the reference), with the latency table's record when
    costs are measured. ``pinned``: a resumed search's own table, so its costs do not change with tables timed since
    it started; ``search.latency_table``: a table timed elsewhere, checked against this run's shapes (nothing timed);
    ``warn``: where an unsteady timing is reported. A search with neither budget nor penalty is priced all the same:
    the final pick's budget and guard, the web UI's ``latency_ratio`` and ``pareto.png`` read its prices."""
    kinds = cost_kinds(cfg)
    if cfg.search.penalty_cost == "flops":
        return flops_model(kinds, cfg.model, cfg.data.seg_len, cfg.data.batch_size), None
    given = cfg.search.latency_table
    if pinned is not None and pinned.is_file():
        table, cached, source = read_table(pinned), True, "the one this run started with"
    elif given is not None:
        key = table_key(cfg, vocab_size, sorted({*kinds, "identity"}), device)
        table, cached = load_table_for(given, key, target=cfg.search.latency_target), True
        source = f"given, {given}"
    else:
        def obtain() -> LatencyTable:
            nonlocal cached, source
            table, cached = latency_table(cfg, vocab_size, kinds, device, **({"warn": warn} if warn else {}),
                                          targets=(cfg.search.latency_target,))  # its own target alone
            source = "cached" if cached else "timed now, " + ("cached" if unsteady(table) is None else "not cached")
            return table

        cached, source, shared = False, "", experiment_folder()
        if shared is None:
            table = obtain()
        else:  # one table for every trial of the experiment
            key = table_key(cfg, vocab_size, sorted({*kinds, "identity"}), device)
            table, given_path, reused = experiment_table(shared / "latency", key, obtain)
            given, cached = str(given_path), cached or reused
            source = (f"the experiment's, {given}, which an earlier trial made" if reused else
                      f"{source}; the experiment's from now on, {given}")
    return latency_costs(table, cfg.model.n_blocks, cfg.search.latency_target), {
        "table": table, "cached": cached, "path": given, "timed_here": cfg.search.latency_table is None,
        "memory": target_memories(cfg), "source": source}


def table_line(latency: dict[str, Any]) -> str:
    """Which latency table prices the run (cached, given, timed now) and how steadily it was timed."""
    return f"latency table: {latency['source']}; {describe(latency['table'])}"


def latency_summary(costs: CostModel, latency: dict[str, Any] | None, kinds: list[str],
                    budget: float | None) -> dict[str, Any] | None:
    """The exported architecture's predicted latency against Transformer-XL's and the budget (architecture.json);
    ``device``: where the costs were timed (a given table's, maybe not this machine)."""
    if latency is None:
        return None
    table, target = latency["table"], costs.target or "train"
    ratio = costs.ratio(kinds)
    other = {f"{m}_{'token' if m == 'generate' else 'step'}_ms": round(table.predict(kinds, m), 3)
             for m in table.modes}  # the targets the table prices (a search times its own alone)
    return {"unit": "ms", "device": table.key["device"], "precision": table.key.get("precision"),
            "table": latency.get("path"), "priced_with": latency.get("source"),
            "timed_at": (table.timing or {}).get("timed_at"), "timed_here": latency.get("timed_here"), "target": target,
            "target_ms": round(table.predict(kinds, target), 3),
            **other,
            "transformer_xl_ms": round(table.transformer_xl_ms(len(kinds), target), 3), "ratio": round(ratio, 4),
            "budget": budget, "within_budget": None if budget is None else ratio <= budget + 1e-9,
            "constant_ms": table.constant_ms, "block_ms": table.kinds_ms, "memory": latency.get("memory")}


def check_budget(cfg: Config, costs: CostModel) -> None:
    """A budget below the cheapest layout of the candidates cannot be met: say so before training."""
    budget = latency_budget(cfg.search)
    if budget is None:
        return
    cheapest = min(cfg.search.candidates, key=costs.per_kind.__getitem__)
    floor = costs.ratio([cheapest] * cfg.model.n_blocks)
    if floor > budget:
        raise ParnasError(f"search.{cfg.search.strategy}.latency_budget {budget} is out of reach: the cheapest "
                          f"architecture (all {cheapest}) is predicted at {floor:.3f} of Transformer-XL's step time "
                          "here (embedding, head and optimiser cost the same in every layout); raise the budget")


def dry_run_budget(cfg: Config) -> str | None:
    """``--dry-run``'s check of PAR's ``latency_budget``, timing nothing: against the given or cached table the search
    would price with, refused as the search refuses it (:func:`check_budget`); without one, a line saying so."""
    from parnas.training.dry_run import planned_vocabulary

    budget, given, target = latency_budget(cfg.search), cfg.search.latency_table, cfg.search.latency_target
    if budget is None or cfg.search.penalty_cost == "flops":
        return None
    key = table_key(cfg, planned_vocabulary(cfg.data), sorted({*cost_kinds(cfg), "identity"}),
                    training_device(cfg.train))
    if given is not None:
        table, where = load_table_for(given, key, target=target), f"the given table {given}"
    else:
        table, where = newest_covering(key, cache_path(key).parent, (target,)), "this machine's cached table"
    if table is None:
        return (f"  latency budget {budget}: checked once the search times its latency table (none is cached for "
                "these shapes on this machine)")
    costs = latency_costs(table, cfg.model.n_blocks, target)
    check_budget(cfg, costs)
    cheapest = min(cfg.search.candidates, key=costs.per_kind.__getitem__)
    return (f"  latency budget {budget}: within reach by {where} (the cheapest layout, all {cheapest}, at "
            f"{costs.ratio([cheapest] * cfg.model.n_blocks):.3f} of Transformer-XL's)")
