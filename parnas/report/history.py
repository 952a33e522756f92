"""``history.jsonl``, the search's log, as arrays, and how block kinds are named and coloured.

One line per logged step: ``step``, ``tau``, ``probabilities`` (block label -> kind -> softmax(alpha)); evaluation
lines add ``val_ppl`` (the exported architecture's, supernet weights), ``supernet_val_ppl``, ``architecture`` (its
letter code) and, where a mid-search evaluation read only the first part of the validation split, ``valid_fraction``;
a space with ``ut`` blocks logs ``act_steps`` (block label -> mean pondering steps per position of its candidate).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from parnas.errors import ParnasError
from parnas.report.experiments import perplexities

HISTORY = "history.jsonl"
KIND_ORDER = ("attention", "dense", "identity")
KIND_COLOURS = {"attention": "#1f77b4", "dense": "#ff7f0e", "identity": "#8c8c8c"}
_SPARE_COLOURS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")


class HistoryError(ParnasError):
    """A run directory whose history is missing, empty or malformed."""


@dataclass(frozen=True)
class History:
    """``history.jsonl`` as arrays: ``probs[t, block, kind]`` at ``steps[t]``."""

    steps: np.ndarray  # (T,) int
    tau: np.ndarray  # (T,) float
    blocks: tuple[str, ...]  # block labels in depth order
    kinds: tuple[str, ...]  # candidate kinds, canonical order first
    probs: np.ndarray  # (T, n_blocks, n_kinds)
    val_steps: np.ndarray  # (E,) steps of the evaluation lines
    val_ppl: np.ndarray  # (E,) the exported architecture's (NaN where not recorded)
    supernet_val_ppl: np.ndarray  # (E,) the supernet's (NaN where not recorded)
    architectures: tuple[str, ...]  # (E,) the exported architecture's letter code ("" where not recorded)
    val_fraction: np.ndarray  # (E,) the part of the validation split both perplexities read (1.0: the whole split)
    source: Path
    act_steps: dict[str, float] = field(default_factory=dict)  # block -> a ut candidate's mean steps, last logged


def kind_colour(kind: str) -> str:
    """Fixed colour of a kind: attention blue, dense orange, identity grey, then Tableau's qualitative colours in
    registry order (plugin kinds last); a name no kind has gets a spare colour, stable by name."""
    from parnas import kinds

    if kind in KIND_COLOURS:
        return KIND_COLOURS[kind]
    palette = ("#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
    others = [k for k in kinds.names() if k not in KIND_COLOURS]
    if kind in others:
        return palette[others.index(kind) % len(palette)]
    return _SPARE_COLOURS[sum(map(ord, kind)) % len(_SPARE_COLOURS)]


def block_key(label: str) -> tuple[int, int | str]:
    prefix, _, index = label.rpartition("_")
    return (0, int(index)) if prefix and index.isdigit() else (1, label)


def block_name(label: str) -> str:
    """``block_3`` -> ``block 3`` (other labels as they are)."""
    return f"block {label.rpartition('_')[2]}" if block_key(label)[0] == 0 else label


def load_history(run_dir: str | Path) -> History:
    """Read ``<run_dir>/history.jsonl`` (or that file itself), skipping a last line without its newline that does not
    parse: a running search is writing it."""
    path = Path(run_dir).expanduser()
    path = path / HISTORY if path.is_dir() else path
    if not path.is_file():
        where = path.parent if path.name == HISTORY else path
        raise HistoryError(f"no {HISTORY} in {where}: pass the run directory of a parnas search (search.out_dir)")
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    records: dict[int, dict] = {}
    act_steps: dict[str, float] = {}
    blocks: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            # no tau: a search whose forward draws no Gumbel sample reads none, and records none
            step, tau, probs = int(rec["step"]), float(rec.get("tau", "nan")), rec["probabilities"]
            row = {b: {k: float(p) for k, p in probs[b].items()} for b in probs}
        except (ValueError, KeyError, TypeError, AttributeError):
            if number == len(lines) and not text.endswith("\n"):
                continue  # being written right now
            raise HistoryError(f"{path} line {number} is not a history record "
                               '({"step": int, "tau": float, "probabilities": {block: {kind: p}}})') from None
        if not blocks:
            blocks = tuple(sorted(row, key=block_key))
            kinds = tuple(sorted(row[blocks[0]] if blocks else (),
                                 key=lambda k: (KIND_ORDER.index(k) if k in KIND_ORDER else len(KIND_ORDER), k)))
            if not blocks or not kinds:
                raise HistoryError(f"{path} line {number} has no block probabilities")
        if set(row) != set(blocks) or any(set(row[b]) != set(kinds) for b in blocks):
            raise HistoryError(f"{path} line {number} has other blocks or kinds than the first record "
                               f"({len(blocks)} blocks x {', '.join(kinds)})")
        exported, supernet = perplexities(rec)
        code = rec.get("architecture") if isinstance(rec.get("architecture"), str) else ""
        fraction = rec.get("valid_fraction", 1.0)
        fraction = float(fraction) if isinstance(fraction, (int, float)) and 0 < fraction <= 1 else 1.0
        evaluation = ({"ppl": exported, "supernet": supernet, "code": code, "fraction": fraction}
                      if exported or supernet else None)
        # a repeated step: the last line wins, keeping an earlier line's evaluation if it has none
        act = rec.get("act_steps")
        if isinstance(act, dict):
            act_steps.update({str(b): float(v) for b, v in act.items() if isinstance(v, (int, float))})
        records[step] = {"tau": tau, "p": [[row[b][k] for k in kinds] for b in blocks],
                         "eval": evaluation or (records.get(step) or {}).get("eval")}
    if not records:
        raise HistoryError(f"{path} is empty: the search has not logged a step yet")
    steps = np.array(sorted(records))
    evals = [(s, records[s]["eval"]) for s in steps if records[s]["eval"]]
    nan = float("nan")
    return History(steps=steps, tau=np.array([records[s]["tau"] for s in steps]), blocks=blocks, kinds=kinds,
                   probs=np.array([records[s]["p"] for s in steps], dtype=np.float64),
                   val_steps=np.array([s for s, _ in evals], dtype=np.int64),
                   val_ppl=np.array([e["ppl"] or nan for _, e in evals], dtype=np.float64),
                   supernet_val_ppl=np.array([e["supernet"] or nan for _, e in evals], dtype=np.float64),
                   architectures=tuple(e["code"] for _, e in evals),
                   val_fraction=np.array([e["fraction"] for _, e in evals], dtype=np.float64),
                   source=path, act_steps=act_steps)


