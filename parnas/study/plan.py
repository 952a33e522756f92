"""What one ``parnas study`` does, checked before anything runs: its searches, the layouts it retrains (the roles
of docs/reference.md), their configs and folders (:mod:`parnas.study.run` runs it).

Searches go to ``<out>/search/[<LETTERS>-]b<budget>-s<seed>`` (``LETTERS``: a ``--candidates`` set), retrains to
``<out>/retrain/<LAYOUT>``, each layout once however many roles it plays, at equal steps and settings. A study's
folder holds runs of one set of settings: a rerun with other settings is refused (:func:`check_same_settings`).

Only light modules are imported at the top: the CLI checks every argument through :func:`make_plan` before torch,
Lightning or NNI load and before anything is written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parnas import architecture, reading, strategy_registry
from parnas.config import Config, load_config, transformer_xl_layout
from parnas.errors import ConfigError, ParnasError
from parnas.overrides import as_given, from_dict, merge, parse_overrides, unflatten
from parnas.strategies.par_settings import BUDGET, par_settings
from parnas.study.front import parse_widths
from parnas.study.orderings import random_orderings, sandwich
from parnas.study.report import budget_label
from parnas.training.devices import check_devices

ROLES = ("found", "transformer-xl", "front", "space", "sandwich", "random")
# Settings that change no figure of the study; any other difference from the first run is refused.
IGNORED_SETTINGS = {"train.out_dir", "search.out_dir", "train.log_every", "search.log_every", "train.ckpt_every",
                    "train.eval_every"}


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
              candidates: Sequence[str] = (), retrain_seeds: int = 1, widths: str | None = None,
              space: str | None = None) -> Plan:
    """Check every argument and every search's config; raises ConfigError/ParnasError, writes nothing. ``space``:
    ``--space`` as given (``all``: ``every_network``; a count: ``census``)."""
    every_network, census = parse_space(space)
    for name, value, least in (("--seeds", seeds, 1), ("--steps", search_steps, 1), ("--steps", retrain_steps, 1),
                               ("--random-orderings", random_orderings, 0), ("--seeds", retrain_seeds, 1),
                               ("--space", census, 1)):
        if value is not None and value < least:
            raise ConfigError(f"{name} must be >= {least}, got {value}")
    candidate_sets = parse_candidate_sets(candidates)
    if candidate_sets and "candidates" in parse_overrides(overrides).get("search", {}):
        raise ConfigError("give the candidate sets with --candidates alone, not also --set search.candidates")
    budget_list = parse_budgets(budgets)
    base = load_config(config, [*overrides, *first_budget_setting(budget_list)])
    plan = Plan(config, tuple(overrides), base, seeds, budget_list, Path(out), search_steps, retrain_steps,
                random_orderings, candidate_sets, retrain_seeds, parse_widths(widths, base.model), every_network,
                census or 0)
    if plan.base.train.devices != 1:
        raise ConfigError("parnas study trains in this one process: set train.devices=1 (one GPU or the CPU)")
    check_devices(plan.base.train)
    if plan.base.model.blocks:
        raise ConfigError("model.blocks cannot be set for a study: the layouts come from the searches")
    if plan.widths and plan.base.search.latency_table is not None:
        raise ConfigError("--widths cannot be priced by search.latency_table (a table prices one width): time the "
                          "study on its device instead")
    for search in plan.searches:  # what a search would refuse, refused here: before the study writes anything
        cfg = search_config(plan, search)
        strategy_registry.get(cfg.search.strategy).check_config(cfg, False)
    from parnas.study.space import check_space

    check_space(plan)  # a space too large to retrain whole, a census it cannot give
    retrain_config(plan)
    check_same_settings(plan)
    return plan


def search_config(plan: Plan, search: PlannedSearch) -> Config:
    settings: dict[str, Any] = {"train.seed": search.seed, "search.out_dir": str(search_dir(plan, search))}
    if plan.search_steps:
        settings["train.max_steps"] = plan.search_steps
    own, select = f"search.{plan.base.search.strategy}", par_settings(plan.base.search).select
    if select.steps is None:  # the final pick judges its finalists as the study's retrains train
        settings[f"{own}.select.steps"] = list(select.rounds(plan.retrain_steps or plan.base.train.max_steps))
    settings[f"{own}.latency_budget"] = search.budget  # "none" overrides a budget the config may set
    if search.candidates is not None:
        settings["search.candidates"] = list(search.candidates)
    return from_dict(Config, merge(plan.base.to_dict(), unflatten(settings)))  # validated: ConfigError names the key


def parse_space(text: str | None) -> tuple[bool, int | None]:
    """``--space``: ``all`` (every network of the space) or N (a census of N networks), as (every_network, census);
    None: neither."""
    if text is None:
        return False, None
    if text.strip().lower() == "all":
        return True, None
    try:
        return False, int(text)
    except ValueError:
        raise ConfigError(f"--space must be all or a number of networks, not {text!r}") from None


def first_budget_setting(budgets: Sequence[float | None]) -> list[str]:
    """``--set`` of the first latency budget --budgets gives, if any. The base and retrain configs are checked with it,
    as each search's config is with its own: a budget's hinge on the expected cost is only valid with a budget."""
    return [f"{BUDGET}={budget}" for budget in budgets if budget is not None][:1]


def retrain_overrides(plan: Plan, run_dir: Path, seed_offset: int = 0) -> list[str]:
    """``--set`` pairs of every retrain: the user's but ``model.n_blocks`` (a layout's depth comes with its
    architecture file), the first budget (keeping the search settings valid), the steps, the run directory, and for
    the k-th retrain seed (k > 0) ``train.seed`` + k."""
    steps = [f"train.max_steps={plan.retrain_steps}"] if plan.retrain_steps else []
    extra = [*first_budget_setting(plan.budgets), *steps]
    if seed_offset:
        extra.append(f"train.seed={plan.base.train.seed + seed_offset}")
    user = [o for o in plan.overrides if o.partition("=")[0].strip() != "model.n_blocks"]
    return [*user, *extra, as_given("train.out_dir", str(run_dir))]


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
            raise ParnasError(f"{plan.out} was studied with {key.replace('_', ' ')} {old.get(key)} (--steps), now "
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
    """Every row of the study: Transformer-XL and its shallower front once, with ``--space all`` every network
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
