"""One search run: the PAR space, the task, the strategy, and what they leave behind.

``run_search(cfg)`` is ``parnas search``. It drives :class:`PARGumbelDARTS` with
NNI's public pieces (``mutate_model``, ``mutate_evaluator``, the evaluator's
``evaluate``) rather than a ``NasExperiment``, which inside an nnictl trial
would register a second experiment (with no web UI) beside nnictl's.

The run directory (``search.out_dir``, or ``$NNI_OUTPUT_DIR`` inside a trial)
gets ``architecture.json`` (:mod:`parnas.architecture`'s format, written atomically),
``history.jsonl`` (step, tau, softmax(alpha) per block, val_ppl at
evaluations), ``tensorboard/`` and ``checkpoints/``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from nni.nas.evaluator.pytorch import Lightning, Trainer

from parnas import architecture
from parnas.architecture import layout_string
from parnas.config import Config
from parnas.data.corpora import load_splits
from parnas.data.tokenizer import Tokenizer
from parnas.errors import ParnasError
from parnas.files import (
    check_not_held,
    check_writable_dir,
    ensure_writable_dir,
    hold_run_dir,
    resume_source,
    write_json_atomic,
    write_text_atomic,
)
from parnas.report.plots import plot_run
from parnas.strategy_registry import PAR_GUMBEL_DARTS
from parnas.training import checkpoint
from parnas.training.devices import check_devices, training_device
from parnas.training.evaluation import evaluate
from parnas.training.fit import (
    SegmentData,
    build_trainer,
    check_segments,
    end_process_group,
    position_restored_by_task,
    tokenizer_meta,
)
from parnas.training.interrupt import finishing
from parnas.training.latency import LatencyTable, load_table_for, read_table, table_key, target_memories
from parnas.training.latency_cache import check_cache, describe, latency_table, unsteady
from parnas.training.memory import check_memory
from parnas.training.resume import check_resumable, load_to_resume, take_over
from parnas.training.task import LanguageModelTask
from search_spaces import PARTransformerXLSpace
from strategies.costs import CostModel, flops_model, latency_costs
from strategies.gumbel_darts import PARDartsModule, PARGumbelDARTS
from strategies.supernet_export import Evaluated, exported_nll, sample_layouts


def in_nni_trial() -> bool:
    return "NNI_PLATFORM" in os.environ and bool(os.environ.get("NNI_OUTPUT_DIR"))


def trial_parameters() -> dict[str, Any]:
    """The tuner's parameters for this trial (dotted keys such as ``search.tau_end``), or {}."""
    if not in_nni_trial():
        return {}
    import nni

    return dict(nni.get_next_parameter() or {})


def run_dir_of(cfg: Config) -> Path:
    """Where a search writes: ``$NNI_OUTPUT_DIR`` in an nnictl trial (each trial its own), else ``search.out_dir``."""
    return Path(os.environ["NNI_OUTPUT_DIR"]) if in_nni_trial() else Path(cfg.search.out_dir)


def check_search_dir(run_dir: Path, resume: bool | str | Path) -> Path | None:
    """The checkpoint to resume from (``last.ckpt``, or the one ``--resume=PATH`` names), if any; touches nothing.
    A fresh search refuses a directory holding one, and any search a directory another process holds."""
    check_not_held(run_dir)
    last, source = run_dir / "checkpoints" / "last.ckpt", resume_source(run_dir, resume)
    if source is not None:
        if not source.is_file():
            raise ParnasError(f"nothing to resume: {source} does not exist")
        return source
    if (run_dir / "architecture.json").exists() or last.exists():
        raise ParnasError(f"{run_dir} already holds a search: pass --resume to continue it, "
                          "or set search.out_dir to a new directory")
    if run_dir.exists() and not run_dir.is_dir():
        raise ParnasError(f"cannot write the search into {run_dir}: it is a file")
    return None


def prepare_run_dir(run_dir: Path, resumed_step: int | None, source: Path | None = None) -> None:
    """Once every check has passed: a fresh search (``resumed_step`` None) clears stale logs; a resumed one
    drops the history written after its checkpoint's step (about to be redone), and continues from a copy of
    its checkpoint in ``last.ckpt`` if it was another (``source``). Lines at that step were written before the
    checkpoint."""
    ensure_writable_dir(run_dir)
    if source is not None:
        take_over(source, run_dir / "checkpoints" / "last.ckpt")
    history = run_dir / "history.jsonl"
    if resumed_step is None:
        shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)
        history.unlink(missing_ok=True)
        return
    if history.is_file():
        kept = [line for line in history.read_text().splitlines()
                if line and json.loads(line)["step"] <= resumed_step]
        write_text_atomic(history, "".join(line + "\n" for line in kept))


PINNED_TABLE = "latency_table.json"  # in the run directory: the table a search started with


def cost_kinds(cfg: Config) -> list[str]:
    """The kinds a search prices: its candidates and Transformer-XL's (the reference)."""
    return sorted(set(cfg.search.candidates) | {"attention", "dense"})


def time_latency_table(cfg: Config, *, refresh: bool = False) -> LatencyTable:
    """``parnas latency``: the table a search with ``cfg`` would time on this machine (its cache's, unless
    ``refresh``), for ``search.latency_table`` on any machine. Checks the device and data first, as a search."""
    check_devices(cfg.train)
    tokenizer, _ = load_splits(cfg.data)
    cfg.model.check_vocab(tokenizer.vocab_size)
    return latency_table(cfg, tokenizer.vocab_size, cost_kinds(cfg), training_device(cfg.train), refresh=refresh)[0]


def check_latency_table(cfg: Config) -> list[str]:
    """``parnas latency --check``: how far this machine's cached table for ``cfg`` is from a timing taken now."""
    check_devices(cfg.train)
    tokenizer, _ = load_splits(cfg.data)
    cfg.model.check_vocab(tokenizer.vocab_size)
    return check_cache(cfg, tokenizer.vocab_size, cost_kinds(cfg), training_device(cfg.train))


def cost_model(cfg: Config, vocab_size: int, device: torch.device, pinned: Path | None = None,
               warn: Callable[[str], None] | None = None) -> tuple[CostModel, dict[str, Any] | None]:
    """Block costs for the candidates (and for Transformer-XL's kinds, the reference), with the latency
    table's record when costs are measured (``source``: which table, for :func:`table_line`). ``pinned``: a
    resumed search's own table, if it wrote one, so its costs do not change with tables timed since it started.
    ``search.latency_table``: a table timed elsewhere (the target device), checked against this run's shapes;
    nothing is timed then. ``warn``: where a table that could not be timed steadily is reported (stderr)."""
    kinds = cost_kinds(cfg)
    if cfg.search.penalty_cost == "flops":
        return flops_model(kinds, cfg.model, cfg.data.seg_len, cfg.data.batch_size), None
    given = cfg.search.latency_table
    if pinned is not None and pinned.is_file():
        table, cached, source = read_table(pinned), True, "the one this run started with"
    elif given is not None:
        key = table_key(cfg, vocab_size, sorted({*kinds, "identity"}), device)
        table, cached = load_table_for(given, key, target=cfg.search.latency_target), True
        source = f"given, {given}"
    else:
        table, cached = latency_table(cfg, vocab_size, kinds, device, **({"warn": warn} if warn else {}))
        source = "cached" if cached else "timed now, " + ("cached" if unsteady(table) is None else "not cached")
    return latency_costs(table, cfg.model.n_blocks, cfg.search.latency_target), {
        "table": table, "cached": cached, "path": given, "timed_here": given is None,
        "memory": target_memories(cfg), "source": source}


def table_line(latency: dict[str, Any]) -> str:
    """Which latency table prices the run (cached, given, timed now) and how steadily it was timed."""
    return f"latency table: {latency['source']}; {describe(latency['table'])}"


def latency_summary(costs: CostModel, latency: dict[str, Any] | None, kinds: list[str],
                    budget: float | None) -> dict[str, Any] | None:
    """The exported architecture's predicted latency against Transformer-XL's and the budget (architecture.json).

    ``device`` is the device the costs were timed on (a given table's, which need not be this machine's);
    ``table`` the file given as search.latency_table, if any."""
    if latency is None:
        return None
    table, target = latency["table"], costs.target or "train"
    ratio = costs.ratio(kinds)
    generate = {"generate_token_ms": round(table.predict(kinds, "generate"), 3)} if "generate" in table.modes else {}
    return {"unit": "ms", "device": table.key["device"], "precision": table.key.get("precision"),
            "table": latency.get("path"), "timed_here": latency.get("timed_here"), "target": target,
            "target_ms": round(table.predict(kinds, target), 3),
            "train_step_ms": round(table.predict(kinds), 3),
            "inference_step_ms": round(table.predict(kinds, "inference"), 3), **generate,
            "transformer_xl_ms": round(table.transformer_xl_ms(len(kinds), target), 3), "ratio": round(ratio, 4),
            "budget": budget, "within_budget": None if budget is None else ratio <= budget + 1e-9,
            "constant_ms": table.constant_ms, "block_ms": table.kinds_ms, "memory": latency.get("memory")}


def check_budget(cfg: Config, costs: CostModel) -> None:
    """A budget below the cheapest layout of the candidates cannot be met: say so before training."""
    budget = cfg.search.latency_budget
    if budget is None:
        return
    cheapest = min(cfg.search.candidates, key=costs.per_kind.__getitem__)
    floor = costs.ratio([cheapest] * cfg.model.n_blocks)
    if floor > budget:
        raise ParnasError(f"search.latency_budget {budget} is out of reach: the cheapest architecture "
                          f"(all {cheapest}) is predicted at {floor:.3f} of Transformer-XL's step time here "
                          "(embedding, head and optimiser cost the same in every layout); raise the budget")


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
    """Space, task, data, traced trainer and strategy, wired the way NNI's one-shot search expects.

    ``meta`` (config, space, tokenizer) goes into every checkpoint, as for a fixed model. ``costs``: a cost
    model to search with instead of the device's latency table (nothing is timed; the budget is checked
    against it), for studying the search itself under known costs.
    """
    if cfg.train.accumulate != 1:
        raise ParnasError("search does not support train.accumulate > 1 (one-shot search optimises manually)")
    space = PARTransformerXLSpace(cfg.model, vocab_size, cfg.search.candidates)
    task = LanguageModelTask(cfg.train, meta)
    data = SegmentData(splits, cfg.data.batch_size, cfg.data.eval_batch_size, cfg.data.seg_len, task=task)
    trainer = build_trainer(cfg.train, run_dir, trainer_cls=Trainer, gradient_clip_val=None,
                            log_every_n_steps=cfg.search.log_every)
    latency = None
    if costs is None:
        costs, latency = cost_model(cfg, vocab_size, trainer.strategy.root_device,
                                    pinned=run_dir / PINNED_TABLE if ckpt else None,
                                    warn=None if trainer.is_global_zero else lambda line: None)
    check_budget(cfg, costs)
    strategy = PARGumbelDARTS(cfg.search, max_steps=cfg.train.max_steps, gradient_clip_val=cfg.train.clip or None,
                              costs=costs, history_path=run_dir / "history.jsonl", on_evaluation=on_evaluation)
    supernet = strategy.mutate_model(space)
    evaluator = strategy.mutate_evaluator(Lightning(task, trainer, datamodule=data,
                                                    fit_kwargs={"ckpt_path": str(ckpt) if ckpt else None}))
    return SupernetSearch(supernet, strategy, evaluator, data, costs, latency)


def final_evaluation(search: SupernetSearch) -> Evaluated:
    """The last evaluation if it was taken at the final step, else one now (rank 0, whole validation split),
    whose line ends history.jsonl: a search shorter than its log and evaluation intervals has a history too."""
    module, step = search.module, search.trainer.global_step
    if module.last_evaluation is not None and module.last_evaluation.step == step:
        return module.last_evaluation
    search.supernet.to(search.trainer.strategy.root_device)  # Lightning's teardown moved it to the CPU
    supernet = evaluate(search.supernet, search.data.batches("valid")).ppl
    kinds, fitted = module.exported_kinds()
    sums = exported_nll(search.supernet, module.choices(), kinds, search.data.batches("valid"))
    result = module.evaluated(kinds, fitted, math.exp(float(sums[0] / sums[1])), supernet)
    module.append_history(result.history_line())
    return result


def best_of_samples(search: SupernetSearch, result: Evaluated, cfg: Config) -> tuple[Evaluated, list[dict[str, Any]]]:
    """``search.export_samples`` layouts drawn from softmax(alpha) beside the exported one (``result``), those over
    the budget dropped, each scored like it (whole validation split, the supernet's weights): the best of them
    all, and what was tried. Drawn with ``train.seed``: the same search samples the same layouts."""
    module, budget = search.module, cfg.search.latency_budget
    search.supernet.to(search.trainer.strategy.root_device)  # Lightning's teardown moved it to the CPU
    layouts = sample_layouts(list(result.probabilities.values()), cfg.search.export_samples, cfg.train.seed,
                             exclude=[result.kinds])
    if budget is not None and module.costs is not None:
        layouts = [k for k in layouts if module.costs.ratio(k) <= budget + 1e-9]
    best, tried = result, [{"architecture": result.architecture, "val_ppl": round(result.val_ppl, 4),
                            "cost_ratio": result.cost_ratio, "drawn": False}]
    for kinds in layouts:
        sums = exported_nll(search.supernet, module.choices(), kinds, search.data.batches("valid"))
        scored = module.evaluated(kinds, False, math.exp(float(sums[0] / sums[1])), result.supernet_val_ppl)
        tried.append({"architecture": scored.architecture, "val_ppl": round(scored.val_ppl, 4),
                      "cost_ratio": scored.cost_ratio, "drawn": True})
        best = scored if scored.val_ppl < best.val_ppl else best
    if best is not result:
        module.append_history(best.history_line())  # the history ends with what is exported
    return best, tried


def nni_metric(result: Evaluated, latency: dict[str, Any] | None) -> dict[str, Any]:
    """What NNI's web UI shows for a trial, at every evaluation and at the end: ``default`` is the exported
    architecture's own perplexity; beside it that architecture (one letter per block) and its predicted
    train step relative to Transformer-XL's (the cost ratio under ``search.penalty_cost=flops``).
    The web UI lists a dict's keys in this order (its trials table's optional columns, and the charts' choices),
    and shows the numbers as they are: rounded here as in architecture.json."""
    ratio = latency["ratio"] if latency else result.cost_ratio
    return {"default": round(result.val_ppl, 4), "architecture": result.architecture,
            "latency_ratio": None if ratio is None else round(ratio, 4),
            "supernet_val_ppl": round(result.supernet_val_ppl, 4), "attention_blocks": result.kinds.count("attention"),
            "predicted_step_ms": latency["target_ms"] if latency else None,
            "latency_target": latency["target"] if latency else None,
            "latency_device": latency["device"] if latency else None}


def run_search(cfg: Config, *, resume: bool | str | Path = False) -> dict[str, Any]:
    """Search, export the argmax architecture, and return its record (empty on non-zero ranks).

    The search holds its run directory (:func:`parnas.files.hold_run_dir`), and everything is checked (run
    directory, checkpoint, corpus, tokenizer) before a file is touched. ``resume``: from ``last.ckpt``, or from
    the checkpoint it names. The registry's ``par-gumbel-darts``: ``parnas search`` runs another
    ``search.strategy`` with that strategy's own ``run`` (:mod:`parnas.strategy_registry`)."""
    with hold_run_dir(run_dir_of(cfg)):
        return _run_search(cfg, resume)


def _run_search(cfg: Config, resume: bool | str | Path) -> dict[str, Any]:
    if cfg.search.strategy != PAR_GUMBEL_DARTS:
        raise ParnasError(f"run_search runs {PAR_GUMBEL_DARTS}, not search.strategy={cfg.search.strategy}")
    check_devices(cfg.train)
    if cfg.model.reversible:
        raise ParnasError("model.reversible runs a fixed model's blocks in pairs; a search's supernet runs eager: "
                          "leave model.reversible=false for search and set it for retrain")
    if cfg.train.compile != "none":
        raise ParnasError(f"train.compile={cfg.train.compile} compiles the fixed model of train and retrain; a "
                          "search's supernet runs eager: leave train.compile=none for search")
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
            import nni

            latency = latency_summary(search.costs, search.latency, result.kinds, cfg.search.latency_budget)
            nni.report_intermediate_result(nni_metric(result, latency))

    meta = {"config": cfg.to_dict(), "tokenizer": tokenizer_meta(tokenizer),
            "architecture": {"space": "PARTransformerXLSpace", "candidates": list(cfg.search.candidates)}}
    search = build_search(cfg, splits, tokenizer.vocab_size, run_dir, ckpt=ckpt, on_evaluation=report, meta=meta)
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
    """After the last step: the final evaluation, the best of the sampled layouts, ``architecture.json``, the
    plots, and NNI's final result; returns the record."""
    result = final_evaluation(search)
    result, sampled = best_of_samples(search, result, cfg) if cfg.search.export_samples else (result, None)
    module, steps, costs, kinds = search.module, search.trainer.global_step, search.costs, result.kinds
    chosen = {architecture.label(i): kind for i, kind in enumerate(kinds)}
    latency = latency_summary(costs, search.latency, kinds, cfg.search.latency_budget)
    probabilities = {label: {k: round(p, 4) for k, p in dist.items()} for label, dist in result.probabilities.items()}
    record = architecture.make_record(
        chosen, cfg.model, tokenizer.vocab_size, probabilities=probabilities,
        tokenizer=tokenizer.identity(),
        search={"strategy": PAR_GUMBEL_DARTS, "mode": cfg.search.mode, "steps": steps, "tau_final": module.tau,
                "val_ppl": round(result.val_ppl, 4), "supernet_val_ppl": round(result.supernet_val_ppl, 4),
                "discretisation_gap": round(result.val_ppl - result.supernet_val_ppl, 4),
                "val_ppl_is": "the exported architecture with the supernet's weights, not retrained",
                "val_mem_len": cfg.model.evaluation_memory, "seed": cfg.train.seed,
                "candidates": list(cfg.search.candidates),
                "penalty_weight": cfg.search.penalty_weight, "latency_budget": cfg.search.latency_budget,
                "budget_hinge": cfg.search.budget_hinge if cfg.search.latency_budget is not None else None,
                "lambda_final": None if cfg.search.latency_budget is None else
                cfg.search.penalty_weight if module.fixed_lambda else round(module.dual, 6),
                "fitted_to_budget": result.fitted_to_budget,
                "argmax": layout_string(module.argmax()), "sampled": sampled,
                "latency": latency,
                "block_costs": {k: round(v, 4) for k, v in costs.per_kind.items()}, "cost_unit": costs.unit,
                "architecture_cost": round(costs.total(kinds), 4),
                "cost_ratio": round(costs.ratio(kinds), 4),
                "expected_cost": round(float(module.expected_ratio().detach()) * costs.reference, 4),
                "hard": cfg.search.hard, "forward": cfg.search.forward, "arch_lr": cfg.search.arch_lr,
                "seconds": round(seconds, 1),
                "step_seconds": round(seconds / max(1, steps), 4),
                "nni_trial": os.environ.get("NNI_TRIAL_JOB_ID") if trial else None})
    architecture.write(run_dir / "architecture.json", record)
    plot_run(run_dir)
    if trial:
        import nni

        nni.report_final_result(nni_metric(result, latency))
    return record


def inherited_perplexities(run_dir: Path, cfg: Config, layouts: Sequence[Sequence[str]]) -> dict[str, float]:
    """Validation perplexity of each layout with the weights a finished search's supernet left (each block fixed
    to the layout's kind, no retraining), keyed by layout string: what the search believed of each layout,
    which a study ranks against the retrained perplexities. Layouts must have the supernet's ``n_blocks``."""
    saved = checkpoint.load(run_dir / "checkpoints" / "last.ckpt")
    tokenizer, splits = load_splits(cfg.data)
    free = CostModel(dict.fromkeys(cost_kinds(cfg), 1.0), 1.0, "unit", cfg.model.n_blocks)  # nothing is timed
    unpriced = replace(cfg.search, latency_budget=None, penalty_weight=0.0, budget_hinge="exported")  # no budget
    search = build_search(replace(cfg, search=unpriced),
                          splits, tokenizer.vocab_size, run_dir, costs=free)
    search.module.set_model(search.supernet)
    search.module.load_state_dict(saved["state_dict"])
    device = training_device(cfg.train)
    search.supernet.to(device)
    out = {}
    for kinds in layouts:
        sums = exported_nll(search.supernet, search.module.choices(), list(kinds), search.data.batches("valid"))
        out[layout_string(kinds)] = math.exp(float(sums[0] / sums[1]))
    return out
