"""``parnas table add-seeds RUN [RUN ...] --table FILE``: further retrain seeds for a ranking table's layouts.

A table's seed spreads say what a regret of a few tenths of a percent means, and its best layouts are where the
regrets are decided; retraining every layout again would cost what the table cost. So a table takes further seeds of
chosen layouts, each a finished ``parnas train`` run of the table's model, segment length, vocabulary and retrain
steps with a ``train.seed`` the table lacks for that layout (seed + k goes to index k); spreads, noise ceiling and
rebuild commands follow.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from parnas import kinds
from parnas.errors import ConfigError
from parnas.study.score import table_layout
from parnas.study.table import check_same_model, load_table, noise_ceiling, read_json_file, seed_spread


def add_seeds(table_path: str | Path, runs: Sequence[str | Path]) -> tuple[dict[str, Any], list[str]]:
    """The table at ``table_path`` with each run's validation perplexity added to its layout at its seed's index,
    and a line per added seed; ConfigError (one line) for a run the table cannot take. Reads only."""
    from parnas import architecture
    from parnas.config import load_config

    table = load_table(table_path)
    data = read_json_file(Path(table_path), "--table", "a parnas ranking table")
    base = load_config(table.config["preset"], table.config.get("overrides") or []).train.seed
    seeds = {k: list(v) for k, v in table.seeds.items()}
    lines, commands = [], []
    for run in map(Path, runs):
        cfg, metrics = _finished_run(run)
        check_same_model(table, cfg, architecture.read(run / "architecture.json").get("tokenizer") or {},
                         f"--table {table.name}: {run}")
        if metrics.get("steps") != table.config.get("retrain_steps"):
            raise ConfigError(f"{run} trained {metrics.get('steps')} steps; the table's layouts were "
                              f"retrained for {table.config.get('retrain_steps')}")
        blocks = [*cfg.model.blocks, *["identity"] * (table.n_blocks - len(cfg.model.blocks))]
        layout = table_layout("".join(kinds.letter(k) for k in blocks), table.layouts)
        if layout not in seeds:
            raise ConfigError(f"{run} trained {layout}, which the table does not hold")
        index = cfg.train.seed - base
        values = seeds[layout]
        if index < 0 or index < len(values) and values[index] is not None:
            raise ConfigError(f"{run} is seed {cfg.train.seed} of {layout}, which the table holds "
                              f"already (its seeds: {base}..{base + len(values) - 1})")
        values.extend([None] * (index + 1 - len(values)))
        values[index] = float(metrics["val_ppl"])
        lines.append(f"{layout}: seed {cfg.train.seed}, val ppl {values[index]:.2f} (from {run})")
        commands.append(" ".join(["parnas train", f"--config {table.config['preset']}",
                                  *(f"--set {shlex.quote(o)}" for o in table.config.get("overrides") or []),
                                  f"--set {shlex.quote('model.blocks=[' + ', '.join(cfg.model.blocks) + ']')}",
                                  f"--set train.max_steps={metrics['steps']} --set train.seed={cfg.train.seed}",
                                  *([f"--set train.threads={cfg.train.threads}"] if cfg.train.threads else []),
                                  f"--set train.out_dir={shlex.quote(str(run))}"]))
    for layout, values in seeds.items():
        data["layouts"][layout].update(val_ppl_seeds=values, val_ppl_std=seed_spread(values))
    data["noise_ceiling"] = noise_ceiling(seeds)
    runs_given = " ".join(shlex.quote(str(r)) for r in runs)
    data["rebuild"] = " && ".join([data["rebuild"], *commands, f"parnas table add-seeds {runs_given} --table "
                                   "TABLE.json"])
    return data, lines


def _finished_run(run: Path) -> tuple[Any, dict[str, Any]]:
    """A finished ``parnas train`` run's config and metrics; ConfigError for anything else."""
    from parnas.config import Config
    from parnas.overrides import from_dict

    metrics_path = run / "metrics.json"
    if not metrics_path.is_file() or not (run / "architecture.json").is_file():
        raise ConfigError(f"{run} is not a finished `parnas train` run (no metrics.json and architecture.json)")
    metrics = read_json_file(metrics_path, "RUN", "the metrics.json `parnas train` writes")
    if not isinstance(metrics, dict) or not isinstance(metrics.get("config"), dict) or not isinstance(
            metrics.get("val_ppl"), (int, float)) or metrics.get("diverged"):
        raise ConfigError(f"{metrics_path} holds no validation perplexity of a finished run")
    cfg = from_dict(Config, metrics["config"])
    if not cfg.model.blocks:
        raise ConfigError(f"{run} trained no fixed layout (model.blocks is empty)")
    return cfg, metrics
