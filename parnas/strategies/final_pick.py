"""The final pick of a supernet search: short retrains that check the supernet's choice against the one-line
alternative, taking blocks off Transformer-XL (settings: :class:`parnas.pick_config.SelectConfig`; how it judges and
why: docs/reference.md, "The final pick").

Entrants: the ``select.k`` layouts the supernet prefers within the selection budget, and the guard, the deepest
depth-scaled Transformer-XL within it (its blocks taken off as identity blocks, which a fixed model skips); layouts
that are one network enter once. Successive halving trains them from scratch as fixed models; the guard reaches the
last round whatever its rank, and a supernet layout that beats it there is exported only if it also does over
``select.confirm_seeds`` further seeds. An entrant whose training diverges is out.

Everything goes under ``<run>/select/``: ``plan.json`` (the entrants) and one training run per entrant with
``rounds.json`` (its perplexity at the end of each round), and ``<LAYOUT>-seed<N>`` for a confirming seed. A resumed
search goes on where the pick stopped: finished rounds are read back, an interrupted one continues from its
checkpoint.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytorch_lightning as pl

from parnas import architecture
from parnas.architecture import layout_string
from parnas.config import Config, transformer_xl_layout
from parnas.errors import ParnasError
from parnas.files import ensure_writable_dir, write_json_atomic
from parnas.nn.model import SKIPPED_KIND, blocks_run
from parnas.owned_folders import remove_own_runs
from parnas.pick_config import EARLY_VALID_FRACTION
from parnas.report.experiment_summary import pick_ppl
from parnas.strategies.costs import CostModel
from parnas.strategies.par_settings import par_settings
from parnas.strategies.search_folder import SELECT_DIR
from parnas.strategies.supernet_export import Evaluated, exported_nll

if TYPE_CHECKING:
    from parnas.data.tokenizer import Tokenizer


class FinishedSearch(Protocol):
    """What the pick reads of a finished search (a :class:`parnas.strategies.search.SupernetSearch`, which calls it)."""

    supernet: Any
    module: Any  # the strategy's module: its choices, evaluations and history
    data: Any  # the search's SegmentData: its splits and validation batches
    trainer: Any
    costs: CostModel


def layout_ratio(costs: CostModel, kinds: Sequence[str]) -> float:
    """A layout's cost relative to Transformer-XL's, priced as the budget is; an identity block costs what the
    cost model says, nothing when it prices none (it is then no candidate: a guard's skipped blocks)."""
    total = costs.constant + sum(costs.per_kind.get(k, 0.0) if k == SKIPPED_KIND else costs.per_kind[k]
                                 for k in kinds)
    return total / costs.reference


def check_selection(cfg: Config, costs: CostModel) -> None:
    """Before anything is written: a ``select.budget`` below the cheapest layout of the candidates could
    enter nothing."""
    select = par_settings(cfg.search).select
    if not select.enabled or select.budget is None:
        return
    cheapest = min(cfg.search.candidates, key=costs.per_kind.__getitem__)
    floor = costs.ratio([cheapest] * cfg.model.n_blocks)
    if floor > select.budget + 1e-9:
        raise ParnasError(f"search.{cfg.search.strategy}.select.budget {select.budget} is out of reach: the "
                          f"cheapest layout (all {cheapest}) costs {floor:.3f} of Transformer-XL's here; raise it, "
                          "or leave it unset (the search's budget)")


def selection_budget(cfg: Config, costs: CostModel, exported: Sequence[str]) -> tuple[float, str]:
    """The cost ratio entrants must be within, and where it comes from."""
    if par_settings(cfg.search).select.budget is not None:
        return par_settings(cfg.search).select.budget, f"search.{cfg.search.strategy}.select.budget"
    if par_settings(cfg.search).latency_budget is not None:
        return par_settings(cfg.search).latency_budget, f"search.{cfg.search.strategy}.latency_budget"
    return layout_ratio(costs, exported), "the cost of the layout the supernet exports"


def guard_layout(costs: CostModel, n_blocks: int, candidates: Sequence[str], budget: float) -> list[str] | None:
    """The deepest depth-scaled Transformer-XL (2, 4, ... blocks, the rest identity) within ``budget``, as a
    layout of the space (None if none is: too low a budget, or a space without those kinds)."""
    for depth in range(n_blocks - n_blocks % 2, 1, -2):
        kinds = [*transformer_xl_layout(depth), *[SKIPPED_KIND] * (n_blocks - depth)]
        if set(kinds) <= set(candidates) and layout_ratio(costs, kinds) <= budget + 1e-9:
            return kinds
    return None


def most_probable(probabilities: Sequence[Mapping[str, float]], costs: CostModel, budget: float,
                  count: int) -> list[list[str]]:
    """Up to ``count`` distinct networks, most probable first under the blocks' independent distributions, whose
    cost ratio is within ``budget``: a beam search over the blocks that drops a partial layout no completion of
    which fits."""
    floors = [min(costs.per_kind[k] for k in p) for p in probabilities]
    rest = [sum(floors[i:]) for i in range(len(floors) + 1)]
    limit = (budget + 1e-9) * costs.reference
    beam: list[tuple[float, list[str], float]] = [(0.0, [], costs.constant)]
    width = max(64, 16 * count)
    for i, p in enumerate(probabilities):
        grown = [(lp + math.log(max(q, 1e-30)), [*kinds, k], cost + costs.per_kind[k])
                 for lp, kinds, cost in beam for k, q in p.items() if cost + costs.per_kind[k] + rest[i + 1] <= limit]
        beam = sorted(grown, key=lambda t: -t[0])[:width]
    out: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    for _, kinds, _ in beam:
        if blocks_run(kinds) not in seen and len(out) < count:
            seen.add(blocks_run(kinds))
            out.append(kinds)
    return out


def inherited_ppl(search: FinishedSearch, kinds: Sequence[str]) -> float:
    """Validation perplexity of ``kinds`` with the supernet's weights (whole validation split)."""
    search.supernet.to(search.trainer.strategy.root_device)  # Lightning's teardown moved it to the CPU
    sums = exported_nll(search.supernet, search.module.choices(), list(kinds), search.data.batches("valid"))
    return math.exp(float(sums[0] / sums[1]))


def entrants(cfg: Config, costs: CostModel, result: Evaluated, budget: float) -> list[dict[str, Any]]:
    """The supernet's ``k`` most probable networks within ``budget`` (the layout it exports first, when that
    fits: scoring each by perplexity would cost a validation pass, and the retrains judge them anyway), and the
    guard."""
    select, probabilities = par_settings(cfg.search).select, list(result.probabilities.values())
    fits = layout_ratio(costs, result.kinds) <= budget + 1e-9
    pool = most_probable(probabilities, costs, budget, select.k)
    if fits:
        pool = [result.kinds, *[k for k in pool if blocks_run(k) != blocks_run(result.kinds)]][:select.k]
    out = [_entrant(kinds, f"supernet #{rank}", costs, probabilities) for rank, kinds in enumerate(pool, 1)]
    if out and out[0]["kinds"] == result.kinds:
        out[0]["inherited_val_ppl"] = _round(result.val_ppl)
    guard = guard_layout(costs, cfg.model.n_blocks, cfg.search.candidates, budget)
    if guard is not None:
        same = [e for e in out if blocks_run(e["kinds"]) == blocks_run(guard)]
        if same:
            same[0]["role"] += ", guard"
        else:
            out.append(_entrant(guard, "guard", costs, probabilities))
    return out


def _entrant(kinds: Sequence[str], role: str, costs: CostModel,
             probabilities: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    probability = math.prod(p.get(k, 0.0) for p, k in zip(probabilities, kinds))
    return {"architecture": layout_string(kinds), "kinds": list(kinds), "role": role,
            "cost_ratio": round(layout_ratio(costs, kinds), 4), "probability": float(f"{probability:.4g}"),
            "inherited_val_ppl": None, "val_ppl": []}


def _round(ppl: float) -> float | None:
    return round(ppl, 4) if math.isfinite(ppl) else None


def short_retrain(cfg: Config, kinds: Sequence[str], round_index: int, folder: Path, tokenizer: Tokenizer,
                  splits: Mapping[str, Any]) -> float | None:
    """Validation perplexity of ``kinds`` trained to round ``round_index``'s steps in ``folder`` (None: not
    finite): read back if that round finished, else trained, from its checkpoint if it has one."""
    from parnas.search_spaces import fixed_model
    from parnas.training.fit import fit

    steps = pick_rounds(cfg)
    target, rounds_file, last = steps[round_index], folder / "rounds.json", folder / "checkpoints" / "last.ckpt"
    rounds = json.loads(rounds_file.read_text()) if rounds_file.is_file() else {}
    if str(target) in rounds:
        return rounds[str(target)]
    metrics_file = folder / "metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else None
    if metrics is None or metrics.get("steps") != target:  # else: trained, stopped before its round was noted
        if not last.is_file() and folder.exists():
            remove_own_runs(folder)  # stopped before its first checkpoint: start clean
        # eager, whatever train.compile says: a compile costs more than these short runs save, and each resumed round
        # would compile again
        train = replace(cfg.train, max_steps=steps[-1], stop_at=0 if round_index == len(steps) - 1 else target,
                        warmup_steps=min(cfg.train.warmup_steps, steps[0] // 2), eval_every=steps[-1] + 1,
                        devices=1, num_nodes=1, out_dir=str(folder), compile="none")
        run = replace(cfg, model=replace(cfg.model, blocks=tuple(kinds)), train=train)
        record = architecture.make_record({architecture.label(i): k for i, k in enumerate(kinds)},
                                          replace(cfg.model, blocks=()), tokenizer.vocab_size,
                                          tokenizer=tokenizer.identity(), search={"layout": "the search's final pick"})
        pl.seed_everything(cfg.train.seed, verbose=False)
        model = fixed_model(replace(cfg.model, blocks=()), tokenizer.vocab_size, record["architecture"])
        try:
            fraction = 1.0 if round_index == len(steps) - 1 else EARLY_VALID_FRACTION
            metrics = fit(run, model, tokenizer, dict(splits), record, resume=last.is_file(), test=False,
                          valid_fraction=fraction)
        except ParnasError as error:  # a diverged entrant loses; anything else is the user's to fix
            if "diverged" not in str(error) and "not finite" not in str(error):
                raise
            print(f"final pick: {layout_string(kinds)} diverged ({error}); it is out", flush=True)
            metrics = {"val_ppl": None}
    write_json_atomic(rounds_file, {**rounds, str(target): metrics.get("val_ppl")})
    return metrics.get("val_ppl")


def pick_rounds(cfg: Config) -> tuple[int, ...]:
    """The steps each round of the pick ends at (``select.steps``, by default half of ``train.max_steps``
    and then all of it)."""
    return par_settings(cfg.search).select.rounds(cfg.train.max_steps)


def final_pick(search: FinishedSearch, cfg: Config, tokenizer: Tokenizer, result: Evaluated,
               run_dir: Path) -> tuple[Evaluated, dict[str, Any] | None]:
    """The layout to export, and the record of the pick (None when ``select.steps`` is empty, or a
    multi-process search: the short retrains run in one process). Prints what it does, and one line saying
    the guard won when it did."""
    select = par_settings(cfg.search).select
    if not select.enabled:
        return result, None
    if cfg.train.devices * cfg.train.num_nodes > 1:
        print("final pick skipped: its short retrains run in one process, not under the search's "
              f"{cfg.train.devices * cfg.train.num_nodes}; retrain the layouts to compare with parnas retrain",
              flush=True)
        return result, None
    start = time.perf_counter()
    budget, source = selection_budget(cfg, search.costs, result.kinds)
    entered = entrants(cfg, search.costs, result, budget)
    folder = run_dir / SELECT_DIR
    plan = {"entrants": [e["architecture"] for e in entered], "steps": list(pick_rounds(cfg)), "seed": cfg.train.seed,
            "supernet_steps": search.trainer.global_step, "early_valid_fraction": EARLY_VALID_FRACTION,
            "confirm_seeds": select.confirm_seeds}  # what the pick's folder was made for
    plan_file = folder / "plan.json"
    if plan_file.is_file() and json.loads(plan_file.read_text()) != plan:
        remove_own_runs(folder)  # another supernet's pick: nothing of it applies
    ensure_writable_dir(folder)
    write_json_atomic(plan_file, plan)
    alive, steps = list(entered), pick_rounds(cfg)
    for r, target in enumerate(steps):
        if len(alive) == 1:
            break
        for i, entrant in enumerate(alive, 1):
            print(f"final pick, round {r + 1}/{len(steps)}: {entrant['architecture']} ({entrant['role']}) to "
                  f"{target} steps [{i}/{len(alive)}]", flush=True)
            entrant["val_ppl"].append(short_retrain(cfg, entrant["kinds"], r, folder / entrant["architecture"],
                                                    tokenizer, search.data.splits))
        guard = next((e for e in alive if "guard" in e["role"] and math.isfinite(_finite(e["val_ppl"][-1]))), None)
        alive = sorted(alive, key=lambda e: _finite(e["val_ppl"][-1]))[:select.kept(len(alive), r, len(steps))]
        if r < len(steps) - 1 and guard is not None and guard not in alive:
            alive.append(guard)  # the known alternative is judged at the longest retrain only (docstring)
    winner = alive[0]
    guard = _guard(entered)
    if (winner is not guard and guard is not None and select.confirm_seeds
            and len(guard["val_ppl"]) == len(steps) and math.isfinite(_finite(guard["val_ppl"][-1]))):
        winner = _confirmed(cfg, winner, guard, folder, tokenizer, search.data.splits)
    record = _record(cfg, entered, winner, budget, source, time.perf_counter() - start)
    print(record["verdict_line"], flush=True)
    if winner["kinds"] == result.kinds:
        return result, record
    # what the record's val_ppl is: with the supernet's weights (the pick's ranking scored it already)
    ppl = winner["inherited_val_ppl"] or inherited_ppl(search, winner["kinds"])
    winner["inherited_val_ppl"] = record["entrants"][entered.index(winner)]["inherited_val_ppl"] = _round(ppl)
    chosen = search.module.evaluated(winner["kinds"], False, ppl, result.supernet_val_ppl)
    search.module.append_history(chosen.history_line())  # the history ends with what is exported
    return chosen, record


def _guard(entered: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The entrant that is the guard (alone, or a supernet's layout too), None where none entered."""
    return next((e for e in entered if "guard" in e["role"]), None)


def _finite(ppl: float | None) -> float:
    return math.inf if ppl is None or not math.isfinite(ppl) else ppl


def _confirmed(cfg: Config, winner: dict[str, Any], guard: dict[str, Any], folder: Path, tokenizer: Tokenizer,
               splits: Mapping[str, Any]) -> dict[str, Any]:
    """``winner`` (a supernet's layout that beat the guard in the last round) or the guard (on a tie), whichever has
    the lower mean over the last round and ``select.confirm_seeds`` further seeds (kept under ``confirm_val_ppl``)."""
    last = len(pick_rounds(cfg)) - 1
    for j in range(1, par_settings(cfg.search).select.confirm_seeds + 1):
        seeded = replace(cfg, train=replace(cfg.train, seed=cfg.train.seed + j))
        for entrant in (winner, guard):
            print(f"final pick, confirming: {entrant['architecture']} ({entrant['role']}) on seed {seeded.train.seed}",
                  flush=True)
            entrant.setdefault("confirm_val_ppl", []).append(short_retrain(
                seeded, entrant["kinds"], last, folder / f"{entrant['architecture']}-seed{seeded.train.seed}",
                tokenizer, splits))
    return guard if _seeds_mean(guard) <= _seeds_mean(winner) else winner


def _seeds_mean(entrant: Mapping[str, Any]) -> float:
    """The entrant's perplexity as the summary and the export show it (:func:`pick_ppl`), inf where not finite."""
    return _finite(pick_ppl(entrant))


def _record(cfg: Config, entered: Sequence[dict[str, Any]], winner: dict[str, Any], budget: float, source: str,
            seconds: float) -> dict[str, Any]:
    """What architecture.json keeps of the pick: every entrant with its perplexity after each round it ran, the
    guard's, the verdict and the one line that says it."""
    steps, fraction = pick_rounds(cfg), EARLY_VALID_FRACTION
    early = f" ({fraction:g} of the validation split)" if fraction < 1 else ""
    guard = _guard(entered)
    rivals = [e for e in entered if e is not guard and e["val_ppl"]]
    won = guard is not None and winner is guard
    last = len(winner["val_ppl"])
    at = f"{steps[last - 1]} steps of retraining" if last else "no retraining (the only entrant)"
    confirm = ""  # the confirming seeds' verdict (_confirmed), where they ran
    if guard is not None and guard.get("confirm_val_ppl"):
        rival = next(e for e in entered if e is not guard and e.get("confirm_val_ppl"))
        confirm = (f"mean over seeds {cfg.train.seed}-{cfg.train.seed + len(guard['confirm_val_ppl'])}: "
                   f"{rival['architecture']} {_seeds_mean(rival):.2f} against {_seeds_mean(guard):.2f}")
    if guard is None:
        verdict = "no guard"
        line = (f"final pick: {winner['architecture']} after {at}; no shallower Transformer-XL is within the budget "
                f"{budget:.2f}")
    elif won and "supernet" not in guard["role"]:
        verdict = "guard"
        rounds: dict[int, list[str]] = {}  # each rival by the round it went out in, its perplexity then
        for e in rivals:
            rounds.setdefault(len(e["val_ppl"]), []).append(f"{e['architecture']} {_ppl(e['val_ppl'])}")
        finals = ", ".join(rounds.pop(last, []))
        parts = [f"{finals} against {_ppl(guard['val_ppl'])}" if finals else _ppl(guard["val_ppl"]),
                 *([confirm] if confirm else []),
                 *(f"out after {steps[n - 1]} steps{early}: {', '.join(names)}" for n, names in sorted(rounds.items(),
                                                                                                        reverse=True))]
        line = (f"{guard_name(guard['kinds'])} beat "
                f"the search's picks after {at} (val ppl {'; '.join(parts)}): exported it")
    elif won:
        verdict = "search"
        line = (f"final pick: {winner['architecture']} (val ppl {_ppl(winner['val_ppl'])} after {at}), "
                f"{guard_name(guard['kinds'], named=False)}, which the supernet picked too")
    else:
        verdict = "search"
        out = f" after {steps[len(guard['val_ppl']) - 1]} steps" if guard["val_ppl"] else ""
        line = (f"final pick: {winner['architecture']} (val ppl {_ppl(winner['val_ppl'])} after {at}); "
                f"{guard_name(guard['kinds'])}: {_ppl(guard['val_ppl'])}{out}" + (f"; {confirm}" if confirm else ""))
    return {"k": par_settings(cfg.search).select.k, "steps": list(steps), "budget": round(budget, 4),
            "budget_from": source,
            "val_ppl_is": "trained from scratch (train.seed) to each round's steps; the last round on the whole "
                          f"validation split, earlier ones on {fraction:g} of it",
            "confirm_seeds": par_settings(cfg.search).select.confirm_seeds,
            "entrants": [{**{k: v for k, v in e.items() if k != "kinds"}, "val_ppl": _rounded(e["val_ppl"]),
                          **({"confirm_val_ppl": _rounded(e["confirm_val_ppl"])} if "confirm_val_ppl" in e else {})}
                         for e in entered],
            "winner": winner["architecture"],
            "guard": None if guard is None else {"architecture": guard["architecture"],
                                                 "name": guard_name(guard["kinds"]),
                                                 "val_ppl": _rounded(guard["val_ppl"]),
                                                 "cost_ratio": guard["cost_ratio"]},
            "verdict": verdict, "verdict_line": line, "seconds": round(seconds, 1)}


def guard_name(kinds: Sequence[str], named: bool = True) -> str:
    """What the guard is called: "Transformer-XL" when it keeps every block (the budget admits the full network),
    else "the shallower Transformer-XL ADAD" (``named``: with its layout; without, "the shallower Transformer-XL")."""
    if SKIPPED_KIND not in kinds:
        return "Transformer-XL"
    return f"the shallower Transformer-XL {layout_string(kinds)}" if named else "the shallower Transformer-XL"


def _rounded(values: Sequence[float | None]) -> list[float | None]:
    return [None if v is None else round(v, 4) for v in values]


def _ppl(values: Sequence[float | None]) -> str:
    return "n/a" if not values else "not finite" if values[-1] is None else f"{values[-1]:.2f}"
