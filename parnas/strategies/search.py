"""One search run: the PAR space, the task, the strategy, and what they leave behind.

``run_search(cfg)`` is ``parnas search``. It drives :class:`PARGumbelDARTS` with NNI's public pieces (``mutate_model``,
``mutate_evaluator``, the evaluator's ``evaluate``) rather than a ``NasExperiment``, which inside an nnictl trial
would register a second experiment (with no web UI) beside nnictl's. The run directory gets ``architecture.json``,
``history.jsonl``, ``tensorboard/`` and ``checkpoints/``. A search whose final evaluation diverged
(:func:`search_divergence`) exports nothing: it ends with the line a diverged training run ends with, its folder left
as training left it, for ``--resume`` to take up.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
from nni.nas.evaluator.pytorch import Lightning, Trainer

from parnas import architecture, strategy_registry
from parnas.architecture import layout_string
from parnas.config import Config
from parnas.data.corpora import load_splits
from parnas.data.tokenizer import Tokenizer
from parnas.errors import ParnasError
from parnas.files import check_writable_dir, write_json_atomic
from parnas.owned_folders import hold_run_dir
from parnas.report.plots import plot_run
from parnas.search_spaces import PARTransformerXLSpace
from parnas.strategies.costs import CostModel
from parnas.strategies.final_pick import check_selection, final_pick
from parnas.strategies.gumbel_darts import PARDartsModule, PARGumbelDARTS
from parnas.strategies.nni_trial import in_nni_trial, nni_metric, report_to_nni
from parnas.strategies.par_settings import par_settings
from parnas.strategies.pricing import PINNED_TABLE, check_budget, cost_kinds, cost_model, latency_summary, table_line
from parnas.strategies.search_folder import check_search_dir, prepare_run_dir, run_dir_of
from parnas.strategies.search_record import search_record
from parnas.strategies.supernet_export import Evaluated, exported_nll
from parnas.training import checkpoint
from parnas.training.compiling import compile_model
from parnas.training.data_module import SegmentData, check_segments
from parnas.training.devices import check_devices, training_device
from parnas.training.evaluation import divergence, evaluate, perplexity
from parnas.training.fit import tokenizer_meta
from parnas.training.interrupt import finishing
from parnas.training.memory import check_memory
from parnas.training.resume import check_resumable, load_to_resume
from parnas.training.task import LanguageModelTask
from parnas.training.trainer import build_trainer, end_process_group, position_restored_by_task


@dataclass
class SupernetSearch:
    """The assembled pieces of one search; ``run()`` trains the supernet."""

    supernet: PARTransformerXLSpace
    strategy: PARGumbelDARTS
    evaluator: Lightning
    data: SegmentData
    costs: CostModel
    latency: dict[str, Any] | None

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
                 ckpt: Path | None = None, on_evaluation: Callable[[Evaluated], None] | None = None,
                 meta: dict[str, Any] | None = None, costs: CostModel | None = None) -> SupernetSearch:
    """Space, task, data, traced trainer and strategy, wired the way NNI's one-shot search expects. ``meta`` goes
    into every checkpoint; ``costs``: a cost model to search with instead of the device's latency table (nothing is
    timed). PAR's settings are read here, once, and passed down as they are."""
    supernet_of = strategy_registry.get(cfg.search.strategy).supernet_factory()  # the registry's flag
    if supernet_of is None:
        raise ParnasError(f"search.strategy={cfg.search.strategy} has no supernet for parnas's one-shot search: "
                          "run it with its own code (parnas search --strategy)")
    space = PARTransformerXLSpace(cfg.model, vocab_size, cfg.search.candidates)
    lr_setting, lr = cfg.search.weights_lr(cfg.train)
    task = LanguageModelTask(replace(cfg.train, lr=lr), meta, lr_setting)
    data = SegmentData(splits, cfg.data.batch_size, cfg.data.eval_batch_size, cfg.data.seg_len, task=task)
    trainer = build_trainer(cfg.train, run_dir, trainer_cls=Trainer, gradient_clip_val=None,
                            log_every_n_steps=cfg.search.log_every)
    latency = None
    if costs is None:
        costs, latency = cost_model(cfg, vocab_size, trainer.strategy.root_device,
                                    pinned=run_dir / PINNED_TABLE if ckpt else None,
                                    warn=None if trainer.is_global_zero else lambda line: None)
    check_budget(cfg, costs)
    strategy = supernet_of(cfg.search, cfg.search.settings, max_steps=cfg.train.max_steps,
                           gradient_clip_val=cfg.train.clip or None,
                           costs=costs, history_path=run_dir / "history.jsonl", on_evaluation=on_evaluation)
    supernet = strategy.mutate_model(space)
    compile_model(supernet, cfg.train.compile)  # a fair step stacked or a gumbel one: one static graph a step
    evaluator = strategy.mutate_evaluator(Lightning(task, trainer, datamodule=data,
                                                    fit_kwargs={"ckpt_path": str(ckpt) if ckpt else None}))
    return SupernetSearch(supernet, strategy, evaluator, data, costs, latency)


def final_evaluation(search: SupernetSearch) -> Evaluated:
    """The last evaluation if it was taken at the final step on the whole validation split, else one now (rank 0,
    whole validation split), whose line ends history.jsonl: a search shorter than its log and evaluation intervals,
    or stopped (``train.stop_at``) at a mid-search evaluation, which read a part of the split, has one too."""
    module, step = search.module, search.trainer.global_step
    last = module.last_evaluation
    if last is not None and last.step == step and last.valid_fraction >= 1:  # a mid-search one read a part
        return last
    search.supernet.to(search.trainer.strategy.root_device)  # Lightning's teardown moved it to the CPU
    supernet = evaluate(search.supernet, search.data.batches("valid")).ppl
    kinds, fitted = module.exported_kinds()
    sums = exported_nll(search.supernet, module.choices(), kinds, search.data.batches("valid"))
    result = module.evaluated(kinds, fitted, perplexity(float(sums[0] / sums[1])), supernet)
    module.append_history(result.history_line())
    return result


def run_search(cfg: Config, *, resume: bool | str | Path = False) -> dict[str, Any]:
    """Search, export the argmax architecture, and return its record (empty on non-zero ranks). The search holds its
    run directory, and everything is checked before a file is touched (what the strategy refuses, its callers refuse
    first, at their top). ``resume``: from ``last.ckpt``, or from the checkpoint it names."""
    with hold_run_dir(run_dir_of(cfg)):
        return _run_search(cfg, resume)


def _run_search(cfg: Config, resume: bool | str | Path) -> dict[str, Any]:
    check_devices(cfg.train)
    trial, run_dir = in_nni_trial(), run_dir_of(cfg)
    check_writable_dir(run_dir)
    source = check_search_dir(run_dir, resume)
    # read once: a truncated or edited file is refused here, before anything is touched
    saved = load_to_resume(source) if source is not None else None
    pl.seed_everything(cfg.train.seed, verbose=False)
    tokenizer, splits = load_splits(cfg.data)
    cfg.model.check_vocab(tokenizer.vocab_size)
    if saved is not None:  # the same search: the settings, the tokenizer and the space it was started with
        check_resumable(saved, cfg, None, tokenizer, str(source))
    ckpt = run_dir / "checkpoints" / "last.ckpt" if source is not None else None  # the source, copied there
    check_segments(cfg, splits)  # a segment longer than a split fails here, before tensorboard/ exists
    check_memory(cfg, tokenizer.vocab_size, [cfg.search.candidates] * cfg.model.n_blocks)  # a supernet runs them all

    def report(result: Evaluated) -> None:
        if trial:  # evaluations happen inside search.run(), so `search` (bound below) exists by then
            latency = latency_summary(search.costs, search.latency, result.kinds, search.module.par.latency_budget)
            report_to_nni(nni_metric(result, latency))

    meta = {"config": cfg.to_dict(), "tokenizer": tokenizer_meta(tokenizer),
            "architecture": {"space": "PARTransformerXLSpace", "candidates": list(cfg.search.candidates)}}
    search = build_search(cfg, splits, tokenizer.vocab_size, run_dir, ckpt=ckpt, on_evaluation=report, meta=meta)
    check_selection(cfg, search.costs)
    # everything checked (latency budget included): now files may be touched
    prepare_run_dir(run_dir, saved["global_step"] if saved else None, source)
    if search.latency and search.trainer.is_global_zero:
        print(table_line(search.latency), flush=True)
        write_json_atomic(run_dir / PINNED_TABLE, search.latency["table"].to_dict())
    seconds = search.run()
    end_process_group()
    if not search.trainer.is_global_zero:
        return {}
    with finishing(search.trainer, "the export"):
        return export(search, cfg, tokenizer, seconds, trial, run_dir)


def export(search: SupernetSearch, cfg: Config, tokenizer: Tokenizer, seconds: float, trial: bool,
           run_dir: Path) -> dict[str, Any]:
    """After the last step: the final evaluation, the final pick, ``architecture.json``, the plots, and NNI's
    final result; returns the record."""
    result = final_evaluation(search)
    lr_setting, lr = cfg.search.weights_lr(cfg.train)
    failure = search_divergence(result, tokenizer.vocab_size, search.trainer.global_step, lr, lr_setting)
    if failure is not None:
        raise failure
    result, selection = final_pick(search, cfg, tokenizer, result, run_dir)  # short retrains, the guard
    latency = latency_summary(search.costs, search.latency, result.kinds, search.module.par.latency_budget)
    record = search_record(cfg, tokenizer, search.module, result, steps=search.trainer.global_step, seconds=seconds,
                           latency=latency, selection=selection)
    architecture.write(run_dir / "architecture.json", record)
    plot_run(run_dir)
    if trial:
        report_to_nni(nni_metric(result, latency, selection), final=True)
    return record


def search_divergence(result: Evaluated, vocab_size: int, step: int, lr: float,
                      lr_setting: str = "train.lr") -> ParnasError | None:
    """The line a search ends with, exporting nothing, when its final evaluation diverged: the validation loss of
    the supernet or of its exported architecture not finite or worse than guessing
    (:func:`parnas.training.evaluation.diverged`); None when neither did. An architecture picked by such weights
    says nothing about the architectures."""
    for ppl, whose in ((result.supernet_val_ppl, "the supernet's"), (result.val_ppl, "the exported architecture's")):
        finite = math.isfinite(ppl) and ppl > 0  # inf: exp of its loss overflowed
        loss, what = (math.log(ppl), "validation loss") if finite else (None, "validation perplexity")
        failure = divergence(loss, vocab_size, step, lr, f"{whose} {what}", lr_setting=lr_setting)
        if failure is not None:
            return failure
    return None


def inherited_perplexities(run_dir: Path, cfg: Config, layouts: Sequence[Sequence[str]],
                           progress: Callable[[int], None] | None = None, fraction: float = 1.0) -> dict[str, float]:
    """Validation perplexity of each layout (of the supernet's ``n_blocks``) with the weights a finished search's
    supernet left, keyed by layout string: what the search believed of each layout. ``progress(k)`` follows the k-th
    layout; ``fraction``: the share of the validation split read, its first segments (at least one)."""
    saved = checkpoint.load(run_dir / "checkpoints" / "last.ckpt")
    tokenizer, splits = load_splits(cfg.data)
    free = CostModel(dict.fromkeys(cost_kinds(cfg), 1.0), 1.0, "unit", cfg.model.n_blocks)  # nothing is timed
    free_par = replace(par_settings(cfg.search), latency_budget=None, penalty_weight=0.0)  # no budget
    unpriced = replace(cfg.search, strategy_settings={**cfg.search.strategy_settings, cfg.search.strategy: free_par})
    search = build_search(replace(cfg, search=unpriced), splits, tokenizer.vocab_size, run_dir, costs=free)
    search.module.set_model(search.supernet)
    search.module.load_state_dict(saved["state_dict"])
    device = training_device(cfg.train)
    search.supernet.to(device)
    valid = search.data.batches("valid")
    segments = max(1, math.ceil(len(valid) * fraction))
    out = {}
    for kinds in layouts:
        sums = exported_nll(search.supernet, search.module.choices(), list(kinds), (valid[t] for t in range(segments)))
        out[layout_string(kinds)] = perplexity(float(sums[0] / sums[1]))
        if progress is not None:
            progress(len(out))
    return out
