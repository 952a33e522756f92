"""``parnas table score RUN --table TABLE``: a finished search judged against a ranking table
(:mod:`parnas.study.table`) without retraining anything; benchmarks/spaces/README.md says what it prints.

Each table layout is evaluated with the weights the run's supernet left
(:func:`parnas.strategies.search.inherited_perplexities`) on the first :data:`VALID_FRACTION` of the validation
split, the same tokens for every run, so a table is scored in minutes; the figures are cached
(:mod:`parnas.study.inherited_cache`). A pick's **regret** is its table perplexity minus the best of the layouts
within the budget (what a search at that budget is for) and of those no costlier (a cheap pick scores 0 there
however much better the budget allowed). The picks: *ranked* (the supernet as a ranker, FairNAS/SPOS style),
*exported* (by the search's own rule, :func:`fit_budget`) and a final pick's export, within the run's own budget.

Refused in one line before anything is evaluated: a run without a supernet checkpoint, a table of another space,
model, vocabulary or memory (:func:`parnas.study.table.check_matches`). Nothing is written but the cache.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from parnas.config import TARGET_LABELS, Config
from parnas.errors import ConfigError
from parnas.study.front import combined_spread
from parnas.study.table import RankingTable, check_matches, load_table

BUDGETS = (0.5, 0.65, 0.8)
# the share of the validation split each layout is evaluated on: its first segments, the same for every run, so
# that a table of 128 layouts is scored in minutes (docs/results.md: its Kendall tau against the whole split's)
VALID_FRACTION = 1 / 8
TOP = 5
SUPERNET_SPACE = "PARTransformerXLSpace"  # what a search's checkpoint records as its architecture


def correlations(inherited: Mapping[str, float], retrained: Mapping[str, float]) -> tuple[float | None, float | None]:
    """Kendall's tau-b and Spearman's rho over the layouts both have (None: fewer than 3, or a constant side)."""
    from scipy.stats import kendalltau, spearmanr

    common = [k for k in retrained if k in inherited]
    if len(common) < 3:
        return None, None
    a, b = [inherited[k] for k in common], [retrained[k] for k in common]
    tau, rho = kendalltau(a, b).statistic, spearmanr(a, b).statistic
    return (None if tau != tau else float(tau)), (None if rho != rho else float(rho))


def top_overlap(inherited: Mapping[str, float], retrained: Mapping[str, float], top: int = TOP) -> int:
    """How many of the ``top`` best layouts by retrained val ppl are among the ``top`` best by inherited val ppl."""
    common = [k for k in retrained if k in inherited]
    best = set(sorted(common, key=retrained.__getitem__)[:top])
    return len(best & set(sorted(common, key=inherited.__getitem__)[:top]))


def _gap(layout: str, best: str, retrained: Mapping[str, float], costs: Mapping[str, float],
         spreads: Mapping[str, float | None]) -> dict[str, Any]:
    gap = retrained[layout] - retrained[best]
    spread = combined_spread(spreads.get(layout), *([] if best == layout else [spreads.get(best)]))
    return {"best": best, "best_val_ppl": retrained[best], "best_cost_ratio": costs[best], "regret": gap,
            "regret_percent": gap / retrained[best] * 100,
            "regret_spreads": gap / spread if spread else (0.0 if gap == 0 else None)}


def regret(layout: str | None, retrained: Mapping[str, float], costs: Mapping[str, float],
           spreads: Mapping[str, float | None], budget: float | None = None) -> dict[str, Any] | None:
    """The table perplexity of ``layout`` minus the best of the layouts no costlier (the top-level figures) and, under
    ``within_budget``, of the layouts within ``budget`` (None without one; negative for a layout over it that beats
    them); in perplexity, in % and in the two layouts' combined seed spreads. None for a layout the table lacks."""
    if layout is None or layout not in retrained:
        return None
    best = min((k for k in retrained if costs[k] <= costs[layout] + 1e-9), key=retrained.__getitem__)
    within = [k for k in retrained if budget is not None and costs[k] <= budget + 1e-9]
    return {"layout": layout, "val_ppl": retrained[layout], "cost_ratio": costs[layout],
            **_gap(layout, best, retrained, costs, spreads),
            "within_budget": {"budget": budget, **_gap(layout, min(within, key=retrained.__getitem__), retrained,
                                                       costs, spreads)} if within else None}


def table_layout(layout: str, layouts: Sequence[str]) -> str:
    """The table's key for the network ``layout`` runs: itself when the table has it, else a key with the same
    blocks other than identity in the same order (a fixed model skips identity blocks, so where they sit does not
    change the network; the table keeps each network once, its identity blocks last); ``layout`` when none."""
    if layout in layouts:
        return layout
    blocks = layout.replace("I", "")
    return next((k for k in layouts if k.replace("I", "") == blocks), layout)


def ranked_pick(inherited: Mapping[str, float], costs: Mapping[str, float], budget: float) -> str | None:
    """The layout within ``budget`` whose inherited perplexity is lowest (None: none is within it)."""
    within = [k for k in inherited if costs[k] <= budget + 1e-9]
    return min(within, key=inherited.__getitem__) if within else None


def exported_pick(probabilities: Sequence[Mapping[str, float]], table: RankingTable, target: str,
                  budget: float) -> list[str] | None:
    """What a search with these softmax(alpha) exports at ``budget`` under the table's costs: the argmax, or the
    most probable layout within the budget (None: no layout is)."""
    from parnas.config import TARGET_UNITS
    from parnas.strategies.costs import CostModel
    from parnas.strategies.supernet_export import fit_budget

    costs = CostModel(table.latency.costs(target), table.latency.constant_ms[target], TARGET_UNITS[target],
                      table.n_blocks)
    argmax = [max(p, key=p.__getitem__) for p in probabilities]
    return argmax if costs.ratio(argmax) <= budget + 1e-9 else fit_budget(probabilities, costs, budget)


def check_run(run_dir: str | Path, table: RankingTable, overrides: Sequence[str] = ()) -> tuple[Config, dict]:
    """The run's config (``overrides`` applied: e.g. where its corpus is on this machine) and its
    ``architecture.json`` record if it wrote one ({} if not); ConfigError for a run this table cannot score."""
    from parnas import architecture
    from parnas.overrides import from_dict, merge, parse_overrides
    from parnas.training import checkpoint

    run = Path(run_dir)
    ckpt = run / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        raise ConfigError(f"{run} holds no supernet checkpoint (checkpoints/last.ckpt): give the run "
                          "directory of a search")
    meta = checkpoint.load(ckpt)["parnas"]
    space = meta["architecture"]
    if space.get("space") != SUPERNET_SPACE or not isinstance(space.get("candidates"), list):
        raise ConfigError(f"{ckpt} is a fixed model's checkpoint, not a search's supernet")
    cfg = from_dict(Config, merge(meta["config"], parse_overrides(list(overrides))))
    check_matches(table, cfg, space["candidates"], meta["tokenizer"], str(run))
    if cfg.search.latency_target not in table.targets():
        raise ConfigError(f"--table {table.name}: its latency table has no {cfg.search.latency_target} costs, the "
                          f"run's search.latency_target (it prices {', '.join(table.targets())})")
    record = architecture.read(run / "architecture.json") if (run / "architecture.json").is_file() else {}
    return cfg, record


def score(run_dir: str | Path, table_path: str | Path, overrides: Sequence[str] = (),
          log: Callable[[str], None] = print, before: Callable[[Any], None] | None = None,
          progress_every_s: float = 30.0) -> dict[str, Any]:
    """Score a finished search against a table; returns the figures and ``lines``, what is printed. ``before`` gets
    the run's config once it is checked, before any model runs; a progress line comes every ``progress_every_s``."""
    from parnas.architecture import layout_string

    table = load_table(table_path)
    cfg, record = check_run(run_dir, table, overrides)
    if before is not None:
        before(cfg)
    target, layouts = cfg.search.latency_target, table.layouts
    inherited = inherited_of(Path(run_dir), cfg, table, log, progress_every_s)
    retrained, spreads = {k: table.val_ppl(k) for k in layouts}, {k: table.spread(k) for k in layouts}
    costs = {k: table.cost_ratio(k, target) for k in layouts}  # for the run's latency target
    tau, rho = correlations(inherited, retrained)
    probabilities = [record["probabilities"][b] for b in sorted(record.get("probabilities") or {},
                                                                key=lambda b: int(b.split("_")[1]))]
    budgets: dict[str, Any] = {}
    for budget in BUDGETS:
        exported = exported_pick(probabilities, table, target, budget) if probabilities else None
        budgets[f"{budget:g}"] = {
            "ranked": regret(ranked_pick(inherited, costs, budget), retrained, costs, spreads, budget),
            "exported": None if not probabilities else
            regret(table_layout(layout_string(exported), table.layouts), retrained, costs, spreads, budget)
            if exported else None,
            "exported_layout": layout_string(exported) if exported else None}
    picked = (record.get("search") or {}).get("selection")
    final = layout_string(list(record["architecture"].values())) if picked else None
    run_budget = getattr(cfg.search.settings, "latency_budget", None)  # the strategy's budget, where it has one
    result = {"run": str(run_dir), "table": table.name, "layouts": len(table.layouts), "target": target,
              "noise_ceiling": table.noise_ceiling, "seeds": max(map(len, table.seeds.values())), "kendall_tau": tau,
              "spearman_rho": rho, "top_overlap": top_overlap(inherited, retrained), "top": TOP,
              "budgets": budgets, "exports": bool(probabilities), "inherited": inherited, "final_layout": final,
              "valid_fraction": VALID_FRACTION, "run_budget": run_budget,
              "final": regret(table_layout(final, table.layouts), retrained, costs, spreads,
                              run_budget if run_budget is not None else max(costs.values())) if final else None}
    result["lines"] = score_lines(result)
    for line in result["lines"]:
        log(line)
    return result


def inherited_of(run_dir: Path, cfg: Config, table: RankingTable, log: Callable[[str], None],
                 progress_every_s: float) -> dict[str, float]:
    """Every table layout's inherited-weight val ppl on the first :data:`VALID_FRACTION` of the validation
    split: read from the run's cache (:mod:`parnas.study.inherited_cache`) where it has them, the rest
    evaluated and added to it."""
    from parnas.study import inherited_cache as cache

    key = cache.evaluation_key(run_dir / "checkpoints" / "last.ckpt", cfg, VALID_FRACTION)
    known, problem = cache.read_cache(run_dir, key)
    if problem:
        log(f"warning: {problem}")
    missing = [k for k in table.layouts if k not in known]
    log(f"scoring {run_dir} against {table.name}: inherited-weight val ppl of {len(table.layouts)} layouts on the "
        f"first 1/{round(1 / VALID_FRACTION)} of the validation split: {len(table.layouts) - len(missing)} from "
        f"{cache.inherited_path(run_dir, key).name}, {len(missing)} to evaluate ...")
    if missing:
        from parnas.strategies.search import inherited_perplexities

        start = shown = time.monotonic()

        def progress(done: int) -> None:
            nonlocal shown
            now = time.monotonic()
            if now - shown >= progress_every_s and done < len(missing):
                shown = now
                log(f"  {done}/{len(missing)} layouts evaluated ({now - start:.0f} s)")

        read = inherited_perplexities(run_dir, cfg, [table.kinds(k) for k in missing], progress, VALID_FRACTION)
        known = {**known, **{k: read[k] for k in missing}}
        failed = cache.write_cache(run_dir, key, known)
        if failed:
            log(f"warning: {failed}")
    return {k: known[k] for k in table.layouts}


def _f(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def _against(g: Mapping[str, Any]) -> str:
    return (f"{g['regret']:+.2f} ({g['regret_percent']:+.1f}%, {_f(g['regret_spreads'], '{:.1f}')} seed spreads) "
            f"against {g['best']} ({g['best_cost_ratio']:.2f}x, val ppl {g['best_val_ppl']:.2f})")


def regret_text(r: Mapping[str, Any]) -> str:
    """``LAYOUT (cost, ppl): regret within the budget ...; at its own cost ...``: the goal's figure first."""
    w = r.get("within_budget")
    within = f"regret within budget {w['budget']:g} {_against(w)}; " if w else ""
    return (f"{r['layout']} ({r['cost_ratio']:.2f}x, val ppl {r['val_ppl']:.2f}): {within}"
            f"regret at its own cost {_against(r)}")


def ceiling_text(result: Mapping[str, Any]) -> str:
    ceiling, tau = result["noise_ceiling"], result["kendall_tau"]
    if ceiling is None:
        return "no noise ceiling: the table has too few layouts with two or more retrain seeds"
    share = f", {tau / ceiling:.2f} of it" if tau is not None and ceiling > 0 else ""
    return (f"noise ceiling {ceiling:.2f}, the Kendall tau between the means of the table's even- and odd-numbered "
            f"retrain seeds (up to {result['seeds']} a layout){share}")


def score_lines(result: Mapping[str, Any]) -> list[str]:
    """What ``parnas table score`` prints: the correlations beside the noise ceiling, the top overlap, the regrets
    within each budget and at each pick's own cost."""
    n, top, t = result["layouts"], min(result["top"], result["layouts"]), result["table"]
    lines = [f"{t}: Kendall tau {_f(result['kendall_tau'])}, Spearman rho {_f(result['spearman_rho'])} between "
             f"inherited-weight val ppl (first 1/{round(1 / result['valid_fraction'])} of the validation split) and "
             f"retrained val ppl over {n} layouts; {ceiling_text(result)}",
             f"{t}: top {top}: {result['top_overlap']} of the table's {top} best layouts are among the "
             f"supernet's {top} best"]
    what = TARGET_LABELS[result["target"]]
    if not result["exports"]:
        lines.append(f"{t}: the run wrote no architecture.json: no softmax(alpha) to export, only the "
                     "supernet's ranking is scored")
    for budget, picks in result["budgets"].items():
        for how in ("ranked", "exported") if result["exports"] else ("ranked",):
            r, head = picks[how], f"{t}: budget {budget} ({what}), {how}"
            if r is None:
                name = picks["exported_layout"] if how == "exported" else None
                lines.append(f"{head}: no regret ({name + ' is not in the table' if name else 'no layout within it'})")
            else:
                lines.append(f"{head} {regret_text(r)}")
    r, final = result.get("final"), result.get("final_layout")
    if final:
        lines.append(f"{t}: exported after the final pick {final}: not in the table" if r is None else
                     f"{t}: exported after the final pick (the run's budget "
                     f"{_f(result.get('run_budget'), '{:g}')}) {regret_text(r)}")
    return lines
