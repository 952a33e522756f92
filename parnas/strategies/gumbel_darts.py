"""PAR's Gumbel-DARTS: an NNI one-shot strategy with per-step tau annealing.

Layered as NNI's one-shot code is: :class:`PARGumbelDARTS` (the strategy) mutates the space's ``LayerChoice``s into
``DifferentiableMixedLayer``s (:class:`RoutedMixedLayer`) with a :class:`GumbelSoftmax`, and wraps the task in
:class:`PARDartsModule` (the Lightning module holding the search loop). What differs from NNI's GumbelDARTS, and why:

- tau falls exponentially every optimiser step, not per epoch, and weights and logits step from one batch (the
  original TensorFlow PAR Transformer-XL's procedure); ``forward: fair`` (:mod:`parnas.strategies.fair`) and
  ``forward: sampled`` (:mod:`parnas.strategies.sampled`) draw no Gumbel sample;
- cost is predicted step time relative to Transformer-XL's (:class:`CostModel`). A ``latency_budget`` is a
  constraint: a hinge on the excess over the budget of the *exported* architecture's cost, differentiated through
  the expected cost under softmax(alpha), weighted by a multiplier found by dual ascent or fixed by
  ``penalty_weight``. Without a budget, ``penalty_weight`` is lambda x the expected cost (NNI's ``penalty`` sees
  the probabilities as Python floats, so it has no gradient to the logits);
- evaluation runs every ``train.eval_every`` steps (NNI's DARTS runs no validation loop) twice: the supernet with
  the Gumbel noise off, and the exported argmax architecture with the supernet's weights (their gap: the
  discretisation gap); before the last step both read :data:`~parnas.pick_config.EARLY_VALID_FRACTION` of the
  validation split (they only show progress), the last one all of it. Probabilities logged are softmax(alpha)
  (NNI's ``export_probs()`` under GumbelDARTS passes the logits through the Gumbel softmax: its values change from
  call to call);
- the logits are ordered by block (NNI's ``arch_parameters()`` is a ``set``, whose order changes between processes,
  so a resumed optimiser would restore its moments onto the wrong logits), and under DDP their gradients are
  averaged over ranks, so every rank holds the same architecture (NNI's DARTS lets ranks drift apart).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from nni.nas.oneshot.pytorch.differentiable import DartsLightningModule
from nni.nas.oneshot.pytorch.supermodule.differentiable import DifferentiableMixedLayer

# the public path: importing nni.nas.oneshot.pytorch.strategy first leaves nni.nas.strategy's DARTS, GumbelDARTS,
# RandomOneShot, Proxyless and ENAS as placeholders that fail when run (a circular import inside NNI 3.0)
from nni.nas.strategy import GumbelDARTS
from torch import Tensor
from torch.utils.data import DataLoader

from parnas.config import SearchConfig
from parnas.pick_config import EARLY_VALID_FRACTION
from parnas.strategies.costs import CostModel
from parnas.strategies.fair import fair_loss
from parnas.strategies.par_settings import PARSettings
from parnas.strategies.sampled import PICK_SEED_OFFSET, RoutedMixedLayer, clear_picks, draw_picks, reinforce
from parnas.strategies.supernet_export import Evaluated, exported_nll, fit_budget
from parnas.strategies.temperature import GumbelSoftmax, tau_at
from parnas.training.evaluation import perplexity, segments_read
from parnas.training.task import LanguageModelTask, on_host, scalars_read, showing_progress_bar

DUAL_LR = 0.05  # the rate of the dual ascent on a latency budget's multiplier


class PARDartsModule(DartsLightningModule):
    """The search loop around a :class:`LanguageModelTask` (see module docstring)."""

    def __init__(self, training_module: LanguageModelTask, search: SearchConfig, par: PARSettings, *, max_steps: int,
                 gradient_clip_val: float | None, costs: CostModel | None = None,
                 history_path: Path | None = None, on_evaluation: Callable[[Evaluated], None] | None = None) -> None:
        super().__init__(training_module, arc_learning_rate=search.arch_lr, gradient_clip_val=gradient_clip_val,
                         log_prob_every_n_step=search.log_every)
        self.search, self.par, self.max_steps, self.costs = search, par, max_steps, costs
        self.history_path, self.on_evaluation = history_path, on_evaluation
        self.tau = self.par.tau_start
        self._dual = torch.zeros((), dtype=torch.float64)  # the budget's multiplier (lambda), by dual ascent
        self._logging = True  # whether this step's scalars are read: set before the step moves global_step
        self.last_evaluation: Evaluated | None = None
        self._softmax_cache: list[GumbelSoftmax] = []
        self._choice_cache: list[DifferentiableMixedLayer] = []
        self._cost_table: Tensor | None = None  # (n_blocks, n_kinds) block costs, on the logits' device
        self._baseline: Tensor | None = None  # forward=sampled: the loss's moving average (REINFORCE's)
        self._valid_segments: int | None = None  # this evaluation's validation segments (valid_fraction's part)

    # --- architecture parameters -------------------------------------------
    def choices(self) -> list[DifferentiableMixedLayer]:
        if not self._choice_cache:  # found once, as the softmaxes: not a walk of every module every step
            self._choice_cache = sorted((m for m in self.supernet_modules() if isinstance(m, DifferentiableMixedLayer)),
                                        key=lambda m: int(m.label.rsplit("_", 1)[1]))
        return self._choice_cache

    def arch_parameters(self) -> list[torch.nn.Parameter]:
        """The logits in block order (NNI's is ``list(set(...))``: see module docstring)."""
        return [m._arch_alpha for m in self.choices()]

    def probabilities(self) -> dict[str, dict[str, float]]:
        """softmax(alpha) per block: what the search believes, without Gumbel noise."""
        return {str(m.label): dict(zip(m.names, m._arch_alpha.detach().softmax(-1).tolist())) for m in self.choices()}

    def argmax(self) -> list[str]:
        """Each block's most probable kind, read back in one copy (for history and export, not every step)."""
        choices = self.choices()
        best = torch.stack([m._arch_alpha.detach() for m in choices]).argmax(-1).tolist()  # (n_blocks,)
        return [m.names[i] for m, i in zip(choices, best)]

    def block_costs(self, device: torch.device) -> Tensor:
        """Each block's candidates' costs, float64, copied to ``device`` once: the budget and the penalty read them
        every step, and an upload in the step waits for the GPU's stream. (n_blocks, n_kinds)"""
        if self._cost_table is None or self._cost_table.device != device:
            self._cost_table = torch.tensor([[self.costs.per_kind[k] for k in m.names] for m in self.choices()],
                                            dtype=torch.float64).to(device)
        return self._cost_table

    def exported_ratio(self) -> Tensor:
        """The argmax layout's cost ratio, computed where the logits are: the budget reads it every step, and a
        read-back would stop the host until the device has run the step. ()"""
        alphas = torch.stack([m._arch_alpha.detach() for m in self.choices()])  # (n_blocks, n_kinds)
        chosen = self.block_costs(alphas.device).gather(1, alphas.argmax(-1, keepdim=True)).sum()
        return (self.costs.constant + chosen) / self.costs.reference

    @property
    def dual(self) -> float:
        """lambda found by dual ascent, read back (for history, checkpoints and metrics only)."""
        return float(self._dual)

    @property
    def fixed_lambda(self) -> bool:
        """Is the budget's multiplier ``penalty_weight`` (PLANER's form) rather than found by dual ascent?"""
        return self.par.latency_budget is not None and self.par.penalty_weight > 0

    def exported_kinds(self) -> tuple[list[str], bool]:
        """What is exported: the argmax, or, when a budget is set and the argmax is over it, the most probable
        layout within it; and whether that fitting was needed (it is recorded, never silent)."""
        kinds, budget = self.argmax(), self.par.latency_budget
        if budget is None or self.costs is None or self.costs.ratio(kinds) <= budget:
            return kinds, False
        fitted = fit_budget(list(self.probabilities().values()), self.costs, budget)
        return (kinds, False) if fitted is None else (fitted, True)

    def expected_ratio(self) -> Tensor:
        """Expected cost ratio to Transformer-XL's under softmax(alpha), differentiable, where the logits are. ()"""
        alphas = torch.stack([m._arch_alpha for m in self.choices()])  # (n_blocks, n_kinds)
        costs = self.block_costs(alphas.device).to(alphas.dtype)
        return (self.costs.constant + (alphas.softmax(-1) * costs).sum()) / self.costs.reference

    def configure_architecture_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.arch_parameters(), lr=self.search.arch_lr, betas=(0.5, 0.999))

    # --- the search step ------------------------------------------------------
    def _softmaxes(self) -> list[GumbelSoftmax]:
        if not self._softmax_cache:  # found once (the supernet is set after __init__), not walked every step
            self._softmax_cache = [m for m in self.modules() if isinstance(m, GumbelSoftmax)]
        return self._softmax_cache

    def _step_loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | float]:
        """The training batch's loss, and what the logits learn from besides the penalty: nothing more under ``gumbel``
        (the loss's own gradient reaches them), the forward's surrogate under ``fair`` and ``sampled`` (their picks
        seeded by the step, as dropout is, so a resumed search draws the same)."""
        task = self.training_module
        if self.par.forward == "fair":
            stacked = task.train_cfg.compile != "none"  # one static graph to compile
            return fair_loss(self.choices(), task, batch, True, stacked)
        if self.par.forward == "sampled":
            choices = self.choices()
            picks = draw_picks(choices, task.seed_for_step(PICK_SEED_OFFSET))
            loss = task.train_nll(batch).mean() + task.aux_loss()
            surrogate, self._baseline = reinforce(choices, picks, loss, self._baseline)
            return loss, surrogate
        return task.train_nll(batch).mean() + task.aux_loss(), 0.0  # aux: the compressive memory's (task.py)

    def _penalty(self) -> Tensor | float:
        """Fixed lambda x expected cost ratio; or, with a budget, lambda x max(0, cost - budget), the cost the exported
        architecture's, straight-through (the argmax's value, the expected cost's gradient), so it pushes exactly while
        what would be exported is over budget; lambda is ``penalty_weight`` when set, else found by dual ascent."""
        if self.costs is None or (not self.par.penalty_weight and self.par.latency_budget is None):
            return 0.0
        expected = self.expected_ratio()
        if self._logging:
            self.log("search/expected_cost_ratio", expected.detach())
        if self.par.latency_budget is None:
            return self.par.penalty_weight * expected
        cost = self.exported_ratio().to(expected.dtype) + expected - expected.detach()  # straight-through
        multiplier = self.par.penalty_weight if self.fixed_lambda else self._dual.to(expected.dtype)
        if self._logging:
            self.log("search/lambda", on_host(multiplier) if self.fixed_lambda else self._dual.float())
        return multiplier * F.relu(cost - self.par.latency_budget)

    def _dual_step(self) -> None:
        """lambda <- max(0, lambda + DUAL_LR x (exported cost - budget)): identical on every rank (same logits)."""
        if self.costs is not None and self.par.latency_budget is not None and not self.fixed_lambda:
            excess = self.exported_ratio() - self.par.latency_budget
            self._dual = (self._dual.to(excess.device) + DUAL_LR * excess).clamp_min(0.0)

    def _sync_arch_gradients(self) -> None:
        """Average the logits' gradients over DDP ranks, so every rank holds the same logits (NNI #5013)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.trainer.world_size > 1:
            for alpha in self.arch_parameters():
                if alpha.grad is None:
                    alpha.grad = torch.zeros_like(alpha)
                torch.distributed.all_reduce(alpha.grad)
                alpha.grad /= self.trainer.world_size

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        step = self.trainer.global_step
        self._logging = scalars_read(self.trainer, self.training_module.train_cfg.log_every)
        self.tau = tau_at(step, self.max_steps, self.par.tau_start, self.par.tau_end)
        if self.par.samples:  # Gumbel-DARTS: the sample every block mixes its candidates by, at this tau
            for softmax in self._softmaxes():
                softmax.set_tau(self.tau)
        arch_optimizer = self.architecture_optimizers()
        arch_moves = step >= self.par.arch_warmup_steps
        arch_optimizer.zero_grad()
        loss, surrogate = self._step_loss(batch)  # the REINFORCE baseline follows the loss from step 0
        total = loss + self._penalty() + surrogate if arch_moves else loss
        self.advance_optimization(total, batch_idx, self.gradient_clip_val)  # backward reaches alpha too
        if arch_moves:
            self._sync_arch_gradients()
            arch_optimizer.optimizer.step()  # the raw optimizer: only weight steps count as global steps
            self._dual_step()
        clear_picks(self.choices())
        self.advance_lr_schedulers(batch_idx)

        done = step + 1  # optimiser steps taken: the step number history, TensorBoard and NNI share
        metrics = dict(getattr(self.training_module.model, "block_metrics", {}))  # e.g. act/steps/block_3
        if self._logging:
            self.log("train/loss", loss.detach(), prog_bar=showing_progress_bar(self.trainer))
            self.log_dict({**metrics, **({"search/tau": on_host(self.tau)} if self.par.samples else {})})
        if done % self.search.log_every == 0:
            probs = self.probabilities()
            self.log_dict({f"prob/{label}/{kind}": on_host(p) for label, dist in probs.items()
                           for kind, p in dist.items()})
            record: dict[str, Any] = {"step": done, "probabilities": probs}
            if self.par.samples:  # a forward that draws no sample reads no tau: none is recorded
                record["tau"] = self.tau
            if self.costs is not None:
                record["expected_cost_ratio"] = round(float(self.expected_ratio().detach()), 5)
                record["exported_cost_ratio"] = round(self.costs.ratio(self.argmax()), 5)
            if self.par.latency_budget is not None:
                record["lambda"] = self.par.penalty_weight if self.fixed_lambda else round(self.dual, 6)
            act = {name.rsplit("/", 1)[1]: round(float(v), 3) for name, v in metrics.items()
                   if name.startswith("act/steps/")}
            if act:  # each ut candidate's mean pondering steps per position, for the architecture figure
                record["act_steps"] = act
            self.append_history(record)
        return loss.detach()

    # --- evaluation: the supernet through Lightning's validation loop, then the exported architecture
    def valid_fraction(self) -> float:
        """The part of the validation split this evaluation reads: all of it at the last step, else
        EARLY_VALID_FRACTION (module docstring)."""
        return 1.0 if self.trainer.global_step >= self.max_steps else EARLY_VALID_FRACTION

    def on_validation_start(self) -> None:
        super().on_validation_start()
        n = len(self.trainer.datamodule.batches("valid", self.trainer.global_rank, self.trainer.world_size))
        self._valid_segments = segments_read(n, self.valid_fraction())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self._valid_segments is not None and batch_idx >= self._valid_segments:
            return None  # past this evaluation's part of the split: the segment is fetched, never run
        return self.training_module.validation_step(batch, batch_idx)

    def on_validation_epoch_end(self) -> None:
        self.training_module.on_validation_epoch_end()
        supernet = float(self.trainer.callback_metrics["val/ppl"])
        result = self.evaluate_exported(supernet)
        self.log_dict({"val/ppl_exported": result.val_ppl, "val/ppl_supernet": result.supernet_val_ppl,
                       "val/discretisation_gap": result.val_ppl - result.supernet_val_ppl})
        self.last_evaluation = result
        self.append_history(result.history_line())
        if self.on_evaluation is not None and self.trainer.is_global_zero:
            self.on_evaluation(result)

    def evaluate_exported(self, supernet_val_ppl: float) -> Evaluated:
        """Perplexity of the argmax architecture with the supernet's weights, summed over ranks, on the part of the
        validation split the supernet's was read on (:meth:`valid_fraction`)."""
        trainer, fraction = self.trainer, self.valid_fraction()
        batches = trainer.datamodule.batches("valid", trainer.global_rank, trainer.world_size)
        kinds, fitted = self.exported_kinds()
        part = (batches[t] for t in range(segments_read(len(batches), fraction)))
        sums = exported_nll(self.training_module.model, self.choices(), kinds, part)
        sums = trainer.strategy.reduce(sums, reduce_op="sum")
        return self.evaluated(kinds, fitted, perplexity(float(sums[0] / sums[1])), supernet_val_ppl, fraction)

    def evaluated(self, kinds: list[str], fitted: bool, val_ppl: float, supernet_val_ppl: float,
                  valid_fraction: float = 1.0) -> Evaluated:
        tau = self.tau if self.par.samples else None  # a forward without a Gumbel sample reads no tau
        return Evaluated(self.trainer.global_step, tau, self.probabilities(), kinds, val_ppl, supernet_val_ppl,
                         self.costs.ratio(kinds) if self.costs is not None else None, fitted, valid_fraction)

    # --- checkpoints: the task adds its section (memory, metadata); the search adds lambda and the arch memory
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.training_module.on_save_checkpoint(checkpoint)
        checkpoint["parnas"]["search"] = {"lambda": self.dual,
                                          "baseline": None if self._baseline is None else float(self._baseline),
                                          "last_evaluation": asdict(self.last_evaluation)
                                          if self.last_evaluation else None}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.training_module.on_load_checkpoint(checkpoint)
        state = checkpoint["parnas"].get("search") or {}
        self._dual = torch.tensor(float(state.get("lambda", 0.0)), dtype=torch.float64)
        baseline = state.get("baseline")
        self._baseline = None if baseline is None else torch.tensor(baseline, dtype=torch.float32)
        last = state.get("last_evaluation")
        self.last_evaluation = Evaluated(**last) if last else None
        # the temperature of the last step taken, as the run that saved held it: a search resumed after its last
        # step (to finish its export) takes no step that would set it
        self.tau = tau_at(max(0, int(checkpoint["global_step"]) - 1), self.max_steps, self.par.tau_start,
                          self.par.tau_end)

    def append_history(self, record: dict[str, Any]) -> None:
        """One line of history.jsonl; a line with a cost says which device's latency priced it, and which latency."""
        if self.costs is not None and self.costs.device is not None and "exported_cost_ratio" in record:
            record = {**record, "latency_device": self.costs.device, "latency_target": self.costs.target}
        if self.history_path is not None and self.trainer.is_global_zero:
            with open(self.history_path, "a") as f:
                f.write(json.dumps(record) + "\n")


class PARGumbelDARTS(GumbelDARTS):
    """NNI strategy: ``NasExperiment(PARTransformerXLSpace(...), evaluator, PARGumbelDARTS(...)).run()``, the evaluator
    NNI's ``Lightning`` around a :class:`LanguageModelTask`. ``par``: PAR's settings as the search read them."""

    def __init__(self, search: SearchConfig, par: PARSettings, *, max_steps: int,
                 gradient_clip_val: float | None = None, costs: CostModel | None = None,
                 history_path: Path | None = None,
                 on_evaluation: Callable[[Evaluated], None] | None = None) -> None:
        super().__init__(temperature=par.tau_start, arc_learning_rate=search.arch_lr,
                         gradient_clip_val=gradient_clip_val, log_prob_every_n_step=search.log_every,
                         mutation_hooks=[RoutedMixedLayer.mutate])  # NNI's mixed layer, able to run one pick
        if (par.penalty_weight or par.latency_budget is not None) and costs is None:
            raise ValueError("a cost penalty or a latency budget needs a CostModel")
        self.search, self.par, self.max_steps, self.costs = search, par, max_steps, costs
        self.history_path, self.on_evaluation = history_path, on_evaluation

    def configure_softmax(self) -> GumbelSoftmax:
        return GumbelSoftmax()

    def configure_oneshot_module(self, training_module: LanguageModelTask) -> PARDartsModule:
        return PARDartsModule(training_module, self.search, self.par, max_steps=self.max_steps,
                              gradient_clip_val=self.gradient_clip_val, costs=self.costs,
                              history_path=self.history_path, on_evaluation=self.on_evaluation)

    def train_dataloader(self, train_dataloader_fn: Callable[[], DataLoader],
                         val_dataloader_fn: Callable[[], DataLoader]) -> DataLoader:
        return train_dataloader_fn()

    def val_dataloader(self, train_dataloader_fn: Callable[[], DataLoader],
                       val_dataloader_fn: Callable[[], DataLoader]) -> DataLoader:
        return val_dataloader_fn()
