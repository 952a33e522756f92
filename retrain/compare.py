"""``parnas compare``: one table of finished runs, from their ``metrics.json``.

Rows are in the order given; every figure is the run's own record, nothing is
recomputed. Written as Markdown (for notes) and CSV (for plotting).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from parnas import reading
from parnas.errors import ParnasError

COLUMNS = [  # (header, metrics key, format)
    ("run", "run", "{}"),
    ("architecture", "architecture", "{}"),
    ("steps", "steps", "{:,}"),
    ("parameters", "parameters", "{:,}"),
    ("attention blocks", "attention_blocks", "{}"),
    ("train tokens/s", "train_tokens_per_s", "{:,.0f}"),
    ("eval tokens/s", "eval_tokens_per_s", "{:,.0f}"),
    ("peak memory (MB)", "peak_memory_mb", "{:,.0f}"),
    ("val ppl", "val_ppl", "{:.2f}"),
    ("test ppl", "test_ppl", "{:.2f}"),
]


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


def rows(run_dirs: Sequence[str | Path]) -> list[dict[str, Any]]:
    """One dict per run with the table's keys (None where a run lacks a figure)."""
    return [{key: m.get(key) for _, key, _ in COLUMNS} for m in map(read_run, run_dirs)]


def cell(value: Any, fmt: str) -> str:
    """A table cell: ``fmt`` applied where it applies, '-' for a missing value."""
    if value is None:
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def markdown(table: list[dict[str, Any]]) -> str:
    head = [h for h, _, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i < 2 else "---:" for i in range(len(head))) + "|"]
    for row in table:
        lines.append("| " + " | ".join(cell(row[key], fmt) for _, key, fmt in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def to_csv(table: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([key for _, key, _ in COLUMNS])
    for row in table:
        writer.writerow(["" if row[key] is None else row[key] for _, key, _ in COLUMNS])
    return out.getvalue()
