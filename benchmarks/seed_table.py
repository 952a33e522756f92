"""The seed's own training table, reproduced: ``wt2-seed`` trained as a fixed Transformer-XL, CUDA-graphed, in
bf16, validated at the seed's step counts, within a time limit.

    python benchmarks/seed_table.py --seconds 300 --out runs/gpu/seed     # on a GPU (tools/gpu_checks.sh seed)
    python benchmarks/seed_table.py --config tiny --set train.compile=none ...  # the same plan, small (the tests)

The seed (the original TensorFlow PAR Transformer-XL, its ``base_model.sh``) reports validation perplexity at
2.7k, 8.5k, 14.1k, 28.3k, 48.1k and 56.5k steps: epochs 1, 3, 5, 10, 17 and 20 of its 2,825 steps an epoch
(56.5k / 20). So the run validates once an epoch (``train.eval_every``, the epoch's length here) and the table
takes those six epochs. Its schedule spans the seed's 56.5k steps whatever this run reaches (``train.max_steps``
stays; the run stops early), so each row is the seed's trajectory at that count.

Whether 56.5k steps fit is measured, not assumed: after the second validation (the first steps compile the
model and the first validation its evaluation; neither is in the second epoch's figures) the script times a
step and a validation, says how many steps fit in what is left of ``--seconds`` (counted from the script's
start, before torch loads) with the final evaluation, and runs to the largest of the seed's counts that fits.
The table (``<out>/seed-table.md``) is rewritten after every validation, so a run cut at its limit keeps its
rows: each with parnas's perplexity both as exp of the mean NLL over the split (the true figure) and as the
seed measured it, the mean over batches of exp(batch loss) (reads higher), and the wall time beside the seed's
37 minutes (prorated by step).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

START = time.perf_counter()  # before torch loads: --seconds is the whole command's

# (steps, val ppl) of the seed's table, and the epochs of 2,825 steps they fall at
SEED = ((2700, 114.4), (8500, 62.33), (14100, 51.88), (28300, 42.61), (48100, 39.57), (56500, 39.41))
EPOCHS = (1, 3, 5, 10, 17, 20)
SEED_MINUTES = 37.0  # the seed's 56.5k steps on a Colab GPU
# the seed's run as parnas trains it on a GPU; --set after these wins
SETTINGS = ("train.compile=reduce-overhead", "train.precision=bf16-mixed", "train.max_steps=56500",
            "train.eval_every=2825", "train.ckpt_every=2825", "train.log_every=2825")


def targets(epoch: int) -> list[int]:
    """The steps at which the seed's counts fall, for an epoch of ``epoch`` steps."""
    return [e * epoch for e in EPOCHS]


def largest_fitting(step: int, counts: Sequence[int], step_s: float, validation_s: float, epoch: int,
                    left_s: float) -> tuple[int, int]:
    """(the largest of ``counts`` at or after ``step`` that training reaches within ``left_s`` seconds, else
    ``step``; the steps that fit at all). Each further step costs ``step_s``, each validation on the way (one an
    ``epoch``) ``validation_s``, and the final evaluation of the validation and test splits three validations'
    time (their warm-ups included)."""
    spare = left_s - 3 * validation_s
    per_step = step_s + validation_s / epoch
    fit = step + max(0, math.floor(spare / per_step)) if per_step > 0 else step
    reach = [c for c in counts if step <= c <= fit]
    return (max(reach) if reach else step), fit


def clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def table(history: Sequence[dict[str, Any]], epoch: int, seconds_at: dict[int, float],
          final: dict[str, Any] | None = None, note: str = "") -> str:
    """The seed's table beside parnas's rows: the validations at the seed's counts."""
    at = {h["step"]: h for h in history}
    lines = ["| seed's steps | seed's val ppl | steps | val ppl exp(mean NLL) | val ppl mean exp(batch loss), the "
             "seed's measure | wall time | seed's time (37 min, prorated) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for (steps, ppl), ours in zip(SEED, targets(epoch)):
        row, seed_time = at.get(ours), clock(SEED_MINUTES * 60 * steps / SEED[-1][0])
        if row is None:
            lines.append(f"| {steps:,} | {ppl} | {ours:,} | not reached | | | {seed_time} |")
            continue
        wall = clock(seconds_at[ours]) if ours in seconds_at else ""
        lines.append(f"| {steps:,} | {ppl} | {ours:,} | {row['val_ppl']:.2f} | {row['val_ppl_batch_mean']:.2f} | "
                     f"{wall} | {seed_time} |")
    if final:
        lines.append(f"\nFinal evaluation at step {final['steps']:,}: val ppl {final['val_ppl']:.2f} (mean exp(batch "
                     f"loss) {final['val_ppl_batch_mean']:.2f}), test ppl {final.get('test_ppl') or math.nan:.2f}; "
                     f"training {final['train_seconds']:.0f} s, {final['train_tokens_per_s'] or 0:,.0f} tokens/s.")
    if note:
        lines.append(f"\n{note}")
    return "\n".join(lines) + "\n"


def callback(out: Path, epoch: int, seconds: float, log: Any = print) -> Any:
    """The Lightning callback that times the second epoch, decides where to stop, and rewrites the table."""
    import pytorch_lightning as pl

    class SeedPlan(pl.Callback):
        def __init__(self) -> None:
            self.stop_at: int | None = None
            self.train_start = 0.0
            self.validations: list[tuple[int, float, float]] = []  # (step, start, end)
            self.seconds_at: dict[int, float] = {}
            self.decision = ""  # what the second epoch's timing said fits, once it has

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.train_start = time.perf_counter()

        def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if not trainer.sanity_checking:
                self.validations.append((trainer.global_step, time.perf_counter(), math.nan))

        def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.sanity_checking or not self.validations:
                return
            step, begun, _ = self.validations[-1]
            now = time.perf_counter()
            self.validations[-1] = (step, begun, now)
            self.seconds_at[step] = now - self.train_start
            (out / "seed-table.md").write_text(table(pl_module.val_history, epoch, self.seconds_at,
                                                     note=self.decision))

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            step = trainer.global_step
            if self.stop_at is None and len(self.validations) >= 2 and not math.isnan(self.validations[1][2]):
                (s1, _, end1), (s2, begin2, end2) = self.validations[:2]
                step_s, validation_s = (begin2 - end1) / max(1, s2 - s1), end2 - begin2
                left = seconds - (time.perf_counter() - START)
                self.stop_at, fit = largest_fitting(step, targets(epoch), step_s, validation_s, epoch, left)
                total = trainer.max_steps
                more = (total - step) * (step_s + validation_s / epoch)
                self.decision = (
                    f"At step {step:,}: {step_s * 1000:.2f} ms a step, {validation_s:.1f} s a validation (epoch 2); "
                    f"{left:.0f} s left of {seconds:.0f}: {min(fit, total):,} of the {total:,} steps fit"
                    f"{'' if fit >= total else f' (all {total:,} would need {more:.0f} s more)'}; ran to "
                    f"{self.stop_at:,}.")
                log(f"seed table: {self.decision}", flush=True)
            if self.stop_at is not None and step >= self.stop_at:
                trainer.should_stop = True

    return SeedPlan()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="wt2-seed", help="the preset (default wt2-seed, the seed's run)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="after the seed's settings")
    parser.add_argument("--seconds", type=float, default=300.0, help="the whole command's time, from its start")
    parser.add_argument("--out", default="runs/gpu/seed", help="the table and the run's folder (run/)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)


    import pytorch_lightning as pl

    from parnas import architecture
    from parnas.config import load_config
    from parnas.data.corpora import load_splits
    from parnas.nn.model import build_fixed_model
    from parnas.threads import use_threads
    from parnas.training.fit import fit, fixed_layout

    out = Path(args.out)
    cfg = load_config(args.config, [*SETTINGS, f"train.out_dir={out / 'run'}", *args.set])
    out.mkdir(parents=True, exist_ok=True)
    use_threads(cfg.model.d_model, cfg.data.step_tokens, cfg.train.threads, cfg.train.devices)
    tokenizer, splits = load_splits(cfg.data)
    cfg, record = fixed_layout(cfg, tokenizer)
    pl.seed_everything(cfg.train.seed, verbose=False)
    model = build_fixed_model(cfg.model, tokenizer.vocab_size)
    epoch = cfg.train.eval_every
    print(f"seed table: {args.config} {architecture.layout_string(cfg.model.blocks)}, "
          f"{cfg.train.max_steps:,} steps scheduled, "
          f"validating every {epoch:,} (the seed's counts at {', '.join(f'{t:,}' for t in targets(epoch))}), "
          f"train.compile={cfg.train.compile}, {cfg.train.precision}, at most {args.seconds:.0f} s", flush=True)
    plan = callback(out, epoch, args.seconds)
    metrics = fit(cfg, model, tokenizer, splits, record, callbacks=[plan])
    text = table(metrics["history"], epoch, plan.seconds_at, metrics, plan.decision)
    (out / "seed-table.md").write_text(text)
    print(text + f"whole command {time.perf_counter() - START:.0f} s; the seed's {SEED_MINUTES:.0f} min for 56,500 "
          f"steps; table in {out / 'seed-table.md'}", flush=True)
    return 0


if __name__ == "__main__":
    import sys

    from parnas.errors import ParnasError

    try:
        raise SystemExit(main())
    except ParnasError as error:  # a setting or a corpus the run refuses: its one line
        print(f"seed_table.py: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
