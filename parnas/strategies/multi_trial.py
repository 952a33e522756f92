"""NNI's multi-trial NAS on the PAR space (:data:`parnas.strategies.nni_specs.NNI_STRATEGIES`' multi-trial ones,
through ``NasExperiment`` on the local training service): each trial trains one fixed architecture in its own process,
one trial at a time.

NNI pickles the evaluator into every trial and refuses a payload over 64 KB, so :func:`evaluator` carries settings,
not data: :class:`CorpusData` is a data module described by its data config alone (traced with ``nni.trace``) that
reads the corpus inside the trial, :class:`TrialTask` is the language-modelling task that reports to NNI, and the
trainer is NNI's traced ``Trainer`` with plain arguments.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nni
import pytorch_lightning as pl
from nni.nas.evaluator.pytorch import Lightning, Trainer

from parnas.config import Config, DataConfig, TrainConfig
from parnas.errors import ParnasError
from parnas.overrides import from_dict
from parnas.training.task import LanguageModelTask


@nni.trace
class CorpusData(pl.LightningDataModule):
    """The run's segments, loaded where the trial runs from ``data`` (a ``DataConfig`` as a dict)."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        super().__init__()
        self.data = dict(data)
        self._segments: Any = None

    def segments(self) -> Any:
        from parnas.data.corpora import load_splits
        from parnas.training.data_module import SegmentData

        if self._segments is None:
            cfg = from_dict(DataConfig, self.data, "data.")
            _, splits = load_splits(cfg)
            self._segments = SegmentData(splits, cfg.batch_size, cfg.eval_batch_size, cfg.seg_len)
            self._segments.trainer = self.trainer
        return self._segments

    def train_dataloader(self) -> Any:
        return self.segments().train_dataloader()

    def val_dataloader(self) -> Any:
        return self.segments().val_dataloader()

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.segments().on_before_batch_transfer(batch, dataloader_idx)


class TrialTask(LanguageModelTask):
    """:class:`LanguageModelTask` that reports to NNI: val ppl at each evaluation, and at the end the architecture and
    its predicted cost ratio (``costs``: the run's ``per_kind``, ``constant`` and ``reference``) beside ``default``,
    minus the validation perplexity, since NNI 3.0's multi-trial strategies take the largest metric as the best."""

    def __init__(self, train: Mapping[str, Any], costs: Mapping[str, Any]) -> None:
        super().__init__(from_dict(TrainConfig, train, "train."))
        self.costs = dict(costs)

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        if self.val_history and nni.get_current_parameter() is not None and not self.trainer.sanity_checking:
            nni.report_intermediate_result(self.val_history[-1]["val_ppl"])

    def on_fit_end(self) -> None:
        if nni.get_current_parameter() is None:
            return
        from parnas.architecture import layout_string

        kinds = self.model.block_kinds
        per_kind, constant = self.costs["per_kind"], self.costs["constant"]
        ratio = (constant + sum(per_kind[k] for k in kinds)) / self.costs["reference"]
        ppl = self.val_history[-1]["val_ppl"] if self.val_history else math.inf
        ppl = ppl if math.isfinite(ppl) else 1e9
        nni.report_final_result({"default": -ppl, "val_ppl": ppl, "architecture": layout_string(kinds),
                                 "latency_ratio": round(ratio, 4)})


def evaluator(cfg: Config, costs: Mapping[str, Any]) -> Lightning:
    """What every trial runs: train the sampled fixed model with ``cfg`` and report (a few KB serialised)."""
    t = cfg.train
    trainer = Trainer(max_steps=t.max_steps, max_epochs=-1, val_check_interval=t.eval_every,
                      check_val_every_n_epoch=None, gradient_clip_val=t.clip or None, accelerator=t.accelerator,
                      devices=1, precision=t.precision, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      use_distributed_sampler=False)
    return Lightning(TrialTask(asdict(t), costs), trainer, datamodule=CorpusData(asdict(cfg.data)))


ENDED = frozenset({"SUCCEEDED", "FAILED", "USER_CANCELED", "SYS_CANCELED", "EARLY_STOPPED"})


def run_until_trials_end(experiment: Any, port: int, trials: int, *, poll_s: float = 2.0, settle_s: float = 30.0,
                         stall_s: float = 180.0) -> str | None:
    """Run ``experiment`` until NNI's loop ends or its trial table says the search is over; returns why it was cut
    short, or None when NNI ended by itself. NNI 3.0's multi-trial loop can wait forever after its trials
    (microsoft/nni#5202, #5415, #5493: a lost message), so NNI's ``run`` goes to a daemon thread and this one reads
    the trial table every ``poll_s``: ``trials`` ended and no change for ``settle_s``, or none active and no change
    for ``stall_s``, ends the search. Errors of NNI's loop are raised here."""
    failure: list[BaseException] = []

    def drive() -> None:
        try:
            experiment.run(port=port)
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            failure.append(error)

    runner = threading.Thread(target=drive, name="nni-experiment", daemon=True)
    runner.start()
    seen, changed = None, time.monotonic()
    while runner.is_alive():
        runner.join(poll_s)
        try:
            jobs = experiment.list_trial_jobs()
        except Exception:  # noqa: BLE001 - the manager is starting or already gone: judged at the next read
            continue
        states = sorted((job.trialJobId, job.status) for job in jobs)
        now = time.monotonic()
        if states != seen:
            seen, changed = states, now
        ended = sum(status in ENDED for _, status in states)
        active = len(states) - ended
        if ended >= trials and now - changed > settle_s:
            quiet_nni()
            return f"all {ended} trials ended; NNI's loop did not, and was stopped"
        if not active and now - changed > stall_s:
            quiet_nni()
            return f"NNI started no trial for {stall_s:.0f} s after {ended} of {trials} ended; the search stops there"
    if failure:
        raise failure[0]
    return None


@contextmanager
def commands_read_as_plain_json() -> Iterator[None]:
    """While NNI's experiment runs in this process, its tuner channel parses the commands it receives as plain JSON.

    NNI 3.0 parses them with ``nni.load``, json_tricks with comment stripping on, which misreads where strings end in
    doubly escaped JSON: a trial-end command's parameters (base64 pickles) hold ``//`` now and then, the rest is
    stripped as a comment, fails to parse, NNI drops the connection and its loop starts no more trials. NNI writes no
    comments, so nothing is lost; the parser is swapped for the experiment's lifetime and restored after."""
    from nni.runtime.command_channel.websocket import connection

    original = connection.nni
    connection.nni = SimpleNamespace(dump=nni.dump, load=functools.partial(nni.load, ignore_comments=False))
    try:
        yield
    finally:
        connection.nni = original


def quiet_nni() -> None:
    """NNI's loop, cut short, logs its own failure: the line parnas prints says what happened instead."""
    for name in ("nni.nas.strategy", "nni.nas.experiment", "nni.nas.execution", "nni.runtime"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def stop_within(experiment: Any, timeout_s: float = 60.0) -> None:
    """``experiment.stop()``, waited for at most ``timeout_s``: it stops the manager first, then joins NNI's
    listening thread, which can wait forever on a message that never comes (it is a daemon thread)."""
    stopper = threading.Thread(target=experiment.stop, name="nni-stop", daemon=True)
    stopper.start()
    stopper.join(timeout_s)


def run_multi_trial(cfg: Config, *, resume: bool = False, trials: int | None = None,
                    port: int | None = None) -> dict[str, Any]:
    """``parnas search --strategy random|regularized-evolution|tpe|grid``: ``trials`` (``search.trials``) trials, one
    at a time, each training one sampled fixed model from scratch; returns the best one's record. NNI's manager
    listens on 127.0.0.1 only, at ``port`` (a free one if None); a port in use, or NNI failing to create or run its
    experiment, is one line naming the port, and the run directory is left as it was found."""
    import atexit
    import socket

    from nni.nas.experiment import NasExperiment

    from parnas import architecture
    from parnas.data.corpora import load_splits
    from parnas.files import check_writable_dir, ensure_writable_dir
    from parnas.report.experiments import nni_on_loopback, port_in_use, remove_experiment
    from parnas.search_spaces import PARTransformerXLSpace
    from parnas.strategies.nni_strategies import nni_strategy_object
    from parnas.strategies.pricing import cost_model, latency_summary, table_line
    from parnas.strategies.search_folder import check_search_dir
    from parnas.training.devices import check_devices, training_device

    trials = cfg.search.trials if trials is None else trials
    check_devices(cfg.train)
    run_dir = Path(cfg.search.out_dir)
    check_writable_dir(run_dir)
    check_search_dir(run_dir, False)
    if port is not None and port_in_use(port):
        raise ParnasError(f"port {port} is already in use: NNI's manager for the {cfg.search.strategy} search needs "
                          "a free one")
    tokenizer, _ = load_splits(cfg.data)  # built here once: the trials read it from the cache
    cfg.model.check_vocab(tokenizer.vocab_size)
    costs, latency = cost_model(cfg, tokenizer.vocab_size, training_device(cfg.train))
    if latency:
        print(table_line(latency), flush=True)
    prices = {"per_kind": costs.per_kind, "constant": costs.constant, "reference": costs.reference}
    experiment = NasExperiment(PARTransformerXLSpace(cfg.model, tokenizer.vocab_size, cfg.search.candidates),
                               evaluator(cfg, prices), nni_strategy_object(cfg))
    experiment.config.max_trial_number = trials
    experiment.config.trial_concurrency = 1
    made_run_dir = not run_dir.exists()
    ensure_writable_dir(run_dir)
    experiment.config.experiment_working_directory = str((run_dir / "nni").absolute())
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    failure: Exception | None = None
    with nni_on_loopback(), commands_read_as_plain_json():
        try:
            cut_short = run_until_trials_end(experiment, port, trials)
            models = [m for m in experiment.strategy.list_models() if isinstance(m.metric, (int, float))]
        except Exception as error:  # noqa: BLE001 - NNI's own failure: told in one line below
            failure = error
            quiet_nni()
        finally:
            stop_within(experiment)
            atexit.unregister(experiment.stop)
    if failure is not None:
        remove_experiment(run_dir / "nni", experiment.id, (run_dir / "nni", run_dir if made_run_dir else None))
        reason = (str(failure).strip().splitlines() or [""])[0]
        raise ParnasError(f"NNI could not run the {cfg.search.strategy} search's experiment on port {port} "
                          f"({type(failure).__name__}{': ' + reason if reason else ''}); nothing was kept: "
                          "stop other NNI experiments on it (nnictl experiment list) or try again") from None
    if cut_short:
        print(f"parnas search: {cut_short}", flush=True)
    if not models:
        raise ParnasError(f"no trial of the {cfg.search.strategy} search reported a result; see the trials' logs "
                          f"under {run_dir / 'nni'}")
    best = max(models, key=lambda m: m.metric)  # the smallest perplexity
    chosen = {label: best.sample[label] for label in sorted(best.sample, key=lambda s: int(s.rsplit("_", 1)[1]))}
    kinds = list(chosen.values())
    tried = [{"architecture": architecture.layout_string([m.sample[k] for k in chosen]), "val_ppl": -m.metric,
              "latency_ratio": round(costs.ratio([m.sample[k] for k in chosen]), 4)} for m in models]
    record = architecture.make_record(
        chosen, cfg.model, tokenizer.vocab_size, tokenizer=tokenizer.identity(),
        search={"strategy": cfg.search.strategy, "trials": len(models), "steps": cfg.train.max_steps,
                "seed": cfg.train.seed, "val_ppl": round(-best.metric, 4),
                "val_ppl_is": f"the trial's own training of this architecture from scratch ({cfg.train.max_steps} "
                              "steps), not retrained here",
                "candidates": list(cfg.search.candidates), "latency": latency_summary(costs, latency, kinds, None),
                "block_costs": {k: round(v, 4) for k, v in costs.per_kind.items()}, "cost_unit": costs.unit,
                "architecture_cost": round(costs.total(kinds), 4), "cost_ratio": round(costs.ratio(kinds), 4),
                "tried": tried, "nni_experiment": experiment.id, "nni_trial": os.environ.get("NNI_TRIAL_JOB_ID")})
    architecture.write(run_dir / "architecture.json", record)
    return record
