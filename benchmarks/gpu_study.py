"""A study in one device call, from a finished search: retrains of its export, the Transformer-XL and the
depth-scaled Transformer-XL front around the export's cost, each on several seeds at equal steps, and the study's
verdict against the front with the seed spread.

    python benchmarks/gpu_study.py --search runs/gpu/study/search --seconds 355 --out runs/gpu/study \\
        --config wt2-par --set data.batch_size=32 --set data.seg_len=128 --set model.mem_len=128 \\
        --set train.precision=bf16-mixed                       # tools/gpu_checks.sh study, on a GPU
    python benchmarks/gpu_study.py ... --steps 8 --compile none   # steps and mode given: the tests, on the CPU

``parnas study`` retrains the whole front (every shallower Transformer-XL), the sandwich and random orderings: on
a lent GPU's minutes that leaves each retrain too few steps to judge by. This keeps what the front verdict needs:
the two front points whose costs bracket the export's (the verdict interpolates between them), the
Transformer-XL (the costliest point), and the export, with the study's own functions (its rows, its front and
verdict, its seed spread). Costs are the search's latency table's predictions (the table it pinned in its run
folder, or ``--latency-table``), as a study priced by ``search.latency_table`` takes them.

The steps are as many as fit in ``--seconds`` (counted from the script's start), the same for every retrain. Each
mode's time is estimated from the step costs the table predicts and from the H100/H200 logs in benchmarks/tables/
(:data:`GRAPHS`): CUDA graphs (``train.compile=reduce-overhead``) step faster than eager, but each layout
compiles first, its evaluation too, so for short retrains of several layouts eager can fit more steps; the mode
that fits more is taken, and both estimates are printed. Retrains run seed by seed (every layout's first seed, then
the second), and the table and verdict (``<out>/study.md``) are rewritten after each, so a call cut at its limit
keeps what finished.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

START = time.perf_counter()  # before torch loads: --seconds is the whole command's

# From the H100/H200 logs in benchmarks/tables/ (wt2-par, B32 L128 M128, bf16): a CUDA-graphed Transformer-XL step
# takes 0.37x an eager one (same-round medians, range 0.31-0.47), its compile 44-54 s for 12 blocks (43.8, 46.0,
# 53.9): some 4 s a block that computes. The evaluation compiles its own graphs, assumed half as long (forward
# only), and a second seed of a layout in the same process finds its kernels in torch's cache, assumed half again.
GRAPHS = {"step_ratio": 0.37, "compile_s_per_block": 4.0, "eval_compile_ratio": 0.5, "second_seed_ratio": 0.5}
RUN_OVERHEAD_S = 6.0  # a retrain's build, data from the cache and final evaluation of both splits (assumed)


def front_around(table: Any, kinds: Sequence[str], n_blocks: int) -> list[tuple[str, ...]]:
    """The shallower Transformer-XLs (2, 4, ... blocks) whose predicted costs bracket ``kinds``'s: the dearest no
    dearer and the cheapest no cheaper (none when that is the ``n_blocks`` one, the study's Transformer-XL)."""
    from parnas.config import transformer_xl_layout

    cost = table.predict(kinds)
    front = [transformer_xl_layout(n) for n in range(2, n_blocks, 2)]
    below = [f for f in front if table.predict(f) <= cost]
    above = [f for f in front if table.predict(f) >= cost]
    picked = [below[-1]] if below else [front[0]] if front else []  # below the cheapest: the cheapest, no verdict
    picked += [above[0]] if above and above[0] not in picked else []
    return picked


def plan_steps(step_ms: Mapping[str, float], compute_blocks: Mapping[str, int], seeds: int, seconds: float,
               mode: str) -> int:
    """The steps each retrain can take so that ``seeds`` retrains of every layout (eager step ``step_ms``, its
    blocks that compute ``compute_blocks``) end within ``seconds``, under ``mode`` (``none``: eager, or
    ``reduce-overhead``: CUDA graphs, :data:`GRAPHS`); 0 when none fit."""
    graphs = mode == "reduce-overhead"
    overhead = RUN_OVERHEAD_S * seeds * len(step_ms)
    if graphs:
        for blocks in compute_blocks.values():
            compile_s = GRAPHS["compile_s_per_block"] * blocks * (1 + GRAPHS["eval_compile_ratio"])
            overhead += compile_s * (1 + GRAPHS["second_seed_ratio"] * (seeds - 1))
    per_step_s = seeds * sum(step_ms.values()) / 1000 * (GRAPHS["step_ratio"] if graphs else 1.0)
    return max(0, math.floor((seconds - overhead) / per_step_s))


def timing_of(table: Any, layouts: Mapping[str, Sequence[str]], batch_size: int, seg_len: int,
              source: str) -> dict[str, Any]:
    """The study's ``timing`` record for ``layouts``, every target priced by ``table`` (as
    :func:`parnas.study.measure.priced_by_table` prices a study with ``search.latency_table``)."""
    out: dict[str, Any] = {"batch_size": batch_size, "seg_len": seg_len, "target": "train",
                           "priced_by": {"table": source, "device": table.key["device"], "targets": list(table.modes)}}
    for mode in table.modes:
        out[f"{mode}_step_ms"] = {code: table.predict(kinds, mode) for code, kinds in layouts.items()}
    return out


def report(entries: Sequence[Any], runs: Mapping[str, list[dict[str, Any]]], timing: Mapping[str, Any],
           out: Path, steps: int, mode: str) -> str:
    """The study's rows of the layouts retrained so far, as a table with each seed's perplexity, and its verdict
    against the front (:func:`parnas.study.front.front_verdict`), the seed spread included."""
    from parnas.study.front import front_verdict
    from parnas.study.measure import over_seeds
    from parnas.study.report import build_rows

    done = [e for e in entries if runs.get(e.layout)]
    metrics = {e.layout: over_seeds(runs[e.layout]) for e in done}
    if not any(e.role == "transformer-xl" for e in done):
        return "no Transformer-XL retrained yet: no rows\n"
    rows = build_rows(done, metrics, timing, out)
    lines = [f"Retrains of {steps:,} steps each, train.compile={mode}; costs predicted for "
             f"{timing['priced_by']['device']} by {timing['priced_by']['table']}.", "",
             "| role | layout | cost (x Transformer-XL's) | val ppl by seed | mean ± spread |",
             "|---|---|---:|---|---:|"]
    for r in rows:
        seeds = ", ".join("n/a" if p is None else f"{p:.2f}" for p in r["val_ppl_seeds"])
        mean = "n/a" if r["val_ppl"] is None else f"{r['val_ppl']:.2f}"
        spread = "" if r["val_ppl_std"] is None else f" ± {r['val_ppl_std']:.2f}"
        lines.append(f"| {r['role']} | {r['layout']} | {r['latency_ratio']:.3f} | {seeds} | {mean}{spread} |")
    found = [r for r in rows if r["role"] == "found"]
    verdict = front_verdict(f"budget {found[0]['budget']}", found, rows) if found else "no export retrained yet"
    return "\n".join([*lines, "", verdict]) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--search", required=True, help="the finished search's run folder (its architecture.json)")
    parser.add_argument("--config", default="wt2-par")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="every retrain's settings")
    parser.add_argument("--seconds", type=float, default=355.0, help="the whole command's time, from its start")
    parser.add_argument("--seeds", type=int, default=2, help="retrains of each layout (train.seed 0, 1, ...)")
    parser.add_argument("--steps", type=int, default=None, help="each retrain's steps (default: as many as fit)")
    parser.add_argument("--compile", default=None, choices=("none", "reduce-overhead"),
                        help="the retrains' train.compile (default: the mode that fits more steps)")
    parser.add_argument("--latency-table", default=None, help="default: the one the search pinned in its folder")
    parser.add_argument("--out", default="runs/gpu/study")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    from dataclasses import replace

    from parnas import architecture
    from parnas.config import load_config, transformer_xl_layout
    from parnas.errors import ParnasError
    from parnas.retrain.run import retrain
    from parnas.study.plan import Entry
    from parnas.training.latency_table import read_table

    search, out = Path(args.search), Path(args.out)
    record = architecture.read(search / "architecture.json")
    table_file = Path(args.latency_table or search / "latency_table.json")
    if not table_file.is_file():
        raise ParnasError(f"{table_file}: no latency table (the search pins one when it prices by latency); give "
                          "--latency-table FILE")
    table = read_table(table_file)
    cfg = load_config(args.config, args.set)
    found = tuple(architecture.layout(record))
    n_blocks = len(found)
    budget = ((record.get("search") or {}).get("latency") or {}).get("budget")
    entries = [Entry("transformer-xl", transformer_xl_layout(n_blocks)),
               *(Entry("front", kinds) for kinds in front_around(table, found, n_blocks)),
               Entry("found", found, budget=budget, seed=(record.get("search") or {}).get("seed"),
                     search=record.get("search") or {})]
    layouts = {e.layout: e.kinds for e in entries}
    timing = timing_of(table, layouts, cfg.data.batch_size, cfg.data.seg_len, str(table_file))
    step_ms = {code: table.predict(kinds) for code, kinds in layouts.items()}
    computing = {code: sum(k != "identity" for k in kinds) for code, kinds in layouts.items()}
    left = args.seconds - (time.perf_counter() - START)
    fits = {mode: plan_steps(step_ms, computing, args.seeds, left, mode) for mode in ("none", "reduce-overhead")}
    mode = args.compile or max(fits, key=lambda m: fits[m])
    steps = args.steps or fits[mode]
    named = ", ".join(f"{e.role} {e.layout}" for e in entries)
    print(f"gpu study: {len(layouts)} layouts x {args.seeds} seeds ({named}); "
          f"{left:.0f} s left: eager fits {fits['none']:,} steps each, CUDA graphs {fits['reduce-overhead']:,} "
          f"(estimates); running {steps:,} steps, train.compile={mode}", flush=True)
    if steps < 1:
        raise ParnasError(f"no retrain fits in {left:.0f} s: give more --seconds, or --steps")

    runs: dict[str, list[dict[str, Any]]] = {}
    like_model = architecture.model_config(record)
    for seed in range(args.seeds):
        for entry in entries:
            arch = out / "layouts" / f"{entry.layout}.json"
            if not arch.is_file():
                model = replace(like_model, n_blocks=len(entry.kinds))
                architecture.write(arch, architecture.make_record(
                    {architecture.label(i): k for i, k in enumerate(entry.kinds)}, model,
                    record["model"]["vocab_size"], tokenizer=record.get("tokenizer"), search={"layout": "gpu study"}))
            run_dir = out / "retrain" / f"{entry.layout}-s{seed}"
            began = time.perf_counter()
            metrics = retrain(str(arch), args.config, [
                *args.set, f"train.max_steps={steps}", f"train.eval_every={steps}", f"train.ckpt_every={steps}",
                f"train.warmup_steps={min(cfg.train.warmup_steps, steps // 2)}", f"train.seed={cfg.train.seed + seed}",
                f"train.compile={mode}", f"train.out_dir={run_dir}"])
            runs.setdefault(entry.layout, []).append(metrics)
            print(f"gpu study: {entry.role} {entry.layout} seed {seed}: val ppl {metrics.get('val_ppl')}, "
                  f"{time.perf_counter() - began:.1f} s, {time.perf_counter() - START:.0f} s in", flush=True)
            text = report(entries, runs, timing, out, steps, mode)
            (out / "study.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    import sys

    from parnas.errors import ParnasError

    try:
        raise SystemExit(main())
    except ParnasError as error:  # a setting, a search folder or a corpus the run refuses: its one line
        print(f"gpu_study.py: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
