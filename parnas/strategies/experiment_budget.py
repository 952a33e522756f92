"""``parnas launch``'s check of the latency budgets an experiment's trials can draw, before nnictl starts anything.

A trial whose PAR ``latency_budget`` is below the cheapest layout of its space refuses to search, but only once it has
started, minutes into the experiment, and the tuner goes on drawing it. The launch prices the cheapest layout as the
trials will (their preset's latency table, this machine's cached one or timed now, or FLOPs) against the lowest
budget they can draw; a table this check obtained becomes the experiment's (:func:`share_with_trials`).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parnas import reading
from parnas.config import Config, load_config
from parnas.errors import ParnasError
from parnas.strategies.par_settings import BUDGET, latency_budget  # BUDGET: the trial parameter a budget is drawn as
from parnas.training.latency_cache import experiment_table
from parnas.training.latency_table import LatencyTable

RANGES = ("uniform", "quniform", "loguniform", "qloguniform")  # NNI's ranges with a lower end first


def trial_config(experiment: dict[str, Any]) -> Config | None:
    """The config the trials' ``parnas search --config PRESET [--set k=v ...]`` builds, before the tuner's
    parameters; None for another trial command, or a config the trials would refuse themselves."""
    try:
        words = shlex.split(str(experiment.get("trialCommand", "")))
    except ValueError:
        return None
    if "parnas" not in words or "search" not in words or "--config" not in words[:-1]:
        return None
    preset = words[words.index("--config") + 1]
    sets = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--set"]
    try:
        return load_config(preset, sets)
    except Exception:  # noqa: BLE001 - the trials say what is wrong with their own config
        return None


def drawn_budgets(experiment: dict[str, Any], cfg: Config) -> list[float]:
    """The lowest budget of each kind the trials can get: the search space's choices (or a range's lower end), and
    the trial command's own."""
    space = experiment.get("searchSpace") if isinstance(experiment.get("searchSpace"), dict) else {}
    spec = space.get(BUDGET) if isinstance(space.get(BUDGET), dict) else {}
    values = spec.get("_value") if isinstance(spec.get("_value"), list) else []
    if spec.get("_type") == "choice":
        budgets = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    elif spec.get("_type") in RANGES and values and isinstance(values[0], (int, float)):
        budgets = [values[0]]
    else:
        budgets = []
    if latency_budget(cfg.search) is not None and BUDGET not in space:
        budgets.append(latency_budget(cfg.search))
    return [float(b) for b in budgets]


@dataclass(frozen=True)
class Checked:
    """What the check says, and the table it priced with (None: FLOPs, or a table given to the trials)."""

    line: str
    table: LatencyTable | None = None


def share_with_trials(checked: Checked | None, experiment_folder: Path) -> None:
    """Make the table the check obtained the experiment's, unless a trial made it first
    (:func:`parnas.training.latency_cache.experiment_table`)."""
    if checked is not None and checked.table is not None:
        experiment_table(experiment_folder / "latency", checked.table.key, lambda: checked.table)


def check_experiment_budgets(config: Path) -> Checked | None:
    """Refuse (ParnasError, one line) an experiment config whose trials can draw a budget below the cheapest layout
    of their space; else what was checked (None when the trials draw no budget)."""
    try:
        experiment = reading.parse_yaml(reading.read_text(config), str(config))
    except Exception:  # noqa: BLE001 - nnictl reads it too, and says what is wrong with it
        return None
    cfg = trial_config(experiment) if isinstance(experiment, dict) else None
    budgets = drawn_budgets(experiment, cfg) if cfg is not None else []
    if not budgets:
        return None
    floor, cheapest, priced, table = cheapest_ratio(cfg)
    low = min(budgets)
    if low < floor - 1e-9:
        raise ParnasError(f"{config}: its trials can draw {BUDGET}={low:g}, below the cheapest layout of their space "
                          f"(all {cheapest}, {floor:.3f} of Transformer-XL's cost by {priced}): give budgets of at "
                          f"least {floor:.2f}; nothing was started")
    return Checked(f"latency budgets {', '.join(f'{b:g}' for b in sorted(set(budgets)))}: within reach (the cheapest "
                   f"layout, all {cheapest}, costs {floor:.3f} of Transformer-XL's by {priced})", table)


def cheapest_ratio(cfg: Config) -> tuple[float, str, str, LatencyTable | None]:
    """(the cheapest layout's cost ratio, its kind, what priced it, the table this machine gave: None under FLOPs or
    a given table) as the trials of ``cfg`` price it."""
    from parnas.strategies.costs import flops_model, latency_costs
    from parnas.strategies.pricing import cost_kinds
    from parnas.training.devices import training_device
    from parnas.training.dry_run import planned_vocabulary
    from parnas.training.latency_cache import latency_table
    from parnas.training.latency_table import load_table_for, table_key

    kinds, mine = cost_kinds(cfg), None
    if cfg.search.penalty_cost == "flops":
        costs, priced = flops_model(kinds, cfg.model, cfg.data.seg_len, cfg.data.batch_size), "FLOPs"
    else:
        vocab, device, target = planned_vocabulary(cfg.data), training_device(cfg.train), cfg.search.latency_target
        if cfg.search.latency_table is not None:
            key = table_key(cfg, vocab, sorted({*kinds, "identity"}), device)
            table, priced = load_table_for(cfg.search.latency_table, key, target=target), cfg.search.latency_table
        else:
            table, cached = latency_table(cfg, vocab, kinds, device, targets=(target,))
            mine = table
            priced = "this machine's cached latency table" if cached else "a latency table timed now"
        costs = latency_costs(table, cfg.model.n_blocks, target)
    cheapest = min(cfg.search.candidates, key=costs.per_kind.__getitem__)
    return costs.ratio([cheapest] * cfg.model.n_blocks), cheapest, priced, mine
