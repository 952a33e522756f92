"""The figures a finished run is judged by: whole-split perplexity and its speed, and peak memory.

Evaluation runs on the device the model's weights are on, under bf16 autocast where training used it, so it
measures the arithmetic the model trained with. A diverged run is a result too: its perplexity is ``inf``
(:func:`perplexity`), and :func:`diverged` marks it.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from parnas.data.corpora import ContextBatches
from parnas.errors import ParnasError
from parnas.nn.model import TransformerXL, full_memory_steps
from parnas.training.task import diverged_error, on_device, segment_nll


def perplexity(loss: float) -> float:
    """``exp(loss)``, the perplexity of a mean NLL in nats: ``inf`` where that overflows a float (a loss above
    about 709.8, which a diverged run reaches), ``nan`` for ``nan``. Every perplexity computed on the host from a
    loss goes through here, so a diverged run's figure is ``inf``, never an ``OverflowError``."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


# A validation loss this far (nats) above log(V), a uniform guess, is a diverged model. Not 0: an untrained model
# sits a little above log(V), and a run of a step or two is not diverged; a diverged one is far above.
DIVERGENCE_MARGIN = 1.0


def diverged(loss: float | None, vocab_size: int) -> bool:
    """Whether a mean validation loss (nats; None: not finite) says training diverged: not finite, or more than
    ``DIVERGENCE_MARGIN`` above ``log(vocab_size)``, i.e. a perplexity above e times the vocabulary size."""
    return loss is None or not math.isfinite(loss) or loss > math.log(vocab_size) + DIVERGENCE_MARGIN


def divergence_reason(loss: float | None, vocab_size: int, what: str = "the validation loss") -> str:
    """Why :func:`diverged` said so, in words, for the one line the run ends with."""
    if loss is None or not math.isfinite(loss):
        return f"{what} is not finite"
    limit = math.log(vocab_size) + DIVERGENCE_MARGIN
    return (f"{what} is {loss:.4g} nats, over log({vocab_size:,}) + {DIVERGENCE_MARGIN:g} = {limit:.2f}: "
            f"worse than guessing among {vocab_size:,} tokens")


def divergence_step(history: Iterable[dict[str, Any]], step: int, vocab_size: int) -> int:
    """The step from which validation has stayed diverged up to the final evaluation at ``step``: the first of the
    trailing evaluations in ``history`` (``{"step", "val_ppl"}`` lines, perplexity None or ``inf`` where not finite)
    whose perplexity is diverged too, else ``step``."""
    first = step
    for line in sorted((h for h in history if h["step"] <= step), key=lambda h: h["step"], reverse=True):
        ppl = line.get("val_ppl")
        if ppl is not None and math.isfinite(ppl) and not diverged(math.log(ppl), vocab_size):
            break
        first = line["step"]
    return first


def divergence(loss: float | None, vocab_size: int, step: int, lr: float, what: str = "the validation loss",
               measured_at: int | None = None, lr_setting: str = "train.lr") -> ParnasError | None:
    """The error a run whose final ``loss`` (measured at step ``measured_at``, when that is not ``step``, the step
    it diverged at) diverged ends with (:func:`parnas.training.task.diverged_error`), or None when it did not."""
    if not diverged(loss, vocab_size):
        return None
    if measured_at is not None and measured_at != step:
        what = f"{what} at step {measured_at}"
    return diverged_error(step, divergence_reason(loss, vocab_size, what), lr, lr_setting)


def finite_or_none(value: float | None) -> float | None:
    """``value``, or None where it is not finite: JSON has no ``inf`` or ``nan`` (Python would write a file other
    readers refuse)."""
    return value if value is not None and math.isfinite(value) else None


class SplitData(Protocol):
    """What evaluation reads of a run's data: each split's batches
    (:class:`parnas.training.data_module.SegmentData`)."""

    def batches(self, split: str) -> ContextBatches: ...


@dataclass(frozen=True)
class Evaluation:
    nll: float  # total negative log-likelihood, nats
    tokens: int  # predicted tokens
    seconds: float
    # mean over segments of exp(segment mean NLL): the original TensorFlow PAR Transformer-XL's figure, reads higher
    batch_mean_ppl: float = math.nan

    @property
    def loss(self) -> float:
        return self.nll / self.tokens

    @property
    def ppl(self) -> float:
        return perplexity(self.loss)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def model_device(model: nn.Module) -> torch.device:
    """The device ``model``'s weights are on. Evaluation sends its batches there rather than to a device
    named by the caller, so the two cannot disagree (Lightning moves a module back to the CPU when
    ``fit`` ends, while the trainer still names the GPU it trained on)."""
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]]) -> Evaluation:
    """Perplexity over a whole split, memory carried across segments, dropout off, on the model's device. The
    targets are grouped on the host and nothing is read back before the end."""
    device = model_device(model)
    was_training = model.training
    model.eval()
    total, count, mems = torch.zeros((), dtype=torch.float64, device=device), 0, None
    exp_sum, segments = torch.zeros((), dtype=torch.float64, device=device), 0
    start = time.perf_counter()
    for batch in batches:
        x, y, groups = on_device(model, batch, device)
        nll, mems = segment_nll(model, x, y, mems, groups)
        total += nll.double().sum()
        exp_sum += nll.double().mean().exp()
        count += y.numel()
        segments += 1
    model.train(was_training)
    return Evaluation(total.item(), count, time.perf_counter() - start, exp_sum.item() / max(1, segments))


def peak_memory_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated on ``device``, or this process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def autocast(device: torch.device, precision: str) -> Any:
    """bf16 autocast where training used it on a GPU, so evaluation measures the same arithmetic."""
    if device.type == "cuda" and str(precision).startswith("bf16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


# Evaluation speed is quoted only when measured after at least WARMUP_SEGMENTS untimed segments (first calls
# allocate, CUDA kernels load; a compiled model compiles at its first segment with a full memory, so the warm-up
# reaches it) and over at least MIN_TIMED_SECONDS: shorter timings are mostly noise.
WARMUP_SEGMENTS, MIN_TIMED_SECONDS = 2, 1.0


def tokens_per_s(tokens: int, seconds: float) -> float | None:
    """``tokens / seconds``, or None when the timing is too short to mean anything."""
    return round(tokens / seconds, 1) if seconds >= MIN_TIMED_SECONDS else None


def segments_read(n_segments: int, fraction: float) -> int:
    """How many of a split's ``n_segments`` an evaluation of ``fraction`` of it reads: the first ones, at least one
    (every stream's first part, so the tokens read come from all of the split)."""
    return n_segments if fraction >= 1 else max(1, math.ceil(n_segments * fraction))


def split_metrics(model: TransformerXL, data: SplitData, split: str, precision: str = "32-true",
                  fraction: float = 1.0) -> dict[str, Any]:
    """Whole-split perplexity (memory carried) and its speed (tokens/s after an untimed warm-up; None when too
    quick to time). ``fraction`` < 1: over the first part of every evaluation stream only (the streams tile the
    split, so the tokens read still come from all of it); recorded as ``<split>_fraction``."""
    batches = data.batches(split)
    n_segments = segments_read(len(batches), fraction)
    with autocast(model_device(model), precision):
        warmup = max(WARMUP_SEGMENTS, full_memory_steps(model.cfg, batches.seg_len, model.eval_mem_len))
        evaluate(model, (batches[t] for t in range(min(warmup, n_segments))))
        result = evaluate(model, (batches[t] for t in range(n_segments)))
    name = "val" if split == "valid" else split
    unread = batches.n_predicted - result.tokens if fraction < 1 else 0  # targets past the part read
    return {f"{name}_ppl": finite_or_none(result.ppl), f"{name}_loss": finite_or_none(result.loss),
            f"{name}_ppl_batch_mean": finite_or_none(result.batch_mean_ppl),
            f"{name}_tokens": result.tokens,
            f"{name}_untargeted_tokens": batches.tail_tokens + unread,
            f"{name}_eval_tokens_per_s": tokens_per_s(result.tokens, result.seconds),
            f"{name}_eval_seconds": round(result.seconds, 3),
            **({f"{name}_fraction": fraction} if fraction < 1 else {})}


def final_metrics(model: TransformerXL, data: SplitData, precision: str = "32-true", test: bool = True,
                  valid_fraction: float = 1.0) -> dict[str, Any]:
    """Valid and test perplexity and evaluation tokens/s, at the model's evaluation memory and position clamp
    (recorded beside them). ``test=False``: the validation split alone (a search's short retrains);
    ``valid_fraction``: the part of it :func:`split_metrics` reads."""
    out = {**split_metrics(model, data, "valid", precision, valid_fraction),
           **(split_metrics(model, data, "test", precision) if test else {})}
    seconds = out["val_eval_seconds"] + out.get("test_eval_seconds", 0.0)
    out["eval_tokens_per_s"] = tokens_per_s(out["val_tokens"] + out.get("test_tokens", 0), seconds)
    out["eval_mem_len"], out["eval_clamp_len"] = model.eval_mem_len, model.clamp_len
    return out
