"""One search run: the PAR space, the task, the strategy, and what they leave behind.

``run_search(cfg)`` is ``parnas search``. It drives :class:`PARGumbelDARTS` with
NNI's public pieces (``mutate_model``, ``mutate_evaluator``, the evaluator's
``evaluate``) rather than a ``NasExperiment``, which inside an nnictl trial
would register a second experiment (NNI_NOTES.md, trap 11).

The run directory (``search.out_dir``, or ``$NNI_OUTPUT_DIR`` inside a trial)
gets ``architecture.json`` (DESIGN.md format, written atomically),
``history.jsonl`` (step, tau, softmax(alpha) per block, val_ppl at
evaluations), ``tensorboard/`` and ``checkpoints/``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from nni.nas.evaluator.pytorch import Lightning, Trainer

from parnas import architecture, checkpoint
from parnas.config import Config
from parnas.data import load_splits
from parnas.errors import ParnasError
from parnas.plots import plot_run
from parnas.task import LanguageModelTask, evaluate
from parnas.train import SegmentData, build_trainer, position_restored_by_task, tokenizer_meta
from search_spaces import PARTransformerXLSpace
from strategies.costs import flops_costs, measured_costs
from strategies.gumbel_darts import PARDartsModule, PARGumbelDARTS


def in_nni_trial() -> bool:
    return "NNI_PLATFORM" in os.environ and bool(os.environ.get("NNI_OUTPUT_DIR"))


def trial_parameters() -> dict[str, Any]:
    """The tuner's parameters for this trial (dotted keys such as ``search.tau_end``), or {}."""
    if not in_nni_trial():
        return {}
    import nni

    return dict(nni.get_next_parameter() or {})


def prepare_run_dir(run_dir: Path, resume: bool) -> Path | None:
    """The checkpoint to resume from, if any. A fresh search refuses a directory that holds one."""
    last = run_dir / "checkpoints" / "last.ckpt"
    if resume:
        if not last.is_file():
            raise ParnasError(f"nothing to resume: {last} does not exist")
        step = checkpoint.load(last)["global_step"]
        history = run_dir / "history.jsonl"
        if history.is_file():  # drop what was logged after the checkpoint; it is about to be redone
            kept = [line for line in history.read_text().splitlines() if json.loads(line)["step"] < step]
            history.write_text("".join(line + "\n" for line in kept))
        return last
    if (run_dir / "architecture.json").exists() or last.exists():
        raise ParnasError(f"{run_dir} already holds a search: pass --resume to continue it, "
                          "or set search.out_dir to a new directory")
    shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)
    (run_dir / "history.jsonl").unlink(missing_ok=True)
    return None


def block_costs(cfg: Config, device: torch.device) -> tuple[dict[str, float], str]:
    kinds, B, L = cfg.search.candidates, cfg.data.batch_size, cfg.data.seg_len
    if cfg.search.penalty_cost == "measured":
        return measured_costs(kinds, cfg.model, L, B, device), "ms/step"
    return flops_costs(kinds, cfg.model, L, B), "MFLOP/token"


@dataclass
class Search:
    """The assembled pieces of one search; ``run()`` trains the supernet."""

    supernet: PARTransformerXLSpace
    strategy: PARGumbelDARTS
    evaluator: Lightning
    data: SegmentData
    costs: dict[str, float]
    cost_unit: str

    @property
    def module(self) -> PARDartsModule:
        return self.evaluator.module

    @property
    def trainer(self) -> pl.Trainer:
        return self.evaluator.trainer

    def run(self) -> float:
        """Train; returns the wall-clock seconds."""
        start = time.perf_counter()
        with position_restored_by_task():
            self.evaluator.evaluate(self.supernet)
        return time.perf_counter() - start


def build_search(cfg: Config, splits: dict[str, np.ndarray], vocab_size: int, run_dir: Path, *,
                 ckpt: Path | None = None, on_evaluation: Callable[[int, float], None] | None = None,
                 meta: dict[str, Any] | None = None) -> Search:
    """Space, task, data, traced trainer and strategy, wired the way NNI's one-shot search expects.

    ``meta`` (config, space, tokenizer) goes into every checkpoint, as for a fixed model.
    """
    if cfg.train.accumulate != 1:
        raise ParnasError("search does not support train.accumulate > 1 (one-shot search optimises manually)")
    space = PARTransformerXLSpace(cfg.model, vocab_size, cfg.search.candidates)
    task = LanguageModelTask(cfg.train, meta)
    data = SegmentData(splits, cfg.data.batch_size, cfg.data.eval_batch_size, cfg.data.seg_len)
    trainer = build_trainer(cfg.train, run_dir, trainer_cls=Trainer, gradient_clip_val=None)
    costs, cost_unit = block_costs(cfg, trainer.strategy.root_device)
    strategy = PARGumbelDARTS(cfg.search, max_steps=cfg.train.max_steps, gradient_clip_val=cfg.train.clip or None,
                              block_costs=costs, history_path=run_dir / "history.jsonl", on_evaluation=on_evaluation)
    supernet = strategy.mutate_model(space)
    evaluator = strategy.mutate_evaluator(Lightning(task, trainer, datamodule=data,
                                                    fit_kwargs={"ckpt_path": str(ckpt) if ckpt else None}))
    return Search(supernet, strategy, evaluator, data, costs, cost_unit)


def run_search(cfg: Config, *, resume: bool = False) -> dict[str, Any]:
    """Search, export the argmax architecture, and return its record (empty on non-zero ranks)."""
    trial = in_nni_trial()
    run_dir = Path(os.environ["NNI_OUTPUT_DIR"]) if trial else Path(cfg.search.out_dir)
    ckpt = prepare_run_dir(run_dir, resume)
    run_dir.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(cfg.train.seed, verbose=False)
    tokenizer, splits = load_splits(cfg.data)

    def report(step: int, val_ppl: float) -> None:
        if trial:
            import nni

            nni.report_intermediate_result(val_ppl)

    meta = {"config": cfg.to_dict(), "tokenizer": tokenizer_meta(tokenizer),
            "architecture": {"space": "PARTransformerXLSpace", "candidates": list(cfg.search.candidates)}}
    search = build_search(cfg, splits, tokenizer.vocab_size, run_dir, ckpt=ckpt, on_evaluation=report, meta=meta)
    seconds = search.run()
    if not search.trainer.is_global_zero:
        return {}

    final = evaluate(search.supernet, search.data.batches("valid"), search.trainer.strategy.root_device)
    chosen, steps, costs = search.module.export(), search.trainer.global_step, search.costs
    probabilities = {label: {k: round(p, 4) for k, p in dist.items()}
                     for label, dist in search.module.probabilities().items()}
    record = architecture.make_record(
        chosen, cfg.model, tokenizer.vocab_size, probabilities=probabilities,
        tokenizer=tokenizer.identity(),
        search={"strategy": "gumbel-darts", "mode": cfg.search.mode, "steps": steps, "tau_final": search.module.tau,
                "val_ppl": round(final.ppl, 4), "seed": cfg.train.seed, "candidates": list(cfg.search.candidates),
                "penalty_weight": cfg.search.penalty_weight, "block_costs": costs, "cost_unit": search.cost_unit,
                "architecture_cost": sum(costs[k] for k in chosen.values()),
                "expected_cost": round(float(search.module.expected_cost().detach()), 4),
                "hard": cfg.search.hard, "arch_lr": cfg.search.arch_lr, "seconds": round(seconds, 1),
                "step_seconds": round(seconds / max(1, steps), 4),
                "nni_trial": os.environ.get("NNI_TRIAL_JOB_ID") if trial else None})
    architecture.write(run_dir / "architecture.json", record)
    plot_run(run_dir)
    if trial:
        import nni

        nni.report_final_result({"default": final.ppl, "attention_blocks": list(chosen.values()).count("attention"),
                                 "architecture_cost": record["search"]["architecture_cost"]})
    return record
