"""``parnas study``: "the search finds a model faster than Transformer-XL at the same perplexity", checked.

A study's :class:`parnas.study.plan.Plan` is run here: its searches, its retrains, then every distinct layout timed
side by side in this one process (:func:`parnas.study.measure.measure`); :mod:`parnas.study.report` writes the files.
A rerun with the same ``--out`` skips finished searches (``architecture.json``) and retrains (``metrics.json``) and
resumes interrupted ones from their checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from parnas import architecture, strategy_registry
from parnas.files import write_json_atomic
from parnas.owned_folders import hold_run_dir
from parnas.study.front import width_model
from parnas.study.measure import over_seeds
from parnas.study.plan import (
    ROLES,
    Entry,
    Plan,
    PlannedSearch,
    plan_entries,
    retrain_config,
    retrain_overrides,
    search_config,
    search_dir,
    settings_record,
)
from parnas.study.sub_folders import check_sub_dirs, clear_own_dir, own_sub_dir

Log = Callable[[str], None]


class Progress:
    """``[search 2/6] ...`` lines with the time since the study started."""

    def __init__(self, log: Log) -> None:
        self.log, self.start = log, time.perf_counter()

    def __call__(self, stage: str, index: int, total: int, text: str) -> None:
        seconds = int(time.perf_counter() - self.start)
        self.log(f"[{stage} {index}/{total}] {text}  ({seconds // 60}m{seconds % 60:02d}s)")


def run_searches(plan: Plan, progress: Progress) -> dict[PlannedSearch, dict[str, Any]]:
    """Each search's record: read when finished, resumed from its checkpoint, else run by its strategy, reached
    through the registry (:mod:`parnas.strategy_registry`)."""
    found = {}
    for i, search in enumerate(plan.searches, 1):
        run_dir, name = own_sub_dir(search_dir(plan, search), "study"), search.name
        if (run_dir / "architecture.json").is_file():
            found[search] = architecture.read(run_dir / "architecture.json")
            progress("search", i, len(plan.searches), f"{name}: done already, "
                     f"{architecture.layout_string(architecture.layout(found[search]))}")
            continue
        resume = (run_dir / "checkpoints" / "last.ckpt").is_file()
        progress("search", i, len(plan.searches), f"{name}{' (resumed)' if resume else ''} in {run_dir} ...")
        cfg = search_config(plan, search)
        found[search] = strategy_registry.get(cfg.search.strategy).runner()(cfg, resume=resume)
        progress("search", i, len(plan.searches),
                 f"{name}: found {architecture.layout_string(architecture.layout(found[search]))}")
    return found


def layout_file(plan: Plan, entry: Entry, like: Mapping[str, Any]) -> Path:
    """An architecture JSON for ``entry`` with the model settings and tokenizer of the found record ``like``."""
    path, kinds = plan.out / "layouts" / f"{entry.layout}.json", entry.kinds
    model = dataclasses.replace(architecture.model_config(like), n_blocks=len(kinds))  # the front's are shallower
    model = width_model(model, entry.d_model) if entry.d_model else model  # or narrower
    record = architecture.make_record({architecture.label(i): k for i, k in enumerate(kinds)},
                                      model, like["model"]["vocab_size"],
                                      tokenizer=like.get("tokenizer"), search={"layout": "parnas study"})
    architecture.write(path, record)
    return path


def run_retrains(plan: Plan, entries: Sequence[Entry], like: Mapping[str, Any],
                 progress: Progress) -> dict[str, dict[str, Any]]:
    """Each distinct layout's retrain metrics, keyed by layout string: a layout is trained once per retrain seed
    (``retrain/<LAYOUT>``, then ``retrain/<LAYOUT>-s<k>``), and its metrics are the first seed's with the
    perplexities averaged over the seeds (:func:`parnas.study.measure.over_seeds`)."""
    from parnas.retrain.run import retrain

    layouts: dict[str, list[Entry]] = {}
    for entry in entries:
        layouts.setdefault(entry.layout, []).append(entry)
    runs = [(code, k) for code in layouts for k in range(plan.retrain_seeds)]
    metrics: dict[str, list[dict[str, Any]]] = {}
    for i, (code, k) in enumerate(runs, 1):
        roles = layouts[code]
        run_dir = own_sub_dir(plan.out / "retrain" / (code if k == 0 else f"{code}-s{k}"), "study")
        names = ", ".join(sorted({e.role for e in roles}, key=ROLES.index)) + (f" (retrain seed {k})" if k else "")
        if (run_dir / "metrics.json").is_file():
            metrics.setdefault(code, []).append(json.loads((run_dir / "metrics.json").read_text()))
            progress("retrain", i, len(runs), f"{names} {code}: done already, val ppl {_ppl(metrics[code][-1])}")
            continue
        resume = (run_dir / "checkpoints" / "last.ckpt").is_file()
        if not resume:
            clear_own_dir(run_dir)  # interrupted before its first checkpoint: start clean
        progress("retrain", i, len(runs), f"{names} {code}{' (resumed)' if resume else ''} ...")
        arch = layout_file(plan, roles[0], like)
        metrics.setdefault(code, []).append(retrain(str(arch), plan.config, retrain_overrides(plan, run_dir, k),
                                                    resume=resume))
        progress("retrain", i, len(runs), f"{names} {code}: val ppl {_ppl(metrics[code][-1])}")
    return {code: over_seeds(runs) for code, runs in metrics.items()}


def _ppl(metrics: Mapping[str, Any]) -> str:
    return "-" if metrics.get("val_ppl") is None else f"{metrics['val_ppl']:.2f}"


def run_study(plan: Plan, log: Log = print) -> dict[str, Any]:
    """Search, retrain, time and report; returns what ``<out>/study.json`` holds. The study holds its folder, and runs,
    resumes, clears or reads only the sub-folders of ``search/`` and ``retrain/`` it made
    (:mod:`parnas.study.sub_folders`): one it did not make is refused in one line, before any work, and kept."""
    with hold_run_dir(plan.out):
        check_sub_dirs(plan.out, ("search", "retrain"), "study")
        return _run_study(plan, log)


def _run_study(plan: Plan, log: Log) -> dict[str, Any]:
    from parnas.study.measure import measure, priced_by_table
    from parnas.study.ranking import measure_ranking
    from parnas.study.report import build_rows, write_report
    from parnas.study.space import census_record

    progress = Progress(log)
    plan.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(plan.out / "settings.json", settings_record(plan))
    found = run_searches(plan, progress)
    entries = plan_entries(plan, found)
    like = next(iter(found.values()))
    metrics = run_retrains(plan, entries, like, progress)
    layouts = {e.layout: (e.kinds, e.d_model) for e in entries}
    cfg, vocab_size = retrain_config(plan), like["model"]["vocab_size"]
    timing = measure(cfg, layouts, vocab_size, progress)
    if plan.base.search.latency_table is not None:  # the target device's costs, as the searches had them
        timing = priced_by_table(timing, cfg, layouts, vocab_size)
    rows = build_rows(entries, metrics, timing, plan.out, reversible=plan.base.model.reversible)
    shared = [e for e in entries if e.role in ("transformer-xl", "front", "space") and e.d_model is None]
    ranking = measure_ranking([(s.name, search_dir(plan, s), search_config(plan, s),
                                shared + [e for e in entries if (e.budget, e.seed, e.candidates)
                                          == (s.budget, s.seed, s.label) and e.role != "transformer-xl"])
                               for s in found], metrics, progress)
    study = write_report(plan, rows, timing, ranking, census_record(plan))
    log(f"written {plan.out / 'study.md'}, study.csv, study.png and study.json")
    return study
