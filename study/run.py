"""``parnas study``: "the search finds a model faster than Transformer-XL at the same perplexity", checked.

For every budget and seed a search runs (``<out>/search/b<budget>-s<seed>``); with ``--candidates``,
for every candidate set too (``<out>/search/<LETTERS>-b<budget>-s<seed>``, e.g. ``ACDGI-bnone-s0``), so
search spaces are compared at equal steps against one Transformer-XL and one timing. Every layout the
study needs is then retrained from scratch at equal steps and settings, with the config's own
``train.seed`` (``<out>/retrain/<LAYOUT>``): each found architecture, the standard Transformer-XL
at the same ``n_blocks``, the *sandwich* ordering of the found kinds (all attention first, then
dense, then identity; Press et al. 2020) and R random orderings of the same kinds; with
``--every-network``, every distinct network of the searched space, with ``--census N`` a sample of N of them
stratified by predicted cost (:mod:`parnas.study.space`). A layout is
trained once however many roles it plays. All distinct layouts are then timed side by side in this
one process (:func:`parnas.training.latency.time_layouts`, alternating rounds), and :mod:`parnas.study.report`
writes ``study.md``, ``study.csv``, ``study.png`` and ``study.json``.

A rerun with the same ``--out`` skips finished searches (``architecture.json``) and retrains
(``metrics.json``), resumes interrupted ones from their checkpoint, and refuses other settings.

This module imports only light modules at the top: the CLI checks every argument through
:func:`make_plan` before torch, Lightning or NNI are loaded and before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parnas.study.front import parse_widths, width_model
from parnas.study.measure import over_seeds
from parnas.study.orderings import random_orderings, sandwich
from parnas.study.report import budget_label

from parnas import architecture, reading
from parnas.config import Config, SearchConfig, load_config, transformer_xl_layout
from parnas.errors import ConfigError, ParnasError
from parnas.files import hold_run_dir, write_json_atomic
from parnas.overrides import from_dict, merge, parse_overrides, unflatten
from parnas.training.devices import check_devices

ROLES = ("found", "transformer-xl", "front", "space", "sandwich", "random")
# Settings that change no figure of the study; any other difference from the first run is refused.
IGNORED_SETTINGS = {"train.out_dir", "search.out_dir", "train.log_every", "search.log_every", "train.ckpt_every",
                    "train.eval_every"}

Log = Callable[[str], None]


@dataclass(frozen=True)
class Plan:
    """What one ``parnas study`` does; ``base`` is the config with ``--set`` applied."""

    config: str | None
    overrides: tuple[str, ...]
    base: Config
    seeds: int
    budgets: tuple[float | None, ...]
    out: Path
    search_steps: int | None = None
    retrain_steps: int | None = None
    random_orderings: int = 3
    rounds: int = 5
    candidate_sets: tuple[tuple[str, ...], ...] = ()  # () -> the config's search.candidates, one set
    retrain_seeds: int = 1  # retrains of every layout, with train.seed, train.seed + 1, ...
    widths: tuple[int, ...] = ()  # d_model of the full-depth Transformer-XLs added to the front
    every_network: bool = False  # retrain every distinct network of the searched spaces (parnas.study.space)
    census: int = 0  # retrain a sample of this many networks of the searched space (parnas.study.space)

    @property
    def searches(self) -> list[PlannedSearch]:
        return [PlannedSearch(c, b, s) for c in (self.candidate_sets or (None,)) for b in self.budgets
                for s in range(self.seeds)]


@dataclass(frozen=True)
class PlannedSearch:
    """One search of the study: its candidate set (None: the config's), latency budget and seed."""

    candidates: tuple[str, ...] | None
    budget: float | None
    seed: int

    @property
    def label(self) -> str | None:
        """The candidate set's letter code (``ACDGI``), None for the config's own set."""
        return None if self.candidates is None else architecture.layout_string(self.candidates)

    @property
    def name(self) -> str:
        head = "" if self.label is None else f"candidates {self.label}, "
        return f"{head}budget {budget_label(self.budget)}, seed {self.seed}"


@dataclass(frozen=True)
class Entry:
    """One row of the study before it is measured: a layout in one role, for one search (None: no search)."""

    role: str
    kinds: tuple[str, ...]
    budget: float | None = None
    seed: int | None = None
    search: Mapping[str, Any] | None = None  # the found record's ``search`` section
    candidates: str | None = None  # the search's candidate set as letters; None: the config's set
    d_model: int | None = None  # a width-scaled front point's; None: the config's

    @property
    def layout(self) -> str:
        """The layout's letters, and ``-d<d_model>`` for a width-scaled one: its key and its retrain's directory."""
        return architecture.layout_string(self.kinds) + (f"-d{self.d_model}" if self.d_model else "")


def parse_budgets(text: str) -> tuple[float | None, ...]:
    """``"0.65,none"`` -> ``(0.65, None)``; each budget is a fraction in (0, 1] of Transformer-XL's step time."""
    budgets: list[float | None] = []
    for part in (p.strip() for p in text.split(",")):
        if part.lower() in ("none", "null"):
            budgets.append(None)
            continue
        try:
            value = float(part)
        except ValueError:
            raise ConfigError(f"--budgets: {part!r} is not a number or 'none'") from None
        if not 0.0 < value <= 1.0 or math.isnan(value):
            raise ConfigError(f"--budgets: {part} must be in (0, 1] (a fraction of Transformer-XL's step time) "
                              "or 'none'")
        budgets.append(value)
    if len(set(budgets)) != len(budgets):
        raise ConfigError(f"--budgets lists a budget twice: {text}")
    return tuple(budgets)


def parse_candidate_sets(texts: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """``["attention,dense,identity", "attention,conv,dense,glu,identity"]`` -> tuples of kind names (each
    kind is checked when the search's config is built)."""
    sets = []
    for text in texts:
        kinds = tuple(k.strip() for k in text.split(",") if k.strip())
        if len(kinds) < 2:
            raise ConfigError(f"--candidates {text!r}: give at least two kinds, separated by commas")
        sets.append(kinds)
    if len(set(sets)) != len(sets):
        raise ConfigError("--candidates lists a set twice")
    return tuple(sets)


def make_plan(config: str | None, overrides: Sequence[str], seeds: int, budgets: str, out: str | Path, *,
              search_steps: int | None = None, retrain_steps: int | None = None, random_orderings: int = 3,
              rounds: int = 5, candidates: Sequence[str] = (), retrain_seeds: int = 1,
              widths: str | None = None, every_network: bool = False, census: int | None = None) -> Plan:
    """Check every argument and every search's config; raises ConfigError/ParnasError, writes nothing."""
    for name, value, least in (("--seeds", seeds, 1), ("--search-steps", search_steps, 1),
                               ("--retrain-steps", retrain_steps, 1), ("--random-orderings", random_orderings, 0),
                               ("--rounds", rounds, 1), ("--retrain-seeds", retrain_seeds, 1), ("--census", census, 1)):
        if value is not None and value < least:
            raise ConfigError(f"{name} must be >= {least}, got {value}")
    candidate_sets = parse_candidate_sets(candidates)
    if candidate_sets and "candidates" in parse_overrides(overrides).get("search", {}):
        raise ConfigError("give the candidate sets with --candidates alone, not also --set search.candidates")
    budget_list = parse_budgets(budgets)
    base = load_config(config, [*overrides, *first_budget_setting(budget_list)])
    plan = Plan(config, tuple(overrides), base, seeds, budget_list, Path(out), search_steps, retrain_steps,
                random_orderings, rounds, candidate_sets, retrain_seeds, parse_widths(widths, base.model),
                every_network, census or 0)
    if plan.base.train.devices != 1:
        raise ConfigError("parnas study trains in this one process: set train.devices=1 (one GPU or the CPU)")
    check_devices(plan.base.train)
    if plan.base.model.blocks:
        raise ConfigError("model.blocks cannot be set for a study: the layouts come from the searches")
    if plan.widths and plan.base.search.latency_table is not None:
        raise ConfigError("--widths cannot be priced by search.latency_table (a table prices one width): time the "
                          "study on its device instead")
    for search in plan.searches:
        search_config(plan, search)
    from parnas.study.space import check_space

    check_space(plan)  # a space too large to retrain whole, a census it cannot give
    retrain_config(plan)
    check_same_settings(plan)
    return plan


def config_with_settings(cfg: Config, settings: Mapping[str, Any]) -> Config:
    """``cfg`` with dotted keys replaced, validated like any config (ConfigError naming the key)."""
    return from_dict(Config, merge(cfg.to_dict(), unflatten(settings)))


def search_config(plan: Plan, search: PlannedSearch) -> Config:
    settings: dict[str, Any] = {"train.seed": search.seed, "search.out_dir": str(search_dir(plan, search))}
    if plan.search_steps:
        settings["train.max_steps"] = plan.search_steps
    if search.budget is not None or "latency_budget" in {f.name for f in dataclasses.fields(SearchConfig)}:
        settings["search.latency_budget"] = search.budget  # "none" overrides a budget the config may set
    if search.candidates is not None:
        settings["search.candidates"] = list(search.candidates)
    return config_with_settings(plan.base, settings)


def first_budget_setting(budgets: Sequence[float | None]) -> list[str]:
    """``--set`` of the first latency budget --budgets gives, if any. The base and retrain configs are checked with it,
    as each search's config is with its own: a budget's hinge on the expected cost is only valid with a budget."""
    return [f"search.latency_budget={budget}" for budget in budgets if budget is not None][:1]


def retrain_overrides(plan: Plan, run_dir: Path, seed_offset: int = 0) -> list[str]:
    """``--set`` pairs of every retrain: the user's, the step count, the run directory, and for the k-th retrain
    seed (k > 0) ``train.seed`` + k (the first is the config's own seed). A retrain reads no search setting; the
    first budget keeps the search settings it carries valid. The user's ``model.n_blocks`` is the searches': each
    retrained layout's own depth comes with its architecture file (the front's and the space's are shallower)."""
    steps = [f"train.max_steps={plan.retrain_steps}"] if plan.retrain_steps else []
    extra = [*first_budget_setting(plan.budgets), *steps]
    if seed_offset:
        extra.append(f"train.seed={plan.base.train.seed + seed_offset}")
    user = [o for o in plan.overrides if o.partition("=")[0].strip() != "model.n_blocks"]
    return [*user, *extra, f"train.out_dir={json.dumps(str(run_dir))}"]  # a JSON string is YAML


def retrain_config(plan: Plan) -> Config:
    return load_config(plan.config, retrain_overrides(plan, plan.out / "retrain"))


def search_dir(plan: Plan, search: PlannedSearch) -> Path:
    head = "" if search.label is None else f"{search.label}-"
    return plan.out / "search" / f"{head}b{budget_label(search.budget)}-s{search.seed}"


def settings_record(plan: Plan) -> dict[str, Any]:
    return {"config": plan.config, "settings": _flatten(plan.base.to_dict()), "search_steps": plan.search_steps,
            "retrain_steps": plan.retrain_steps}  # retrain seeds may be added: earlier retrains are kept


def check_same_settings(plan: Plan) -> None:
    """A study directory holds runs of one set of settings (seeds, budgets and orderings may be added)."""
    path = plan.out / "settings.json"
    if not path.is_file():
        return
    try:
        old = reading.read_json(path)
    except (OSError, json.JSONDecodeError) as e:
        raise ParnasError(f"cannot read {path}: {e}") from None
    new = settings_record(plan)
    for key in ("search_steps", "retrain_steps"):
        if old.get(key) != new[key]:
            raise ParnasError(f"{plan.out} was studied with --{key.replace('_', '-')} {old.get(key)}, now "
                              f"{new[key]}; use another --out")
    # a setting newer than the first run counts as its default (what the code that ran it did)
    was, now = _flatten(Config().to_dict()) | old.get("settings", {}), new["settings"]
    for key in sorted((set(was) | set(now)) - IGNORED_SETTINGS):
        if was.get(key) != now.get(key):
            raise ParnasError(f"{plan.out} was studied with {key}={was.get(key)!r}, now {now.get(key)!r}; "
                              "use the same settings or another --out")


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, Mapping) else
                   {f"{prefix}{k}": list(v) if isinstance(v, tuple) else v})
    return out


def plan_entries(plan: Plan, found: Mapping[PlannedSearch, Mapping[str, Any]]) -> list[Entry]:
    """Every row of the study: Transformer-XL and its shallower front once, with ``--every-network`` every network
    of the space, then per search its found, sandwich and random layouts."""
    from parnas.study.front import front_layouts
    from parnas.study.space import space_layouts

    n_blocks = len(next(iter(found.values()))["architecture"])
    entries = [Entry("transformer-xl", transformer_xl_layout(n_blocks))]
    entries += [Entry("front", kinds) for kinds in front_layouts(n_blocks)]
    entries += [Entry("front", transformer_xl_layout(n_blocks), d_model=width) for width in plan.widths]
    costs = (next(iter(found.values())).get("search") or {}).get("block_costs")
    entries += [Entry("space", kinds) for kinds in space_layouts(plan, costs)]
    for search, record in found.items():
        kinds = tuple(architecture.layout(record))
        ordered = sandwich(kinds)
        at = {"budget": search.budget, "seed": search.seed, "candidates": search.label}
        entries += [Entry("found", kinds, search=record.get("search") or {}, **at), Entry("sandwich", ordered, **at)]
        entries += [Entry("random", k, **at) for k in
                    random_orderings(kinds, plan.random_orderings, exclude=[kinds, ordered],
                                     reversible=plan.base.model.reversible)]
    return entries


# --- running ------------------------------------------------------------------------------------------

class Progress:
    """``[search 2/6] ...`` lines with the time since the study started."""

    def __init__(self, log: Log) -> None:
        self.log, self.start = log, time.perf_counter()

    def __call__(self, stage: str, index: int, total: int, text: str) -> None:
        seconds = int(time.perf_counter() - self.start)
        self.log(f"[{stage} {index}/{total}] {text}  ({seconds // 60}m{seconds % 60:02d}s)")


def run_searches(plan: Plan, progress: Progress) -> dict[PlannedSearch, dict[str, Any]]:
    """Each search's record: read when finished, resumed from its checkpoint, else run."""
    from parnas.strategies.search import run_search

    found = {}
    for i, search in enumerate(plan.searches, 1):
        run_dir, name = search_dir(plan, search), search.name
        if (run_dir / "architecture.json").is_file():
            found[search] = architecture.read(run_dir / "architecture.json")
            progress("search", i, len(plan.searches), f"{name}: done already, "
                     f"{architecture.layout_string(architecture.layout(found[search]))}")
            continue
        resume = (run_dir / "checkpoints" / "last.ckpt").is_file()
        progress("search", i, len(plan.searches), f"{name}{' (resumed)' if resume else ''} in {run_dir} ...")
        found[search] = run_search(search_config(plan, search), resume=resume)
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
        run_dir = plan.out / "retrain" / (code if k == 0 else f"{code}-s{k}")
        names = ", ".join(sorted({e.role for e in roles}, key=ROLES.index)) + (f" (retrain seed {k})" if k else "")
        if (run_dir / "metrics.json").is_file():
            metrics.setdefault(code, []).append(json.loads((run_dir / "metrics.json").read_text()))
            progress("retrain", i, len(runs), f"{names} {code}: done already, val ppl {_ppl(metrics[code][-1])}")
            continue
        resume = (run_dir / "checkpoints" / "last.ckpt").is_file()
        if not resume and run_dir.exists():
            shutil.rmtree(run_dir)  # interrupted before its first checkpoint: start clean
        progress("retrain", i, len(runs), f"{names} {code}{' (resumed)' if resume else ''} ...")
        arch = layout_file(plan, roles[0], like)
        metrics.setdefault(code, []).append(retrain(str(arch), plan.config, retrain_overrides(plan, run_dir, k),
                                                    resume=resume))
        progress("retrain", i, len(runs), f"{names} {code}: val ppl {_ppl(metrics[code][-1])}")
    return {code: over_seeds(runs) for code, runs in metrics.items()}


def _ppl(metrics: Mapping[str, Any]) -> str:
    return "-" if metrics.get("val_ppl") is None else f"{metrics['val_ppl']:.2f}"


def run_study(plan: Plan, log: Log = print) -> dict[str, Any]:
    """Search, retrain, time and report; returns what ``<out>/study.json`` holds. The study holds its folder
    (:func:`parnas.files.hold_run_dir`), and each search and retrain the sub-folder it writes."""
    with hold_run_dir(plan.out):
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
    timing = measure(cfg, plan.rounds, layouts, vocab_size, progress)
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
