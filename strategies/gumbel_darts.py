"""PAR's Gumbel-DARTS: an NNI one-shot strategy with per-step tau annealing.

Layering follows NNI (NNI_NOTES.md): :class:`PARGumbelDARTS` (the strategy)
mutates the space's ``LayerChoice``s into ``DifferentiableMixedLayer``s with a
:class:`GumbelSoftmax`, and wraps the task in :class:`PARDartsModule` (the
Lightning module holding the search loop). What differs from NNI's GumbelDARTS,
and why:

- tau moves every optimiser step (exponential, linear or cosine), not per epoch;
- ``joint`` mode (the seed's procedure) steps weights and logits from one batch;
  ``bilevel`` is first-order DARTS with logits stepping on the validation stream.
  The task keeps one Transformer-XL memory per stream (``train``, ``arch``), and
  a stream's memory is reset when that stream starts over (trap 2);
- the penalty is lambda x expected relative block cost under softmax(alpha), a
  tensor, so it has a gradient (NNI's ``penalty`` has none: trap 8);
- evaluation runs with the Gumbel noise off (softmax of the logits), through
  Lightning's validation loop every ``train.eval_every`` steps (NNI's DARTS runs
  none: trap 9), and the probabilities logged are softmax(alpha) (trap 1).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from nni.nas.oneshot.pytorch.differentiable import DartsLightningModule
from nni.nas.oneshot.pytorch.strategy import GumbelDARTS
from nni.nas.oneshot.pytorch.supermodule.differentiable import DifferentiableMixedLayer
from nni.nas.oneshot.pytorch.supermodule.differentiable import GumbelSoftmax as NNIGumbelSoftmax
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from parnas.config import SearchConfig
from parnas.task import LanguageModelTask, segment_nll


def tau_at(step: int, total_steps: int, start: float, end: float, schedule: str = "exponential") -> float:
    """Temperature at optimiser step ``step``: ``start`` at step 0, ``end`` at the last step, monotone."""
    t = min(1.0, step / max(1, total_steps - 1))
    if schedule == "exponential":
        return start * (end / start) ** t
    if schedule == "linear":
        return start + (end - start) * t
    if schedule == "cosine":
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * t))
    raise ValueError(f"unknown tau schedule {schedule!r}")


class GumbelSoftmax(NNIGumbelSoftmax):
    """Gumbel-softmax samples while training (relaxed, or straight-through when ``hard``);
    the plain softmax of the logits in eval mode, so evaluation is deterministic."""

    def forward(self, logits: Tensor) -> Tensor:
        if self.training:
            return F.gumbel_softmax(logits, tau=self.tau, hard=self.hard, dim=self.dim)
        return logits.softmax(self.dim)


class PairedStreams(Dataset):
    """Segment t of the weight stream with segment t (cycled) of the architecture stream.

    ``arch_restart`` marks where the shorter stream starts over, so its memory is reset
    there, which Lightning's ``CombinedLoader`` would not tell us.
    """

    def __init__(self, train: Dataset, arch: Dataset) -> None:
        self.train, self.arch = train, arch

    def __len__(self) -> int:
        return len(self.train)  # type: ignore[arg-type]

    def __getitem__(self, t: int) -> dict[str, Any]:
        a = t % len(self.arch)  # type: ignore[arg-type]
        return {"train": self.train[t], "arch": self.arch[a], "arch_restart": a == 0}


class PARDartsModule(DartsLightningModule):
    """The search loop around a :class:`LanguageModelTask` (see module docstring)."""

    def __init__(self, training_module: LanguageModelTask, search: SearchConfig, *, max_steps: int,
                 gradient_clip_val: float | None, block_costs: Mapping[str, float] | None = None,
                 history_path: Path | None = None,
                 on_evaluation: Callable[[int, float], None] | None = None) -> None:
        super().__init__(training_module, arc_learning_rate=search.arch_lr, gradient_clip_val=gradient_clip_val,
                         log_prob_every_n_step=search.log_every)
        self.search, self.max_steps = search, max_steps
        self.block_costs = dict(block_costs or {})
        self.history_path, self.on_evaluation = history_path, on_evaluation
        self.tau = search.tau_start
        self._softmax_cache: list[NNIGumbelSoftmax] = []

    # --- architecture parameters -------------------------------------------
    def choices(self) -> list[DifferentiableMixedLayer]:
        return sorted((m for m in self.supernet_modules() if isinstance(m, DifferentiableMixedLayer)),
                      key=lambda m: int(m.label.rsplit("_", 1)[1]))

    def probabilities(self) -> dict[str, dict[str, float]]:
        """softmax(alpha) per block: what the search believes, without Gumbel noise."""
        return {m.label: dict(zip(m.names, m._arch_alpha.detach().softmax(-1).tolist())) for m in self.choices()}

    def expected_cost(self) -> Tensor:
        """Mean over blocks of E[cost] under softmax(alpha), relative to the dearest kind: in [0, 1]."""
        top = max(self.block_costs.values())
        terms = [m._arch_alpha.softmax(-1) @ m._arch_alpha.new_tensor([self.block_costs[n] / top for n in m.names])
                 for m in self.choices()]
        return torch.stack(terms).mean()

    def configure_architecture_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.arch_parameters(), lr=self.search.arch_lr, betas=(0.5, 0.999),
                                weight_decay=self.search.arch_weight_decay)

    # --- the search step ------------------------------------------------------
    def _softmaxes(self) -> list[NNIGumbelSoftmax]:
        if not self._softmax_cache:  # found once (the supernet is set after __init__), not walked every step
            self._softmax_cache = [m for m in self.modules() if isinstance(m, NNIGumbelSoftmax)]
        return self._softmax_cache

    @property
    def data_position(self) -> int:
        """Segments done in this pass over the training streams; a resumed search starts there."""
        return self.training_module.data_position

    def _stream_loss(self, stream: str, batch: tuple[Tensor, Tensor]) -> Tensor:
        task = self.training_module
        if stream == "train":  # the task's own path: memory restore, dropout seed, data position
            return task.train_nll(batch).mean() + task.aux_loss()  # aux: the compressive memory's (task.py)
        x, y = batch
        nll, task.mems[stream] = segment_nll(task.model, x, y, task.mems.get(stream))
        return nll.mean()

    def _penalty(self) -> Tensor | float:
        if not self.search.penalty_weight:
            return 0.0
        cost = self.expected_cost()
        self.log("search/expected_cost", cost.detach())
        return self.search.penalty_weight * cost

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        step = self.trainer.global_step
        self.tau = tau_at(step, self.max_steps, self.search.tau_start, self.search.tau_end, self.search.tau_schedule)
        for softmax in self._softmaxes():
            softmax.tau, softmax.hard = self.tau, self.search.hard
        arch_optimizer = self.architecture_optimizers()
        arch_moves = step >= self.search.arch_warmup_steps
        arch_optimizer.zero_grad()

        if self.search.mode == "bilevel":
            if batch["arch_restart"]:
                self.training_module.mems.pop("arch", None)
            if arch_moves:
                arch_loss = self._stream_loss("arch", batch["arch"]) + self._penalty()
                self.manual_backward(arch_loss)
                arch_optimizer.optimizer.step()  # the raw optimizer: only weight steps count as global steps
                self.log("search/arch_loss", arch_loss.detach())
            loss = self._stream_loss("train", batch["train"])
            self.advance_optimization(loss, batch_idx, self.gradient_clip_val)
        else:
            loss = self._stream_loss("train", batch)
            total = loss + self._penalty() if arch_moves else loss
            self.advance_optimization(total, batch_idx, self.gradient_clip_val)  # backward reaches alpha too
            if arch_moves:
                arch_optimizer.optimizer.step()
        self.advance_lr_schedulers(batch_idx)

        self.log("train/loss", loss.detach(), prog_bar=True)
        self.log("search/tau", self.tau)
        if step % self.search.log_every == 0:
            probs = self.probabilities()
            self.log_dict({f"prob/{label}/{kind}": p for label, dist in probs.items() for kind, p in dist.items()})
            self._append_history({"step": step, "tau": self.tau, "probabilities": probs})
        return loss.detach()

    # --- evaluation: Lightning's validation loop, with the task's whole-split perplexity
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        return self.training_module.validation_step(batch, batch_idx)

    def on_validation_epoch_start(self) -> None:
        self.training_module.on_validation_epoch_start()

    def on_validation_epoch_end(self) -> None:
        self.training_module.on_validation_epoch_end()
        val_ppl = float(self.trainer.callback_metrics["val/ppl"])
        step = self.trainer.global_step
        self._append_history({"step": step, "tau": self.tau, "probabilities": self.probabilities(),
                              "val_ppl": val_ppl})
        if self.on_evaluation is not None and self.trainer.is_global_zero:
            self.on_evaluation(step, val_ppl)

    # --- checkpoints: the task adds its section (memory, metadata) as it does when training alone
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.training_module.on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.training_module.on_load_checkpoint(checkpoint)

    def _append_history(self, record: dict[str, Any]) -> None:
        if self.history_path is not None and self.trainer.is_global_zero:
            with open(self.history_path, "a") as f:
                f.write(json.dumps(record) + "\n")


class PARGumbelDARTS(GumbelDARTS):
    """NNI strategy: ``NasExperiment(PARTransformerXLSpace(...), evaluator, PARGumbelDARTS(...)).run()``.

    The evaluator is NNI's ``Lightning`` around a :class:`LanguageModelTask`; its
    validation data is both what perplexity is measured on and, in ``bilevel``
    mode, the stream the logits learn from (as DARTS did on PTB).
    """

    def __init__(self, search: SearchConfig, *, max_steps: int, gradient_clip_val: float | None = None,
                 block_costs: Mapping[str, float] | None = None, history_path: Path | None = None,
                 on_evaluation: Callable[[int, float], None] | None = None) -> None:
        super().__init__(temperature=search.tau_start, arc_learning_rate=search.arch_lr,
                         gradient_clip_val=gradient_clip_val, log_prob_every_n_step=search.log_every)
        if search.penalty_weight and not block_costs:
            raise ValueError("a compute penalty needs block_costs")
        self.search, self.max_steps = search, max_steps
        self.block_costs = dict(block_costs or {kind: 1.0 for kind in search.candidates})
        self.history_path, self.on_evaluation = history_path, on_evaluation

    def configure_softmax(self) -> GumbelSoftmax:
        return GumbelSoftmax()

    def configure_oneshot_module(self, training_module: LanguageModelTask) -> PARDartsModule:
        return PARDartsModule(training_module, self.search, max_steps=self.max_steps,
                              gradient_clip_val=self.gradient_clip_val, block_costs=self.block_costs,
                              history_path=self.history_path, on_evaluation=self.on_evaluation)

    def train_dataloader(self, train_dataloader_fn: Callable[[], DataLoader],
                         val_dataloader_fn: Callable[[], DataLoader]) -> DataLoader:
        train = train_dataloader_fn()
        if self.search.mode == "joint":
            return train
        return DataLoader(PairedStreams(train.dataset, val_dataloader_fn().dataset), batch_size=None, shuffle=False)

    def val_dataloader(self, train_dataloader_fn: Callable[[], DataLoader],
                       val_dataloader_fn: Callable[[], DataLoader]) -> DataLoader:
        return val_dataloader_fn()
