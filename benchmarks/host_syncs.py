"""Host syncs in one training step: which lines make the host wait for the device, and how often per step.

:class:`SyncRecorder` (a ``TorchFunctionMode``) records every call that needs a tensor's value on the host:
``.item()``, ``.tolist()``, ``.cpu()``/``.to("cpu")``, ``.numpy()``, ``bool()``/``int()``/``float()`` of a
tensor, ``nonzero`` and the ops built on it (``masked_select``, ``unique``, boolean-mask indexing), ``bincount``
(on CUDA it reads its input's range back), with the
first line outside torch that made it; and every tensor made from Python numbers on a named device
(``torch.tensor(x, device=...)``, ``new_tensor``, ``as_tensor``: on a GPU an upload from pageable memory
that waits for the stream, as Lightning's ``self.log`` of a Python number is). On a CPU nothing waits, but
on a GPU each such call stops the host until the queue has run, so the next step cannot be queued while
this one computes: this finds them without a GPU. On CUDA, ``torch.cuda.set_sync_debug_mode`` counts what
really waited (tests/test_gpu.py checks the two agree). Explicit ``torch.cuda.synchronize()`` calls are not
torch functions and are not seen here.

    python benchmarks/host_syncs.py              # tiny shapes: the model's step, `parnas train`'s, a search's

Three steps are recorded, each once the memory is full: the fixed model's bare step (forward, adaptive
softmax loss, backward, clipping, Adam), with its targets grouped on the host as the loop does and without;
one whole Lightning step of ``parnas train`` (batch start to the next
batch start: the loop, callbacks, logging); one step of a search with a latency budget.
"""

from __future__ import annotations

import sys
import tempfile
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

_TORCH_DIR = str(Path(torch.__file__).parent)
_REPO = Path(__file__).resolve().parents[1]  # call sites are named relative to the repository
# Calls that read a value back to the host, whatever tensor they are called on.
SYNCING = {Tensor.item, Tensor.tolist, Tensor.cpu, Tensor.numpy, Tensor.__bool__, Tensor.__int__,
           Tensor.__float__, Tensor.__index__, Tensor.nonzero, torch.nonzero, Tensor.masked_select,
           torch.masked_select, Tensor.unique, torch.unique, torch.argwhere, Tensor.argwhere, Tensor.equal,
           torch.equal, torch.allclose, Tensor.allclose, torch.is_nonzero, Tensor.is_nonzero,
           torch.bincount, Tensor.bincount}  # bincount on CUDA reads its input's min and max back to size its output
# Inside torch, only what reads a value the device computed counts. torch's optimisers keep their step
# counters on the host unless fused or capturable (their .item() waits for nothing), and .to(device) moves
# data to the device the step runs on (on a CPU-only machine that device is "cpu": not a read-back).
_HOST_SIDE = (str(Path(_TORCH_DIR) / "optim"),)
# Lightning hands a batch to this hook on the host, before it moves it to the device: what it reads is host data.
_HOST_HOOKS = ("on_before_batch_transfer",)


def _uploads(func: Any, args: tuple, kwargs: dict) -> bool:
    """A tensor made from host data (a Python number or list) on a device named by the call: on a GPU,
    ``torch.tensor(x, device="cuda")`` copies from pageable memory and then waits for the stream (pytorch
    issues 120996 and 190217), as Lightning's ``self.log`` of a Python number does. Made without a device it
    stays on the host and is no upload."""
    if func in (torch.tensor, torch.as_tensor, torch.scalar_tensor):
        data = args[0] if args else kwargs.get("data")
        return kwargs.get("device") is not None and not isinstance(data, Tensor)
    return func is Tensor.new_tensor and not isinstance(args[1] if len(args) > 1 else kwargs.get("data"), Tensor)


def _reads_back(func: Any, args: tuple, kwargs: dict) -> bool:
    if func in SYNCING or _uploads(func, args, kwargs):
        return True
    if func is Tensor.to:  # to the host, named as such ("cpu"); a torch.device is where the step runs
        return any(isinstance(t, str) and t == "cpu" for t in [*args[1:], kwargs.get("device")])
    if func is Tensor.__getitem__:  # x[mask]: the result's size is the mask's count
        index = args[1] if len(args) > 1 else None
        items = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, Tensor) and i.dtype == torch.bool for i in items)
    return False


def _short(filename: str) -> str:
    """A path as the repository or the installed package names it (``parnas/training/task.py``)."""
    path = Path(filename)
    if "site-packages" in path.parts:
        return "/".join(path.parts[path.parts.index("site-packages") + 1:])
    if path.is_relative_to(_REPO):
        return path.relative_to(_REPO).as_posix()
    return "/".join(path.parts[-2:])


def call_site(depth: int = 6) -> str | None:
    """``path:line (function)`` of the innermost frame outside torch and this file, and for a library's
    line its ``depth - 1`` callers (``<-``); None for a host-side read inside torch (see ``_HOST_SIDE``) or in
    Lightning's hook on the batch before it moves to the device (``_HOST_HOOKS``)."""
    frames = [f for f in reversed(traceback.extract_stack()[:-2]) if f.filename != __file__]
    if frames and frames[0].filename.startswith(_HOST_SIDE) or any(f.name in _HOST_HOOKS for f in frames):
        return None
    outside = [f for f in frames if not f.filename.startswith(_TORCH_DIR)]
    if not outside:
        return "?"
    chain = outside[:depth] if "site-packages" in Path(outside[0].filename).parts else outside[:1]
    names = [f"{_short(f.filename)}:{f.lineno} ({f.name})" for f in chain]
    return " <- ".join(names if len(names) < 3 else [names[0], "...", names[-1]])


class SyncRecorder(TorchFunctionMode):
    """Inside ``with SyncRecorder() as rec:``, ``rec.sites`` counts the host syncs by call site."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _reads_back(func, args, kwargs):
            site = call_site()
            if site is not None:
                self.sites[f"{getattr(func, '__name__', func)} at {site}"] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.sites.values())


class RecordStep(pl.Callback):
    """Records one whole loop iteration of a Lightning fit: from the start of batch ``step`` (optimiser steps
    taken) to the start of the next, or to the end of training. With ``cuda``, CUDA's own sync counter
    (``torch.cuda.set_sync_debug_mode("warn")``) runs over the same iteration, and ``cuda_waits`` lists the
    warnings of the operations that made the host wait."""

    def __init__(self, step: int, cuda: bool = False) -> None:
        self.step, self.recorder, self._active = step, SyncRecorder(), False
        self.cuda, self.cuda_waits, self._warnings = cuda, [], warnings.catch_warnings(record=True)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._active:
            self._stop()
        elif trainer.global_step == self.step:
            self.recorder.__enter__()
            if self.cuda:
                self._caught = self._warnings.__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
            self._active = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active:
            self._stop()

    def _stop(self) -> None:
        self.recorder.__exit__(None, None, None)
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(None, None, None)
            # only what waited: setting the mode also warns, once a process, that it is a prototype
            self.cuda_waits = [str(w.message) for w in self._caught
                               if "called a synchronizing CUDA operation" in str(w.message)]
        self._active = False


def model_step_sites(model: torch.nn.Module, tokens: Tensor, clip: float = 0.25,
                     host_groups: bool = True) -> SyncRecorder:
    """Host syncs of one bare training step of ``model`` on ``tokens`` (B, 2L+1): a first step fills the
    memory, the second (forward, loss, backward, clipping, Adam) is recorded. ``host_groups``: the targets are
    grouped for the output head before the step, as the training loop does on the host (else the loss groups
    them on the device)."""
    from parnas.training.task import adam

    optimizer = adam(model.parameters(), lr=1e-3)
    L = (tokens.size(1) - 1) // 2
    mems, recorder = None, SyncRecorder()
    y = tokens[:, L + 1:2 * L + 1]
    groups = model.group_targets(y) if host_groups else None  # made on the host, before the recorded step
    for t, record in ((0, False), (L, True)):
        with recorder if record else torch.no_grad():
            h, mems = model(tokens[:, t:t + L], mems)
            if record:
                loss = model.nll(h, y, groups).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
    return recorder


def _print(title: str, recorder: SyncRecorder) -> None:
    print(f"\n{title}: {recorder.total} host sync(s)")
    for site, count in sorted(recorder.sites.items()):
        print(f"  {count:3d}  {site}")


def main() -> int:
    from parnas.config import load_config
    from parnas.nn.model import build_fixed_model
    from parnas.strategies.costs import CostModel
    from parnas.strategies.search import build_search
    from parnas.training.data_module import SegmentData
    from parnas.training.task import LanguageModelTask
    from parnas.training.trainer import build_trainer

    sys.path.insert(0, str(Path(__file__).parent))
    from train_step import zipf_ids

    vocab, step = 1000, 3
    cfg = load_config("tiny", ["train.accelerator=cpu", f"train.max_steps={step + 2}",
                               "search.par-gumbel-darts.latency_budget=0.9"])
    torch.manual_seed(0)
    B, L = cfg.data.batch_size, cfg.data.seg_len
    model = build_fixed_model(cfg.model, vocab)
    tokens = zipf_ids(B * (2 * L + 1), vocab).view(B, -1)
    _print(f"the fixed model's step ({cfg.model.n_blocks} blocks, cutoffs {list(cfg.model.cutoffs)}), its targets "
           "grouped on the host as the training loop does", model_step_sites(model, tokens))
    _print("the same step, its targets grouped by the loss", model_step_sites(model, tokens, host_groups=False))

    ids = zipf_ids(B * L * 40, vocab).numpy()
    splits = {"train": ids, "valid": ids[:B * L * 4], "test": ids[:B * L * 4]}
    with tempfile.TemporaryDirectory() as tmp:
        task = LanguageModelTask(cfg.train)
        task.set_model(build_fixed_model(cfg.model, vocab))
        record = RecordStep(step)
        trainer = build_trainer(cfg.train, Path(tmp) / "train", enable_progress_bar=False)
        trainer.callbacks = [*trainer.callbacks, record]
        trainer.fit(task, datamodule=SegmentData(splits, B, B, L))
        _print(f"one Lightning step of `parnas train` (step {step + 1}, callbacks and logging included)",
               record.recorder)

        costs = CostModel({"attention": 3.0, "dense": 1.0, "identity": 0.0}, 1.0, "ms/step", cfg.model.n_blocks)
        search = build_search(cfg, splits, vocab, Path(tmp) / "search", costs=costs)
        record = RecordStep(step)
        search.trainer.callbacks.append(record)
        search.run()
        _print(f"one step of a search (joint, latency budget {cfg.search.settings.latency_budget})", record.recorder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
