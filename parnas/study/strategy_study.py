"""``parnas strategies``: PAR's Gumbel-DARTS against NNI's own strategies, at an equal search budget.

Every strategy searches the same space with the same config, seeds and training steps: a one-shot strategy trains its
supernet for the search steps (S of ``--steps S,R``); a multi-trial one runs ``--trials`` trials of
``search_steps // trials`` steps each. No latency budget is set (NNI's strategies do not price latency). Every
distinct found architecture is then retrained from scratch (K times, R steps), and ``strategies.md`` /
``strategies.json`` give per strategy the architectures, their cost ratio, the retrained perplexity and the search's
wall time, with a verdict: does PAR's strategy find a better model than NNI's built-ins at that budget? Searches go to
``<out>/search/<strategy>-s<seed>``, retrains to ``<out>/retrain/<LAYOUT>[-s<k>]``; a rerun skips finished ones, and
a sub-folder the study did not make is refused, and kept (:func:`parnas.study.sub_folders.own_sub_dir`).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from parnas import architecture, strategy_registry
from parnas.config import Config, load_config
from parnas.errors import ConfigError, ParnasError
from parnas.files import write_json_atomic, write_text_atomic
from parnas.overrides import as_given
from parnas.owned_folders import hold_run_dir
from parnas.strategy_registry import PAR_GUMBEL_DARTS
from parnas.study.sub_folders import check_sub_dirs, own_sub_dir
from parnas.study.table import mean_of, seed_spread


def parse_strategies(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = [n for n in names if not strategy_registry.is_known(n)]
    if unknown or len(names) < 2:
        raise ConfigError(f"strategies: give two or more of {', '.join(strategy_registry.names())}"
                          + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return names


def search_settings(strategy: str, seed: int, search_steps: int, trials: int, out: Path) -> list[str]:
    multi_trial = strategy_registry.get(strategy).family == strategy_registry.MULTI_TRIAL
    steps = max(1, search_steps // trials) if multi_trial else search_steps
    unpriced = [f"search.{PAR_GUMBEL_DARTS}.latency_budget=null"] if strategy == PAR_GUMBEL_DARTS else []
    return [f"search.strategy={strategy}", f"train.seed={seed}", f"train.max_steps={steps}",
            f"train.eval_every={steps}", f"search.trials={trials}", *unpriced,
            as_given("search.out_dir", str(out / "search" / f"{strategy}-s{seed}"))]


def run_search_with(config: str | None, sets: Sequence[str], cfg: Config) -> dict[str, Any]:
    """One search of ``cfg.search.strategy``; returns its record. PAR's runs here; NNI's each run in a process of
    their own (``parnas search``), since an NNI experiment leaves state in its process that garbles the command
    channel of the next one."""
    if cfg.search.strategy == PAR_GUMBEL_DARTS:
        return strategy_registry.get(PAR_GUMBEL_DARTS).runner()(cfg, resume=False)
    command = [sys.executable, "-m", "parnas.cli", "search", *(["--config", config] if config else []),
               *(a for s in sets for a in ("--set", s))]
    if subprocess.run(command).returncode:
        raise ParnasError(f"the {cfg.search.strategy} search failed: {shlex.join(command)}")
    return architecture.read(Path(cfg.search.out_dir) / "architecture.json")


def run_strategy_study(config: str | None, overrides: Sequence[str], strategies: Sequence[str], seeds: int,
                       out: Path, *, search_steps: int, retrain_steps: int, trials: int, retrain_seeds: int = 1,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
    """Search with every strategy and seed, retrain what they found, and write the comparison. The study holds
    ``out`` (:func:`parnas.owned_folders.hold_run_dir`), and each search and retrain the sub-folder it writes; the
    counts are >= 1 as the command's argument types give them."""
    for strategy in strategies:  # every config checked, and what its strategy refuses refused, before anything runs
        cfg = load_config(config, [*overrides, *search_settings(strategy, 0, search_steps, trials, out)])
        strategy_registry.get(strategy).check_config(cfg, False)
    with hold_run_dir(out):
        check_sub_dirs(out, ("search", "retrain"), "study")  # it uses only the sub-folders it made
        return _run_strategy_study(config, overrides, strategies, seeds, out, search_steps=search_steps,
                                   retrain_steps=retrain_steps, trials=trials, retrain_seeds=retrain_seeds, log=log)


def _run_strategy_study(config: str | None, overrides: Sequence[str], strategies: Sequence[str], seeds: int,
                        out: Path, *, search_steps: int, retrain_steps: int, trials: int, retrain_seeds: int,
                        log: Callable[[str], None]) -> dict[str, Any]:
    from parnas.retrain.run import retrain

    runs: list[dict[str, Any]] = []
    for strategy in strategies:
        for seed in range(seeds):
            sets = [*overrides, *search_settings(strategy, seed, search_steps, trials, out)]
            cfg = load_config(config, sets)
            done = own_sub_dir(cfg.search.out_dir, "study") / "architecture.json"
            start = time.perf_counter()
            record = architecture.read(done) if done.is_file() else run_search_with(config, sets, cfg)
            seconds = record["search"].get("seconds") or round(time.perf_counter() - start, 1)
            layout = architecture.layout_string(architecture.layout(record))
            log(f"[search] {strategy}, seed {seed}: {layout} in {seconds:.0f} s")
            runs.append({"strategy": strategy, "seed": seed, "layout": layout, "record": str(done),
                         "cost_ratio": (record["search"].get("latency") or {}).get("ratio",
                                                                                  record["search"].get("cost_ratio")),
                         "search_seconds": seconds})
    retrained: dict[str, list[float]] = {}
    base_seed = load_config(config, overrides).train.seed
    for run in runs:
        for k in range(retrain_seeds):
            run_dir = out / "retrain" / (run["layout"] if k == 0 else f"{run['layout']}-s{k}")
            if len(retrained.get(run["layout"], [])) > k:
                continue
            metrics_file = own_sub_dir(run_dir, "study") / "metrics.json"
            if metrics_file.is_file():
                metrics = json.loads(metrics_file.read_text())
            else:
                sets = [*overrides, f"train.max_steps={retrain_steps}", f"train.eval_every={retrain_steps}",
                        as_given("train.out_dir", str(run_dir))]
                metrics = retrain(run["record"], config, [*sets, f"train.seed={base_seed + k}"] if k else sets)
            retrained.setdefault(run["layout"], []).append(metrics.get("val_ppl"))
            log(f"[retrain] {run['layout']} (retrain seed {k}): val ppl {metrics.get('val_ppl')}")
    for run in runs:
        run["val_ppl"] = mean_of(retrained[run["layout"]])
    summary = summarise_strategies(runs, strategies)
    lines = verdict(summary)
    study = {"format": "parnas.strategy-study", "version": 1, "config": config, "overrides": list(overrides),
             "strategies": list(strategies), "seeds": seeds, "search_steps": search_steps, "trials": trials,
             "retrain_steps": retrain_steps, "retrain_seeds": retrain_seeds, "runs": runs, "summary": summary,
             "verdicts": lines}
    write_json_atomic(out / "strategies.json", study)
    write_text_atomic(out / "strategies.md", strategies_markdown(study))
    return study


def summarise_strategies(runs: Sequence[Mapping[str, Any]], strategies: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    for strategy in strategies:
        mine = [r for r in runs if r["strategy"] == strategy]
        ppls = [r["val_ppl"] for r in mine]
        out.append({"strategy": strategy, "layouts": [r["layout"] for r in mine], "val_ppl": mean_of(ppls),
                    "val_ppl_std": seed_spread(ppls), "cost_ratio": mean_of([r["cost_ratio"] for r in mine]),
                    "search_seconds": mean_of([r["search_seconds"] for r in mine])})
    return out


def verdict(summary: Sequence[Mapping[str, Any]]) -> list[str]:
    """Which strategy's architectures retrain best; whether PAR's beats the best of the others beyond the spread."""
    ranked = sorted((s for s in summary if s["val_ppl"] is not None), key=lambda s: s["val_ppl"])
    if not ranked:
        return ["no strategy's architecture retrained to a finite perplexity"]
    lines = [f"best retrained val ppl: {ranked[0]['strategy']} ({ranked[0]['val_ppl']:.2f})"]
    par = next((s for s in ranked if s["strategy"] == PAR_GUMBEL_DARTS), None)
    others = [s for s in ranked if s["strategy"] != PAR_GUMBEL_DARTS]
    if par and others:
        best = others[0]
        spread = max((s for s in (par["val_ppl_std"], best["val_ppl_std"]) if s is not None), default=None)
        gap = par["val_ppl"] - best["val_ppl"]
        if spread is None:
            judged = "one seed each: no spread to judge by"
        elif abs(gap) <= spread:
            judged = f"not distinguishable (within the seed spread ±{spread:.2f})"
        else:
            judged = "better" if gap < 0 else "worse"
        lines.append(f"{PAR_GUMBEL_DARTS} {par['val_ppl']:.2f} at {par['cost_ratio'] or float('nan'):.2f}x vs the best "
                     f"of NNI's, {best['strategy']} {best['val_ppl']:.2f} at {best['cost_ratio'] or float('nan'):.2f}x:"
                     f" {judged}")
    return lines


def strategies_markdown(study: Mapping[str, Any]) -> str:
    def cell(v: Any, fmt: str) -> str:
        return "-" if v is None else fmt.format(v)

    out = [f"# parnas strategies: {study['config'] or 'defaults'}", "",
           f"{study['seeds']} seeds; budget {study['search_steps']} training steps per search (multi-trial: "
           f"{study['trials']} trials sharing them); retrain {study['retrain_steps']} steps x "
           f"{study['retrain_seeds']} seeds; no latency budget.", "", "## Verdicts", ""]
    out += [f"- {line}" for line in study["verdicts"]]
    out += ["", "| strategy | architectures | cost ratio | retrained val ppl | search s |", "|---|---|---:|---:|---:|"]
    for s in study["summary"]:
        ppl = cell(s["val_ppl"], "{:.2f}") + ("" if s["val_ppl_std"] is None else f" ± {s['val_ppl_std']:.2f}")
        out.append(f"| {s['strategy']} | {', '.join(s['layouts'])} | {cell(s['cost_ratio'], '{:.3f}')} | {ppl} "
                   f"| {cell(s['search_seconds'], '{:.0f}')} |")
    return "\n".join(out) + "\n"
