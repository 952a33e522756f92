"""NNI 3.0's one-shot strategies on the PAR space, behind ``parnas search --strategy NAME`` (the list:
:data:`parnas.strategies.nni_specs.NNI_STRATEGIES`): run on the same space, task and data through ``NasExperiment`` as
an NNI user would, they give the baselines a study needs to tell what PAR's own strategy buys.

Every strategy ends alike: ``architecture.json`` (the exported layout, its perplexity with the supernet's weights,
the supernet's own, its predicted cost), TensorBoard's scalars and, for those that learn logits, ``history.jsonl``
and its pictures (:class:`LogitsHistory`). The exported fixed model takes the supernet's weights by dropping the
candidate's name from NNI's mixed layer's keys (:func:`fixed_weights`), whatever the strategy.
"""

from __future__ import annotations

import atexit
import math
import os
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from parnas.config import Config
from parnas.strategies.nni_specs import nni_strategy
from parnas.strategies.nni_trial import in_nni_trial


def nni_strategy_object(cfg: Config) -> Any:
    """NNI's strategy object for ``search.strategy`` (:data:`parnas.strategies.nni_specs.NNI_STRATEGIES`): its fixed
    arguments, and the run's architecture learning rate, clipping and logging where it learns logits."""
    from nni.nas import strategy as nni_strategies

    spec = nni_strategy(cfg.search.strategy)
    arguments = dict(spec.arguments)
    if spec.logits:
        arguments |= {"arc_learning_rate": cfg.search.arch_lr, "gradient_clip_val": cfg.train.clip or None,
                      "log_prob_every_n_step": cfg.search.log_every}
    return getattr(nni_strategies, spec.nni_class)(**arguments)


class LogitsHistory:
    """A Lightning callback writing ``history.jsonl`` as PAR's search does, for NNI's strategies that learn logits:
    every ``every`` optimiser steps and at the end, each block's softmax(alpha) and tau (1 for a plain softmax)."""

    def __init__(self, path: Path, every: int) -> None:
        import pytorch_lightning as pl

        self.path, self.every, self.last = path, every, -1
        self.callback = type("LogitsHistoryCallback", (pl.Callback,), {
            "on_train_batch_end": lambda _, trainer, module, *args: self._write(trainer, module, False),
            "on_train_end": lambda _, trainer, module: self._write(trainer, module, True)})()

    def _write(self, trainer: Any, module: Any, last: bool) -> None:
        """A line every ``every`` steps, and one when training ends (the logits the export reads)."""
        import json

        step = trainer.global_step
        if step == self.last or (step % self.every and not last) or not trainer.is_global_zero:
            return
        self.last = step
        layers = sorted((m for m in module.modules() if hasattr(m, "_arch_alpha") and hasattr(m, "names")),
                        key=lambda m: int(str(m.label).rsplit("_", 1)[1]))
        if not layers:
            return
        probs = {str(m.label): dict(zip(m.names, m._arch_alpha.detach().softmax(-1).tolist())) for m in layers}
        scheduler = getattr(module, "temperature_scheduler", None)
        tau = float(getattr(scheduler, "current", None) or getattr(scheduler, "init", None) or 1.0)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "tau": tau, "probabilities": probs}) + "\n")


def fixed_weights(supernet_state: Mapping[str, Any], architecture: Mapping[str, str]) -> dict[str, Any]:
    """The fixed model's state dict out of a one-shot supernet's: block i's chosen candidate, named
    ``blocks.i.<kind>.`` in NNI's mixed layer, becomes ``blocks.i.``; other candidates and the logits are dropped."""
    chosen = {f"blocks.{label.rsplit('_', 1)[1]}.": kind for label, kind in architecture.items()}
    out = {}
    for key, value in supernet_state.items():
        block = next((b for b in chosen if key.startswith(b)), None)
        if block is None:
            out[key] = value
        elif key.startswith(f"{block}{chosen[block]}."):
            out[block + key[len(block) + len(chosen[block]) + 1:]] = value
    return out


def run_nni_search(cfg: Config, *, resume: bool = False) -> dict[str, Any]:
    """Search with NNI's one-shot ``cfg.search.strategy`` and export as PAR's search does; returns the record.
    NNI's loops cannot resume (:func:`parnas.strategies.nni_specs.check_nni_strategy` refuses ``resume``)."""
    import pytorch_lightning as pl
    from nni.nas.evaluator.pytorch import Lightning, Trainer
    from nni.nas.experiment import NasExperiment

    from parnas import architecture
    from parnas.data.corpora import load_splits
    from parnas.files import check_writable_dir
    from parnas.search_spaces import PARTransformerXLSpace, fixed_model
    from parnas.strategies.arch_stream import NNIDartsTask
    from parnas.strategies.pricing import cost_model, latency_summary, table_line
    from parnas.strategies.search_folder import check_search_dir, prepare_run_dir, run_dir_of
    from parnas.training.data_module import check_segments
    from parnas.training.devices import check_devices
    from parnas.training.evaluation import evaluate
    from parnas.training.fit import tokenizer_meta
    from parnas.training.memory import check_memory
    from parnas.training.trainer import build_trainer

    check_devices(cfg.train)
    name, trial = cfg.search.strategy, in_nni_trial()
    run_dir = run_dir_of(cfg)
    check_writable_dir(run_dir)
    check_search_dir(run_dir, False)
    pl.seed_everything(cfg.train.seed, verbose=False)
    tokenizer, splits = load_splits(cfg.data)
    cfg.model.check_vocab(tokenizer.vocab_size)
    data = check_segments(cfg, splits)
    check_memory(cfg, tokenizer.vocab_size, [cfg.search.candidates] * cfg.model.n_blocks)
    trainer = build_trainer(cfg.train, run_dir, trainer_cls=Trainer, gradient_clip_val=None,
                            log_every_n_steps=cfg.search.log_every)
    history = LogitsHistory(run_dir / "history.jsonl", cfg.search.log_every)
    trainer.callbacks = [*trainer.callbacks, history.callback]
    costs, latency = cost_model(cfg, tokenizer.vocab_size, trainer.strategy.root_device,
                                warn=None if trainer.is_global_zero else lambda line: None)
    if latency and trainer.is_global_zero:
        print(table_line(latency), flush=True)
    meta = {"config": cfg.to_dict(), "tokenizer": tokenizer_meta(tokenizer),
            "architecture": {"space": "PARTransformerXLSpace", "candidates": list(cfg.search.candidates)}}
    lr_setting, lr = cfg.search.weights_lr(cfg.train)
    task = NNIDartsTask(replace(cfg.train, lr=lr), meta, lr_setting)
    data.task = task  # NNI's module wraps it: the data follows the task's model and position
    experiment = NasExperiment(PARTransformerXLSpace(cfg.model, tokenizer.vocab_size, cfg.search.candidates),
                               Lightning(task, trainer, datamodule=data), nni_strategy_object(cfg))
    experiment.config.experiment_working_directory = str(run_dir / "nni")  # not ~/nni-experiments
    prepare_run_dir(run_dir, None)
    start = time.perf_counter()
    try:
        experiment.run()
    finally:
        experiment.stop()
        atexit.unregister(experiment.stop)
    seconds = time.perf_counter() - start
    (chosen,) = experiment.export_top_models(top_k=1, formatter="dict")
    chosen = {label: chosen[label] for label in sorted(chosen, key=lambda s: int(s.rsplit("_", 1)[1]))}
    kinds = list(chosen.values())

    model = fixed_model(cfg.model, tokenizer.vocab_size, chosen)
    model.load_state_dict(fixed_weights(task.model.state_dict(), chosen))
    model.to(trainer.strategy.root_device)
    val_ppl = evaluate(model, data.batches("valid")).ppl
    supernet = task.val_history[-1]["val_ppl"] if task.val_history else None
    summary = latency_summary(costs, latency, kinds, None)
    record = architecture.make_record(
        chosen, cfg.model, tokenizer.vocab_size, tokenizer=tokenizer.identity(),
        search={"strategy": name, "steps": trainer.global_step, "seed": cfg.train.seed,
                "val_ppl": round(val_ppl, 4) if math.isfinite(val_ppl) else None,
                "supernet_val_ppl": None if supernet is None else round(supernet, 4),
                "val_ppl_is": "the exported architecture with the supernet's weights, not retrained",
                "val_mem_len": cfg.model.evaluation_memory,
                "candidates": list(cfg.search.candidates), "latency": summary,
                "block_costs": {k: round(v, 4) for k, v in costs.per_kind.items()}, "cost_unit": costs.unit,
                "architecture_cost": round(costs.total(kinds), 4), "cost_ratio": round(costs.ratio(kinds), 4),
                "arch_lr": cfg.search.arch_lr, "weight_lr": lr, "seconds": round(seconds, 1),
                "nni_trial": os.environ.get("NNI_TRIAL_JOB_ID") if trial else None})
    architecture.write(run_dir / "architecture.json", record)
    if (run_dir / "history.jsonl").is_file():  # a strategy with logits: the pictures, as PAR's search draws them
        from parnas.report.plots import plot_run

        plot_run(run_dir)
    return record
