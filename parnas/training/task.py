"""The language-modelling task: a Lightning module that carries Transformer-XL memory.

It subclasses NNI's ``LightningModule`` so the one-shot search can wrap it (the model is handed in with
``set_model``, as NNI does with the supernet). Memory is kept per stream (training, evaluation, or a search's
architecture stream through :meth:`LanguageModelTask.side_stream_nll`), so an evaluation mid-training neither
sees nor disturbs the training memory. Perplexity is ``exp(total NLL / predicted tokens)`` over the whole split,
summed across ranks.

Exact resume: a checkpoint holds the data position and every stream's training memory (gathered from all ranks),
and dropout is reseeded at every step from (seed, rank, micro-batch index), so a step's random numbers depend on
nothing drawn before it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from nni.nas.evaluator.pytorch import LightningModule
from torch import Tensor, nn

from parnas.config import TrainConfig
from parnas.errors import ParnasError
from parnas.nn.adaptive import TargetGroups
from parnas.nn.model import Memory
from parnas.training.devices import pinned
from parnas.training.trainer import prints_progress


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, min_ratio: float = 0.0) -> float:
    """Linear warm-up to 1 over ``warmup_steps``, then cosine decay to ``min_ratio`` at ``max_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def diverged_error(step: int, why: str, lr: float, lr_setting: str = "train.lr") -> ParnasError:
    """The one line a diverged run ends with, whatever noticed it: the step, why, and what to change. A
    :class:`ParnasError` (exit status 2), but what the run produced stays. ``lr_setting``: the setting that gave
    the weights ``lr`` (a supernet's may be ``search.weight_lr``)."""
    return ParnasError(f"training diverged at step {step} ({why}, {lr_setting}={lr:g}); lower {lr_setting} "
                       "(or clip with train.clip) and start again")


def segment_nll(model: nn.Module, x: Tensor, y: Tensor, mems: Memory | None,
                groups: TargetGroups | None = None) -> tuple[Tensor, Memory]:
    """Per-token NLL of one segment (B, L) and the memory for the next one; ``groups``: y's target groups."""
    h, mems = model(x, mems)
    return model.nll(h, y, groups), mems


def with_target_groups(model: nn.Module, batch: Any, training: bool = False) -> Any:
    """A batch ``(x, y)`` still on the host, as ``(x, y, groups)`` with y grouped for the model's output head, so
    the step reads no cluster size back from the device; a dict's values each so (a search's paired streams);
    anything else as it is. A ``training`` batch is grouped with the model's ``target_capacity``, if any."""
    if isinstance(batch, dict):
        return {key: with_target_groups(model, value, training) for key, value in batch.items()}
    group = getattr(model, "group_targets", None)
    if group is None or not isinstance(batch, (tuple, list)) or len(batch) != 2:
        return batch
    x, y = batch
    capacity = getattr(model, "target_capacity", None) if training else None
    groups = group(y, capacity) if isinstance(y, Tensor) and y.device.type == "cpu" else None
    return batch if groups is None else (x, y, groups)


def unpack(batch: Sequence[Any]) -> tuple[Tensor, Tensor, TargetGroups | None]:
    """``(x, y)`` or ``(x, y, groups)`` -> x, y and the groups (None if the batch has none)."""
    return batch[0], batch[1], (batch[2] if len(batch) > 2 else None)


def on_device(model: nn.Module, batch: Any, device: torch.device) -> tuple[Tensor, Tensor, TargetGroups | None]:
    """A host batch ``(x, y)`` as Lightning hands one to a step: its targets grouped on the host
    (:func:`with_target_groups`), then moved to ``device`` without waiting for a GPU's queue (from pinned memory)."""
    x, y, groups = pinned(unpack(with_target_groups(model, batch)), device)
    non_blocking = device.type == "cuda"
    return (x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking),
            None if groups is None else groups.to(device))


SCALED_PRECISIONS = ("16-mixed", "16")  # Lightning's precisions with a gradient scaler


def adam(params: Iterable[nn.Parameter], lr: float, precision: str = "32-true") -> torch.optim.Adam:
    """Adam, with torch's fused kernel where it may run: not under fp16 mixed precision, whose gradient scaler must
    unscale the gradients before they are clipped, where fused Adam unscales them inside its step."""
    params = list(params)
    fused = str(precision) not in SCALED_PRECISIONS and all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.Adam(params, lr=lr, fused=fused or None)


def showing_progress_bar(trainer: Any) -> bool:
    """Whether a progress bar is on screen. Lightning reads a progress-bar metric back to the host after every
    batch, which stops the host until a GPU has run the step: without a bar (a log, an NNI trial), the
    training loss is not put on it."""
    return getattr(trainer, "progress_bar_callback", None) is not None


def on_host(value: float) -> Tensor:
    """A Python number for ``self.log`` as a host tensor. Lightning makes a number into a tensor on the module's
    device, which on a GPU is an upload that waits for the stream (pytorch/pytorch#120996); a host tensor's
    metric stays on the host."""
    return torch.tensor(float(value))


def reseed(seed: int, device: torch.device) -> None:
    """``torch.manual_seed(seed)`` for a step on ``device``: the CPU's generator and the device's own only.
    ``torch.manual_seed`` also queues the seed for every backend not initialised, formatting the Python stack
    each time, a cost a small step feels."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":  # initialised: the step's tensors are there
        index = torch.cuda.current_device() if device.index is None else device.index
        torch.cuda.default_generators[index].manual_seed(seed)
    elif device.type not in ("cpu", "meta") and hasattr(getattr(torch, device.type, None), "manual_seed"):
        getattr(torch, device.type).manual_seed(seed)


def scalars_read(trainer: Any, progress_every: int) -> bool:
    """Whether anything reads the scalars logged in the step being taken (Lightning's logger, or the plain progress
    lines): ``self.log`` costs bookkeeping a small step feels, so a step no one reads logs nothing."""
    step = trainer.global_step + 1  # the step this batch takes, as the logger and the progress lines count it
    writes = trainer.log_every_n_steps > 0 and step % trainer.log_every_n_steps == 0
    return writes or prints_progress(step, progress_every) or step >= trainer.max_steps


def step_seed(seed: int, rank: int, index: int) -> int:
    """The torch seed for micro-batch ``index`` on ``rank``: a pure function, so a resumed run draws the same."""
    return ((seed * 1_000_003 + rank) * 1_000_000_007 + index) % (2**63 - 1)


class LanguageModelTask(LightningModule):
    """Trains ``self.model`` on contiguous segments; validates by whole-split perplexity. ``meta`` goes into every
    checkpoint's ``parnas`` section; ``data_position``: segments done in this pass, where a resume starts."""

    def __init__(self, train: TrainConfig, meta: dict[str, Any] | None = None, lr_setting: str = "train.lr") -> None:
        super().__init__()
        self.train_cfg = train
        self.lr_setting = lr_setting  # the setting ``train.lr`` came from, for the line a diverged run ends with
        self.meta: dict[str, Any] = dict(meta or {})
        self.mems: dict[str, Memory | None] = {}
        self.batches_seen = 0  # micro-batches trained, over all passes
        self.data_position = 0  # segments done in the current pass
        self.val_history: list[dict[str, float]] = []
        self._val_sums: Tensor | None = None
        self._restored_memory: list[Tensor | None] | None = None  # all streams, until the first step slices it
        self._first_nonfinite: Tensor | None = None  # the first step whose loss was not finite, or -1 (on device)

    # --- training -----------------------------------------------------------
    def forward(self, x: Tensor, mems: Memory | None = None) -> tuple[Tensor, Memory]:
        return self.model(x, mems)

    def on_train_epoch_start(self) -> None:
        self._new_pass()  # Lightning skips this hook when it resumes in the middle of a pass

    def _new_pass(self) -> None:
        self.mems.pop("train", None)  # the streams start over; so does their memory
        self._restored_memory, self.data_position = None, 0

    def train_memory(self, x: Tensor) -> list[Tensor | None] | None:
        """The training stream's memory the next step starts from; a resumed run's restored memory is sliced in
        first (once: the next call finds nothing left to restore)."""
        if self._restored_memory is not None:
            self.mems["train"] = self.local_memory(self._restored_memory, x)
            self._restored_memory = None
        return self.mems.get("train")

    def train_nll(self, batch: tuple[Tensor, Tensor], forward: Callable[..., Any] = segment_nll) -> Tensor:
        """Per-token NLL (B, L) of the next training segment, with the bookkeeping exact resume needs:
        the restored memory is sliced in, dropout is reseeded, the data position advances.
        The search's weight steps go through here too; ``forward``: :func:`segment_nll`'s call, or another's."""
        x, y, groups = unpack(batch)
        if self.data_position >= self.trainer.num_training_batches:
            self._new_pass()  # resumed from a checkpoint taken at the very end of a pass
        reseed(self.seed_for_step(), x.device)
        nll, self.mems["train"] = forward(self.model, x, y, self.train_memory(x), groups)
        self._note_nonfinite(nll)
        self.batches_seen += 1
        self.data_position += 1
        if self.batches_seen % self.train_cfg.log_every == 0:
            self.check_finite()
        return nll

    def _note_nonfinite(self, nll: Tensor) -> None:
        """Record, on the device, the first step whose loss is not finite. Reading it back every step would
        stop the host until the GPU has run the step; it is read every ``log_every`` micro-batches, before a
        checkpoint is written and when training ends (:meth:`check_finite`)."""
        if self._first_nonfinite is None:
            self._first_nonfinite = torch.full((), -1, dtype=torch.long, device=nll.device)
        bad = ~torch.isfinite(nll.detach()).all() & (self._first_nonfinite < 0)
        self._first_nonfinite = torch.where(bad, self.global_step + 1, self._first_nonfinite)

    def check_finite(self) -> None:
        """Stop with one line, not NaN metrics, once a training loss was not finite: the weights are past saving."""
        step = -1 if self._first_nonfinite is None else int(self._first_nonfinite)
        if step >= 0:
            raise diverged_error(step, "the training loss is not finite", self.train_cfg.lr, self.lr_setting)

    def on_train_end(self) -> None:
        self.check_finite()

    def seed_for_step(self, offset: int = 0) -> int:
        """The torch seed of this micro-batch on this rank: a pure function of (``train.seed`` + ``offset``, rank,
        micro-batches trained), so a resumed run draws the same. The training stream's dropout takes offset 0;
        anything else drawn in the same step (another stream's dropout, a sampled search's picks) takes an offset
        of its own, so its numbers are not the training stream's."""
        return step_seed(self.train_cfg.seed + offset, self.global_rank, self.batches_seen)

    def side_stream_nll(self, batch: Sequence[Any], memory: Memory | None, seed_offset: int) -> tuple[Tensor, Memory]:
        """Per-token NLL (B, L) of the next segment of a stream other than ``train`` and the memory for its next
        segment: the caller keeps that stream and its ``memory`` (a search's architecture stream); dropout is
        reseeded with :meth:`seed_for_step` (``seed_offset``), so a resumed run redraws the same. Neither the
        data position nor the micro-batch count moves: only the training stream advances them."""
        x, y, groups = unpack(batch)
        reseed(self.seed_for_step(seed_offset), x.device)
        return segment_nll(self.model, x, y, memory, groups)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.train_nll(batch).mean()
        if scalars_read(self.trainer, self.train_cfg.log_every):
            self.log("train/loss", loss, prog_bar=showing_progress_bar(self.trainer))
            self.log_dict(dict(getattr(self.model, "block_metrics", {})))  # e.g. act/steps of ut blocks
            self.log("train/ppl", loss.detach().exp())
            self.log("train/lr", on_host(self.weights_lr()))
        return loss + self.aux_loss()

    def weights_lr(self) -> float:
        """The weights' learning rate: the first optimizer that is not an architecture optimizer (a one-shot
        wrapper adds its own, marked ``is_arch_optimizer``, so ``optimizers()`` may be a list)."""
        optimizers = self.trainer.optimizers
        weights = next((o for o in optimizers if not getattr(o, "is_arch_optimizer", False)), optimizers[0])
        return float(weights.param_groups[0]["lr"])

    def aux_loss(self) -> Tensor | float:
        """Auxiliary losses the model's blocks left from the last forward (the compressive memory's
        attention reconstruction, which alone trains its compression); 0.0 when there are none."""
        return getattr(self.model, "aux_loss", 0.0)

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Clip the gradients' global norm with torch's own function, which reads nothing back to the host.

        Lightning's precision plugins refuse to clip for an optimizer that unscales gradients itself (fused
        Adam), even where there is no scaler (32-true, bf16-mixed); clipping here lets fused Adam run there.
        With a scaler (fp16 mixed) the gradients must be unscaled first: Lightning clips, Adam is not fused.
        NNI's one-shot modules call this hook too, with their own clip value."""
        if str(self.train_cfg.precision) in SCALED_PRECISIONS or gradient_clip_algorithm not in (None, "norm"):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        elif gradient_clip_val:
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)  # foreach where the device has it

    def configure_optimizers(self) -> Any:
        cfg = self.train_cfg
        optimizer = adam(self.model.parameters(), lr=cfg.lr, precision=cfg.precision)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_multiplier(step, cfg.warmup_steps, cfg.max_steps, cfg.min_lr / cfg.lr))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # --- evaluation ---------------------------------------------------------
    def on_validation_start(self) -> None:
        """Reset at every validation run. ``on_validation_start`` is a hook every NNI one-shot module forwards
        (its sampling module forwards no ``on_validation_epoch_*``), and ``validation_step`` starts lazily too."""
        self._start_validation()

    def _start_validation(self) -> None:
        self.mems["val"] = None
        # (total NLL, predicted tokens, sum over batches of exp(batch mean loss), batches)
        self._val_sums = torch.zeros(4, dtype=torch.float64, device=self.device)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        if self._val_sums is None:
            self._start_validation()
        x, y, groups = unpack(batch)
        nll, self.mems["val"] = segment_nll(self.model, x, y, self.mems.get("val"), groups)
        total = nll.double().sum()
        self._val_sums += torch.stack([total, total.new_full((), y.numel()), (total / y.numel()).exp(),
                                       total.new_ones(())])  # new_full, not new_tensor: no upload, no wait

    def on_validation_epoch_end(self) -> None:
        if self._val_sums is None:  # no batch since the last end
            return
        sums = self.trainer.strategy.reduce(self._val_sums, reduce_op="sum")
        self._val_sums = None
        loss = (sums[0] / sums[1]).float()
        # the original TensorFlow PAR Transformer-XL's figure: the mean of exp(batch loss), which reads higher
        batch_mean = (sums[2] / sums[3]).float()
        self.log("val/loss", loss)  # already summed over ranks: identical everywhere
        self.log("val/ppl", loss.exp(), prog_bar=True)
        self.log("val/ppl_batch_mean", batch_mean)
        if not self.trainer.sanity_checking:
            self.val_history.append({"step": self.global_step, "val_ppl": loss.exp().item(),
                                     "val_ppl_batch_mean": batch_mean.item()})

    # --- checkpoints: everything the next step depends on --------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        from parnas.training.checkpoint import FORMAT, VERSION, weights_digest

        self.check_finite()  # weights a non-finite loss has reached are not worth resuming from
        memory = self._restored_memory or self.gather_memory(self.mems.get("train"))
        checkpoint["parnas"] = {
            "format": FORMAT, "version": VERSION, **self.meta,
            "data_position": {"batches_seen": self.batches_seen, "in_pass": self.data_position},
            "train_memory": memory, "val_history": list(self.val_history),
            "weights_sha256": weights_digest(checkpoint["state_dict"]),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        meta = checkpoint["parnas"]
        self.batches_seen = int(meta["data_position"]["batches_seen"])
        self.data_position = int(meta["data_position"]["in_pass"])
        self.val_history = list(meta.get("val_history", []))
        self._restored_memory = meta.get("train_memory")
        self.mems.pop("train", None)

    def gather_memory(self, mems: Memory | None) -> list[Tensor | None] | None:
        """Every rank's memory of a stream, rows in stream order, on the CPU (what a checkpoint keeps):
        (B, M, D) per attention block. All ranks must call it (a collective under DDP)."""
        if mems is None:
            return None
        world = self.trainer.world_size
        out: list[Tensor | None] = []
        for m in mems:
            if m is None:
                out.append(None)
                continue
            if world > 1:
                parts = [torch.empty_like(m) for _ in range(world)]  # W x (B/W, M, D)
                torch.distributed.all_gather(parts, m.contiguous())
                m = torch.cat(parts)
            out.append(m.detach().cpu().clone())  # (B, M, D)
        return out

    def local_memory(self, memory: list[Tensor | None], x: Tensor) -> Memory:
        """This rank's rows of a gathered memory (saved on the CPU), on the device of the batch ``x`` (B, L)
        they will be attended with: the batch, not a device recorded elsewhere, is where the step runs."""
        rank, local_batch = self.global_rank, x.size(0)
        return [None if m is None else m[rank * local_batch:(rank + 1) * local_batch].to(x.device) for m in memory]
