"""``train.compile``: the model under ``torch.compile``, and what compiling did, counted.

Graphs have static shapes, and a segment's shapes change while the memory fills: a set of graphs for each memory
length would be compiled and used once. So only segments with a full memory, of the first length seen per mode
and batch size, run compiled (:func:`compile_model`); the loss too where its shapes are static.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from parnas.nn.adaptive import TargetCapacity, TargetGroups
from parnas.nn.model import Memory


def static_loss_shapes(model: nn.Module, groups: TargetGroups | None) -> bool:
    """Whether ``model.nll`` of a batch grouped as ``groups`` has the same shapes as every other such batch's of
    the same size: a full softmax's loss (no groups needed), or groups padded to fixed capacities."""
    return groups.valid is not None if groups is not None else not getattr(model, "target_capacity", None)


def memory_full(model: nn.Module, mems: Memory | None) -> bool:
    """Whether ``mems`` holds as many states as ``model`` keeps (:attr:`TransformerXL.memory_len`): the shapes of
    every later segment of the stream. Memories a block keeps itself (a compressive memory's) are not looked at."""
    lengths = ([0 if getattr(b, "uses_memory", True) else None for b in model.blocks] if mems is None  # empty
               else [None if m is None else m.size(1) for m, _ in zip(mems, model.blocks)])
    return next((n for n in lengths if n is not None), model.memory_len) >= model.memory_len


def compile_model(model: nn.Module, mode: str, backend: str | Callable[..., Any] = "inductor") -> None:
    """``torch.compile`` the model's forward and loss in place, so parameter names, checkpoints and methods stay
    (``mode``: one of ``COMPILE_MODES``, "none" leaves it eager; ``backend``: Inductor but where a test inspects
    the graphs). Only a segment whose memory is full (:func:`memory_full`), of the first length compiled for its
    mode and batch size, runs compiled; the others run eager. An adaptive softmax's model gets a
    ``target_capacity`` (its training batches' tail clusters padded to fixed sizes), so its loss compiles too
    (:func:`static_loss_shapes`). A run thus compiles all it compiles in its first step with a full memory.

    Under "reduce-overhead" a replay's outputs live in the CUDA graphs' pool, which the next replay overwrites: the
    memory handed to the next segment is copied out of it ((B, M, D) per attention block)."""
    if mode == "none":
        return
    if getattr(getattr(model, "head", None), "cutoffs", None):
        model.target_capacity = TargetCapacity()
    options: dict[str, Any] = dict(backend=backend, mode=None if mode == "default" else mode, dynamic=False)
    eager_nll, compiled_nll = model.nll, torch.compile(model.nll, **options)
    eager_forward, compiled_forward = model.forward, torch.compile(model.forward, **options)

    steady = False  # whether the last forward ran compiled: its loss, too, does (where its shapes are static)
    seg_len: dict[tuple[bool, int], int] = {}  # (training, batch) -> the segment length compiled for

    def nll(h: Tensor, y: Tensor, groups: TargetGroups | None = None) -> Tensor:
        return (compiled_nll if steady and static_loss_shapes(model, groups) else eager_nll)(h, y, groups)

    def forward(x: Tensor, mems: Memory | None = None) -> tuple[Tensor, Memory]:
        nonlocal steady
        B, L = x.shape
        steady = memory_full(model, mems) and seg_len.setdefault((model.training, B), L) == L
        if not steady:
            return eager_forward(x, mems)
        h, new_mems = compiled_forward(x, mems)
        if mode == "reduce-overhead":  # out of the graphs' pool, which the next replay overwrites
            new_mems = [None if m is None else m.clone() for m in new_mems]
        return h, new_mems

    model.nll, model.forward = nll, forward


def compile_counts() -> tuple[int, int, int]:
    """What ``torch.compile`` has done in this process so far, by Dynamo's counters (which torch's own reports
    read): graphs compiled, graph breaks, and graphs that Inductor left without CUDA graphs where they were asked
    for (``reduce-overhead``: an op it cannot capture, a tensor on the CPU, an input the graph mutates ...)."""
    from torch._dynamo.utils import counters

    return (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
            counters["inductor"]["cudagraph_skips"])


def compiled_since(before: tuple[int, int, int], mode: str) -> str:
    """What was compiled since :func:`compile_counts` gave ``before``, in words: ``2 graphs, no graph breaks``
    and, for ``reduce-overhead``, whether every graph became CUDA graphs. A skip is easy to miss, and costs the
    most: the step then launches each kernel from the host, the overhead CUDA graphs are there to remove."""
    graphs, breaks, skips = (now - then for now, then in zip(compile_counts(), before))
    words = [f"{graphs} graph{'s' * (graphs != 1)}",
             f"{breaks or 'no'} graph break{'s' * (breaks != 1)}" + (" (TORCH_LOGS=graph_breaks says where)"
                                                                     if breaks else "")]
    if mode == "reduce-overhead":
        words.append(f"CUDA graphs skipped {skips} time{'s' * (skips != 1)}: those parts launch each kernel from "
                     "the host (Inductor's warning says why)" if skips else "replayed as CUDA graphs")
    return ", ".join(words)
