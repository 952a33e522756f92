"""What ``parnas study`` writes: one row per (role, layout, search), then ``study.md``, ``study.csv``, ``study.png``
and ``study.json`` with the summary per group and the verdicts. Latency figures are the side-by-side timings, never
the retrains' own throughput (those ran at different times, under different load).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from parnas.architecture import layout_string
from parnas.config import TARGET_LABELS
from parnas.files import write_json_atomic, write_text_atomic
from parnas.kinds import attending
from parnas.nn.model import blocks_run
from parnas.retrain.compare import cell, to_csv
from parnas.study.verdicts import costs_label, summarise, target_label, verdicts

COLUMNS = [  # (key, header, format)
    ("role", "role", "{}"), ("candidates", "candidates", "{}"), ("budget", "budget", "{}"), ("seed", "seed", "{}"),
    ("layout", "layout", "{}"), ("attention", "attention", "{}"), ("val_ppl", "val ppl", "{:.2f}"),
    ("test_ppl", "test ppl", "{:.2f}"), ("train_tokens_per_s", "train tok/s", "{:,.0f}"),
    ("inference_tokens_per_s", "inference tok/s", "{:,.0f}"), ("train_step_ms", "train step ms", "{:.2f}"),
    ("latency_ratio", "ratio to TXL", "{:.3f}"), ("search_val_ppl", "search val ppl", "{:.2f}"),
    ("supernet_val_ppl", "supernet val ppl", "{:.2f}"), ("predicted_ratio", "predicted ratio", "{:.3f}"),
]
CSV_KEYS = [k for k, _, _ in COLUMNS] + ["val_ppl_std", "inference_step_ms", "inference_ratio", "generate_token_ms",
                                         "generate_ratio", "run"]
STYLE = {"space": (".", "#b0b0b0", 30), "random": ("o", "#7f7f7f", 50), "sandwich": ("D", "#2ca02c", 60),
         "front": ("s", "#9467bd", 50), "transformer-xl": ("s", "#000000", 80),
         "found": ("*", "#d62728", 160)}  # drawn in this order: found on top


def budget_label(budget: float | None) -> str:
    """A latency budget as directory names and tables show it: ``0.65`` or ``none``."""
    return "none" if budget is None else f"{budget:g}"


def build_rows(entries: Sequence[Any], metrics: Mapping[str, Mapping[str, Any]], timing: Mapping[str, Any],
               out: Path, reversible: bool = False) -> list[dict[str, Any]]:
    """One dict per entry (``parnas.study.plan.Entry``): retrain perplexities, side-by-side timings, search figures, and
    the network it runs (:func:`parnas.nn.model.blocks_run`: identity blocks dropped, unless ``reversible``)."""
    train_ms, infer_ms = timing["train_step_ms"], timing["inference_step_ms"]
    target_ms = timing[f"{timing.get('target', 'train')}_step_ms"]  # what the verdicts judge by
    generate_ms = timing.get("generate_step_ms", {})
    txl = next(e.layout for e in entries if e.role == "transformer-xl")
    tokens = timing["batch_size"] * timing["seg_len"]  # both modes step on a training-sized batch
    priced = timing.get("priced_by") or {}
    costs = f"predicted for {priced['device']}" if timing.get("target", "train") in priced.get("targets", ()) \
        else "measured"  # the target's times: this machine's, or the given latency table's
    rows = []
    for e in entries:
        m, search = metrics[e.layout], e.search or {}
        rows.append({
            "role": e.role, "candidates": e.candidates,
            "budget": None if e.role in ("transformer-xl", "front", "space") else budget_label(e.budget),
            "seed": e.seed, "layout": e.layout, "network": layout_string(blocks_run(e.kinds, reversible)),
            "attention": attending(e.kinds), "val_ppl": m.get("val_ppl"), "test_ppl": m.get("test_ppl"),
            "val_ppl_std": m.get("val_ppl_std"), "val_ppl_seeds": m.get("val_ppl_seeds"),
            "train_step_ms": train_ms[e.layout], "train_tokens_per_s": tokens / train_ms[e.layout] * 1e3,
            "inference_step_ms": infer_ms[e.layout], "inference_tokens_per_s": tokens / infer_ms[e.layout] * 1e3,
            "generate_token_ms": generate_ms.get(e.layout), "latency_target": timing.get("target", "train"),
            "target_ms": target_ms[e.layout], "costs": costs, "latency_ratio": target_ms[e.layout] / target_ms[txl],
            "generate_ratio": generate_ms[e.layout] / generate_ms[txl] if generate_ms else None,
            "inference_ratio": infer_ms[e.layout] / infer_ms[txl],
            "search_val_ppl": search.get("val_ppl"), "supernet_val_ppl": search.get("supernet_val_ppl"),
            "predicted_ratio": (search.get("latency") or {}).get("ratio"), "run": str(out / "retrain" / e.layout),
        })
    return rows


def budgets(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["budget"] for r in rows if r["role"] == "found"))


# --- files ---------------------------------------------------------------------------------------------

def _fmt(value: Any, fmt: str = "{:.2f}") -> str:
    return cell(value, fmt)


def _pm(mean: float | None, std: float | None, fmt: str) -> str:
    return _fmt(mean, fmt) + ("" if std is None else " ± " + _fmt(std, fmt))


def study_markdown(plan: Any, rows: Sequence[Mapping[str, Any]], summary: Sequence[Mapping[str, Any]],
             lines: Sequence[str], timing: Mapping[str, Any]) -> str:
    steps = f"search {plan.search_steps or 'config'} steps, retrain {plan.retrain_steps or 'config'} steps"
    memory, model = timing["memory"], plan.base.model
    sets = [c for c in dict.fromkeys(r.get("candidates") for r in rows) if c is not None]
    columns = [c for c in COLUMNS if sets or c[0] != "candidates"]
    out = [f"# parnas study: {plan.config or 'defaults'}", "",
           (f"candidate sets {', '.join(sets)}; " if sets else "") +
           f"{plan.seeds} seeds, budgets {', '.join(budgets(rows))}, {steps}, {plan.random_orderings} random "
           f"orderings; settings: {' '.join(plan.overrides) or '(config as is)'}.",
           f"Timing: {timing['device']}, {timing['threads']} threads, torch {timing['torch']}, median of "
           f"{timing['rounds']} alternating rounds, batch {timing['batch_size']} x {timing['seg_len']} tokens "
           f"(train and inference; generation at batch 1), memory {memory['train']} training, {memory['inference']} "
           f"in inference, {memory['generate']} generating; ratios are {TARGET_LABELS[timing.get('target', 'train')]} "
           f"times. Val and test ppl at memory {model.evaluation_memory}"
           f"{f', positions clamped at {model.clamp_len}' if model.clamp_len else ''}.",
           *([f"Costs: {', '.join(TARGET_LABELS[t] + 's' for t in timing['priced_by']['targets'])} priced by the "
              f"latency table {timing['priced_by']['table']}, timed on {timing['priced_by']['device']} (the times "
              "above are kept under timing.measured in study.json)."] if timing.get("priced_by") else []), "",
           "## Verdicts", ""]
    out += [f"- {line}" for line in lines]
    head = "| candidates " if sets else ""
    out += ["", f"## Per {'candidate set and ' if sets else ''}budget (mean ± std over seeds)", "",
            f"{head}| budget | seeds | found val ppl | found ratio | random val ppl | random ratio | sandwich val ppl "
            "| sandwich ratio | Transformer-XL val ppl | TXL step ms |", "|---" * (10 + bool(sets)) + "|"]
    for s in summary:
        first = f"| {s['candidates']} " if sets else ""
        out.append(f"{first}| {s['budget']} | {s['seeds']} "
                   f"| {_pm(s['found_val_ppl'], s['found_val_ppl_std'], '{:.2f}')} "
                   f"| {_pm(s['found_ratio'], s['found_ratio_std'], '{:.3f}')} | {_fmt(s['random_val_ppl'])} "
                   f"| {_fmt(s['random_ratio'], '{:.3f}')} | {_fmt(s['sandwich_val_ppl'])} "
                   f"| {_fmt(s['sandwich_ratio'], '{:.3f}')} | {_fmt(s['transformer_xl_val_ppl'])} "
                   f"| {_fmt(s['transformer_xl_train_step_ms'])} |")
    out += ["", "## All runs", "", "| " + " | ".join(h for _, h, _ in columns) + " |",
            "|" + "|".join("---" if i < 4 + bool(sets) else "---:" for i in range(len(columns))) + "|"]
    out += ["| " + " | ".join(_fmt(r[k], f) for k, _, f in columns) + " |" for r in rows]
    out += ["", "Val and test ppl: exp of the mean NLL over the whole split, each layout retrained from scratch with "
            "the same steps, settings and seed. Step times and tokens/s: measured side by side in one process after "
            f"the retrains; ratio to TXL = {target_label(rows)} / Transformer-XL's. Search val ppl: the exported "
            "architecture with the supernet's weights, before retraining; predicted ratio: the search's latency model.",
            ""]
    return "\n".join(out)


def study_figure(rows: Sequence[Mapping[str, Any]], title: str) -> Any:
    """Validation perplexity against the measured latency target, one style per role, Pareto front ringed."""
    from parnas.report.pareto import pareto_front
    from parnas.report.plots import figure

    fig = figure(8.0, 5.5, layout="constrained")
    ax = fig.add_subplot()
    points = {(r["role"], r["layout"]): (r["target_ms"], r["val_ppl"]) for r in rows if r["val_ppl"] is not None}
    for role, (marker, colour, size) in STYLE.items():
        xy = [p for (rl, _), p in points.items() if rl == role]
        if xy:
            ax.scatter(*zip(*xy), marker=marker, color=colour, s=size, label=role, zorder=3, alpha=0.85)
    layouts = {lay: p for (_, lay), p in points.items()}
    xy = list(layouts.values())
    front = [xy[i] for i in pareto_front(xy)] if xy else []
    if front:
        ax.step(*zip(*front), where="post", color="#1f77b4", linewidth=1.2, zorder=1)
        ax.scatter(*zip(*front), s=260, facecolors="none", edgecolors="#1f77b4", linewidths=1.5,
                   label="Pareto front", zorder=2)
    named = {lay for (role, lay) in points if role != "space"}  # the space's networks: named on the front only
    labelled = {lay: p for lay, p in layouts.items() if lay in named or p in front}
    for names, (x, y) in _label_groups(labelled):
        ax.annotate("\n".join(names), (x, y), textcoords="offset points", xytext=(6, 4), fontsize=7,
                    family="monospace", va="bottom")
    ax.set_xlabel(f"{costs_label(rows)} {target_label(rows)} (ms)  \u2192 faster to the left")
    ax.set_ylabel("validation perplexity after retraining (lower is better)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.margins(x=0.15, y=0.1)
    ax.legend(frameon=False)
    return fig


def _label_groups(points: Mapping[str, tuple[float, float]], near: float = 0.015
                  ) -> list[tuple[list[str], tuple[float, float]]]:
    """Layouts whose points lie within ``near`` of the axes' spans of each other share one label (one name a
    line), so coincident points (layouts equal up to identity blocks) do not print over each other."""
    if not points:
        return []
    xs, ys = zip(*points.values())
    dx, dy = (max(xs) - min(xs)) * near or 1.0, (max(ys) - min(ys)) * near or 1.0
    groups: list[tuple[list[str], tuple[float, float]]] = []
    for name, (x, y) in points.items():
        for names, (gx, gy) in groups:
            if abs(x - gx) <= dx and abs(y - gy) <= dy:
                names.append(name)
                break
        else:
            groups.append(([name], (x, y)))
    return groups


def write_report(plan: Any, rows: list[dict[str, Any]], timing: Mapping[str, Any],
                 ranking: Mapping[str, Mapping[str, Any]] | None = None,
                 census: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``study.md``, ``study.csv``, ``study.png`` and ``study.json`` in ``plan.out``; returns the JSON's content.
    ``census``: the sample of the space retrained (``networks`` of ``of``, drawn with ``seed``), if any."""
    from parnas.report.plots import save_figure
    from parnas.study.space import space_name

    summary = summarise(rows)
    lines = verdicts(rows, summary, ranking, census and space_name(census["networks"], census["of"]))
    out = Path(plan.out)
    study = {"format": "parnas.study", "version": 1, "config": plan.config, "overrides": list(plan.overrides),
             "seeds": plan.seeds, "budgets": budgets(rows), "search_steps": plan.search_steps,
             "candidate_sets": [list(c) for c in getattr(plan, "candidate_sets", ())],
             "retrain_steps": plan.retrain_steps, "random_orderings": plan.random_orderings, "timing": dict(timing),
             "retrain_seeds": getattr(plan, "retrain_seeds", 1), "val_mem_len": plan.base.model.evaluation_memory,
             "clamp_len": plan.base.model.clamp_len, "rows": rows, "summary": summary,
             "ranking": dict(ranking or {}), **({"census": dict(census)} if census else {}), "verdicts": lines}
    write_text_atomic(out / "study.md", study_markdown(plan, rows, summary, lines, timing))
    write_text_atomic(out / "study.csv", to_csv(rows, CSV_KEYS))
    costs_from = (timing.get("priced_by") or {}).get("device") or timing["device"]
    save_figure(study_figure(rows, f"parnas study ({plan.config or 'defaults'}, costs on {costs_from})"),
                out / "study.png")
    write_json_atomic(out / "study.json", study)
    return study
