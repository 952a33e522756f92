"""``parnas compare``: one table of finished runs, from their ``metrics.json``, their speed timed side by side.

A run's own throughput was timed at its own moment: on a shared machine the load then decides it as much as the
model does, and can reverse which of two models is faster. So the speed columns come from timing the runs' models
here, in alternating rounds (:mod:`parnas.training.side_by_side`), as ``parnas study`` does; every other figure is
the run's record (docs/reference.md, "Retraining what was found", says what the table shows).
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from parnas import reading
from parnas.errors import ParnasError
from parnas.retrain.units import run_units

AUTO_TIME_PARAMETERS = 20_000_000  # every run at most this many parameters: timed side by side unless --no-time

SPEED = [  # (header, row key, target): timed side by side
    ("train tokens/s", "side_train_tokens_per_s", "train"),
    ("inference tokens/s", "side_inference_tokens_per_s", "inference"),
    ("generated tokens/s", "side_generate_tokens_per_s", "generate"),
]
COLUMNS = [  # (header, row key, format)
    ("run", "run", "{}"), ("architecture", "architecture", "{}"), ("steps", "steps", "{:,}"),
    ("parameters", "parameters", "{:,}"), ("attention blocks", "attention_blocks", "{:,}"),
    *[(header, key, "{:,.0f}") for header, key, _ in SPEED],
    ("peak memory (MB)", "peak_memory_mb", "{:,.0f}"), ("val ppl", "val_ppl", "{:.2f}"),
    ("test ppl", "test_ppl", "{:.2f}"),
]
OWN = [  # each run's own record, timed in its own process
    ("run", "run", "{}"), ("train tokens/s", "train_tokens_per_s", "{:,.0f}"),
    ("eval tokens/s", "eval_tokens_per_s", "{:,.0f}"), ("device", "device", "{}"),
]
CSV_KEYS = [key for _, key, _ in COLUMNS[:-2]] + [f"{key}_spread" for _, key, _ in SPEED] + [
    "train_tokens_per_s", "eval_tokens_per_s", "device", "val_ppl", "test_ppl"]
ONE_NETWORK_TRAIN = ("max_steps", "lr")  # with the layout, model and data: what makes two runs one network


def read_run(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / "metrics.json"
    try:
        metrics = reading.read_json(path)
    except FileNotFoundError:
        raise ParnasError(f"{run_dir} has no metrics.json: give directories of finished runs") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ParnasError(f"cannot read {path}: {e}") from None
    if not isinstance(metrics, dict):
        raise ParnasError(f"{path} does not hold a metrics object")
    return {"run": str(run_dir), **metrics}


def rows(runs: Sequence[dict[str, Any]], timing: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One dict per run with every column's key, the speed columns from ``timing`` where given, None where missing."""
    out = []
    for i, m in enumerate(runs):
        row = {key: m.get(key) for key in CSV_KEYS}
        row["units"] = run_units(m)
        if timing is not None:
            from parnas.training.side_by_side import timed_tokens_per_s

            row.update({key: round(timed_tokens_per_s(timing, str(i), mode), 1) for _, key, mode in SPEED})
            row.update({f"{key}_spread": timing[f"{mode}_spread"][str(i)] for _, key, mode in SPEED})
        out.append(row)
    return out


def should_time(runs: Sequence[dict[str, Any]], asked: bool | None) -> bool:
    """``--time``/``--no-time`` when given, else whether every run is small enough to time in seconds."""
    if asked is not None:
        return asked
    return all(isinstance(m.get("parameters"), int) and m["parameters"] <= AUTO_TIME_PARAMETERS for m in runs)


def timing_plan(runs: Sequence[dict[str, Any]]) -> tuple[Any, dict[str, tuple[list[str], Any]], int]:
    """The first run's config (its data shapes), each run's layout and model settings, and the vocabulary, for
    :func:`time_runs`; ParnasError naming what is missing or what differs between the runs otherwise."""
    from parnas.config import Config
    from parnas.overrides import from_dict

    configs = []
    for m in runs:
        if not isinstance(m.get("config"), dict) or not m.get("blocks") or not m.get("vocab_size"):
            raise ParnasError(f"{m['run']}/metrics.json has no config, blocks or vocab_size")
        configs.append(from_dict(Config, m["config"]))
    shared = {"data.batch_size": [c.data.batch_size for c in configs],
              "data.seg_len": [c.data.seg_len for c in configs],
              "train.precision": [c.train.precision for c in configs], "vocabulary": [m["vocab_size"] for m in runs]}
    for what, values in shared.items():
        if len(set(values)) > 1:
            raise ParnasError(f"the runs differ in {what} ({', '.join(map(str, values))})")
    layouts = {str(i): (list(m["blocks"]), c.model) for i, (c, m) in enumerate(zip(configs, runs))}
    return configs[0], layouts, int(runs[0]["vocab_size"])


def time_runs(runs: Sequence[dict[str, Any]], rounds: int, progress: Callable[[str, int, int, str], None] | None = None
              ) -> dict[str, Any]:
    """Every run's model timed side by side here (keyed ``"0"``, ``"1"`` ... by position), on CUDA where they trained
    there and this machine has it."""
    import torch

    from parnas.training.side_by_side import time_side_by_side

    cfg, layouts, vocab_size = timing_plan(runs)
    on_cuda = torch.cuda.is_available() and all(str(m.get("device", "")).startswith("cuda") for m in runs)
    return time_side_by_side(cfg, rounds, layouts, vocab_size, torch.device("cuda" if on_cuda else "cpu"), progress)


def cell(value: Any, fmt: str) -> str:
    """A table cell: ``fmt`` applied where it applies, '-' for a missing value."""
    if value is None:
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def _table(table: list[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> list[str]:
    head = [h for h, _, _ in columns]
    align = "|".join("---" if fmt == "{}" else "---:" for _, _, fmt in columns)  # text left, figures right
    lines = ["| " + " | ".join(head) + " |", f"|{align}|"]
    return lines + ["| " + " | ".join(cell(row[key], fmt) + spread_cell(row.get(f"{key}_spread"))
                                      for _, key, fmt in columns) + " |" for row in table]


def spread_cell(spread: float | None) -> str:
    """A timed speed's spread over its rounds, beside it: `` ±3%``; nothing where it has none (one round)."""
    return "" if spread is None else f" ±{spread:.0%}" if spread >= 0.01 else " ±<1%"


def one_network(runs: Sequence[dict[str, Any]]) -> list[list[int]]:
    """Groups (positions, two or more) of runs that are one network (layout, model, data, training length and rate
    alike, whatever their seed, folder or machine): their gaps are noise."""
    groups: dict[str, list[int]] = {}
    for i, m in enumerate(runs):
        config = m.get("config")
        if not isinstance(config, dict) or not m.get("blocks"):
            continue
        train = config.get("train") or {}
        key = json.dumps([m["blocks"], config.get("model"), config.get("data"),
                          [train.get(k) for k in ONE_NETWORK_TRAIN]], sort_keys=True, default=str)
        groups.setdefault(key, []).append(i)
    return [group for group in groups.values() if len(group) > 1]


def noise_lines(runs: Sequence[dict[str, Any]], table: list[dict[str, Any]], timing: dict[str, Any] | None
                ) -> list[str]:
    """The lines under the table: each group of runs that is one network with the gaps between them (the noise
    floor of every column), a load beyond the cores the timing used, and what the perplexities are per."""
    lines = []
    for group in one_network(runs):
        gaps = []
        for header, key, _ in [*(SPEED if timing else []), ("val ppl", "val_ppl", ""), ("test ppl", "test_ppl", "")]:
            values = [table[i][key] for i in group if table[i][key] is not None]
            if len(values) < 2:
                continue
            gap = max(values) - min(values)
            gaps.append(f"{header} {gap:.2f}" if "ppl" in key else f"{header} {gap / statistics.mean(values):.0%}")
        names = ", ".join(str(runs[i]["run"]) for i in group)
        lines.append(f"One network: {names} (layout {table[group[0]]['architecture']}, one model, data and training "
                     f"length): their gaps are noise, the floor under every gap in this table"
                     + (f" ({', '.join(gaps)})." if gaps else "."))
    if timing and timing.get("load") is not None and timing["load"] > timing["threads"]:
        lines.append(f"The machine's load average was {timing['load']:.2f} over the {timing['threads']} core"
                     f"{'s' * (timing['threads'] != 1)} this timing used: other work competed with it.")
    units = {row.get("units") for row in table if row.get("val_ppl") is not None or row.get("test_ppl") is not None}
    if len(units) == 1 and None not in units:
        lines.append(f"Perplexities {units.pop()}: not per word, not comparable with word-level results.")
    elif units:
        each = "; ".join(f"{row['run']} {row.get('units') or 'unknown'}" for row in table)
        lines.append(f"Perplexities per each run's own token ({each}): not comparable across them, nor per word.")
    return lines


def markdown(table: list[dict[str, Any]], timing: dict[str, Any] | None = None, not_timed: str = "",
             runs: Sequence[dict[str, Any]] = ()) -> str:
    """The runs' table, speed from ``timing`` (without it no speed columns, and ``not_timed`` says why), the lines on
    noise and units (:func:`noise_lines`), then the runs' own throughputs under a heading saying they were apart."""
    columns = COLUMNS if timing else [c for c in COLUMNS if c[1] not in {key for _, key, _ in SPEED}]
    lines = _table(table, columns)
    if timing:
        threads = f"{timing['threads']} thread{'s' * (timing['threads'] != 1)}"
        lines += ["", f"Speed timed side by side in this process: the median of {timing['rounds']} alternating "
                      f"rounds of every model (± their interquartile range) on {timing['device']} ({threads}), batch "
                      f"{timing['batch_size']} x {timing['seg_len']}; generated tokens one at a time at batch 1."]
    elif not_timed:
        lines += ["", f"Not timed side by side: {not_timed}."]
    lines += noise_lines(runs, table, timing) if runs else []
    lines += ["", "Timed separately, each run in its own process at its own moment (the machine's load then "
                  "differs: do not rank runs by these):", "", *_table(table, OWN)]
    return "\n".join(lines) + "\n"


def to_csv(table: Sequence[Mapping[str, Any]], keys: Sequence[str] = CSV_KEYS) -> str:
    """The rows' ``keys`` as CSV, an empty cell for None (``parnas compare``'s table and a study's)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(keys)
    writer.writerows(["" if row[key] is None else row[key] for key in keys] for row in table)
    return out.getvalue()
