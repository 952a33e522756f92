"""``train.compile``: the model under ``torch.compile``, and what compiling did, counted.

A compiled model's graphs have static shapes (``dynamic=False``), and a segment's shapes change while the memory
fills: a graph for each memory length would be compiled (``mem_len / seg_len + 1`` sets), every one but the last
used once. So the segments that fill the memory run eager, and so does a stream's last, shorter segment: one set
of graphs is compiled for each stream shape, training's and evaluation's. Its loss is compiled where its shapes
are static too: a full softmax's always, an adaptive softmax's for batches whose tail clusters are padded to fixed
capacities (:class:`parnas.nn.adaptive.TargetCapacity`, which :func:`compile_model` gives the model: training
batches are grouped with it); other batches (evaluation's, grouped as they come) score their loss eager. Under
``reduce-overhead`` a training step is then CUDA graphs but for clipping, the optimiser and the loss's mean:
eager, the adaptive softmax's loss and its backward are some 66 ops a step at wt2-par's GPU shape, each a kernel
launched from the host.
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
    every later segment of the stream. A model none of whose blocks keeps a memory always has them. (Memories a
    block keeps itself, a compressive memory's, are not looked at: such a model compiles a set of graphs for each
    of their lengths.)"""
    lengths = ([0 if getattr(b, "uses_memory", True) else None for b in model.blocks] if mems is None  # empty
               else [None if m is None else m.size(1) for m, _ in zip(mems, model.blocks)])
    return next((n for n in lengths if n is not None), model.memory_len) >= model.memory_len


def compile_model(model: nn.Module, mode: str, backend: str | Callable[..., Any] = "inductor") -> None:
    """``torch.compile`` the model's forward and loss in place (``mode``: one of ``COMPILE_MODES``; "none" leaves
    it eager; ``backend``: torch.compile's, Inductor but where a test inspects the graphs).

    In place, so parameter names, checkpoints and the model's methods stay what they are. Shapes are static
    (``dynamic=False``), and only a segment whose memory is full (:func:`memory_full`) runs compiled: the
    segments that fill it run eager, where each would compile a set of graphs of its own used once (with a
    memory as long as a segment, as in every preset, one set of graphs where there were two). So does a segment of
    another length than the first compiled of its mode and batch size (an evaluation split's last). An adaptive
    softmax's model gets a ``target_capacity``, with which its training batches' targets are grouped (the tail
    clusters padded to fixed sizes), and its loss is compiled for those batches (:func:`static_loss_shapes`) after
    a forward with a full memory; for any other, eager. So a run compiles all it compiles in its first step with a
    full memory.

    "reduce-overhead" replays the forward and the loss (and their backward) as CUDA graphs. A replay's outputs
    live in the graphs' own memory pool, which the next replay overwrites, so the memory the forward hands the
    next segment is copied out of it (a copy of (B, M, D) per attention block); the hidden states and the loss are
    used up before the next step. On the CPU it compiles as "default" does."""
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
