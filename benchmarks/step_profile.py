"""Where a step's time goes, by torch's profiler: how busy the device kept, and the kernels (or, on the CPU, the
aten ops) that took the most of it.

A step whose device time is far below its wall time is bound by the host (dispatch and launches: CUDA graphs
and fewer ops are the lever); one whose device time is close to it is bound by its kernels, and the top of the
list says which (attention, the softmax's head, elementwise passes). Where the host's time goes, the step's
phases say (forward, loss, backward, clipping, the optimiser: the ranges :func:`phase` marks in the benchmarks'
steps): under CUDA graphs a forward is a replay, and what is left eager (the loss, the optimiser) shows there.
``gpu_step.py --profile`` prints this for every model it times, after its rounds:

    python benchmarks/gpu_step.py --shape wt103-base --no-supernet --profile
    python benchmarks/gpu_step.py --shape wt2-par --compile reduce-overhead --profile
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

PHASE = "step: "  # the prefix of a phase's range


def phase(name: str) -> AbstractContextManager:
    """The range of a step's phase ``name`` (``forward``, ``loss`` ...), which :func:`summary` times; nothing
    when no profiler runs (a range costs time even then: a timed step is not charged for it)."""
    return record_function(PHASE + name) if torch.autograd._profiler_enabled() else nullcontext()


class Profiled(NamedTuple):
    """Steps under torch's profiler: its events averaged by name, the host's time in each :func:`phase` (us, in
    the order the phases first ran), and the wall time in seconds."""

    averages: list[Any]
    phases: dict[str, float]
    wall: float


def own_time(event: Any, device_type: str) -> float:
    """An averaged profiler event's own time in microseconds: the host's on the CPU; off it, the device's, and only
    for what ran there (kernels, copies, fills). The op that launched a kernel carries that kernel's time as well,
    as its own device time: counted there too, the busy time would be twice the kernels' (torch's own profile
    table sums the device's events alone, as here)."""
    if device_type == "cpu":
        return event.self_cpu_time_total
    if event.device_type == DeviceType.CPU or event.is_user_annotation:
        return 0.0
    return event.self_device_time_total


def profile_steps(run: Callable[[int], Any], steps: int, device_type: str) -> Profiled:
    """``run(steps)`` (which waits for the device before it returns) under the profiler."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run(steps)
        wall = time.perf_counter() - start
    phases: dict[str, float] = {}
    for event in prof.events():  # the host's ranges (a GPU's copy of a range spans its kernels, idle gaps too)
        if event.name.startswith(PHASE) and event.device_type == DeviceType.CPU:
            name = event.name.removeprefix(PHASE)
            phases[name] = phases.get(name, 0.0) + event.cpu_time_total
    return Profiled(list(prof.key_averages()), phases, wall)


# the CUDA runtime's calls by what they queue: how much the host hands the GPU a step (a CUDA graph's replay is one
# call for all its kernels, which is why a step bound by the host gains from one)
HOST_CALLS = {"kernel launches": ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"),
              "CUDA-graph replays": ("cudaGraphLaunch", "cuGraphLaunch"),
              "copies and fills": ("cudaMemcpyAsync", "cudaMemsetAsync")}


def summary(name: str, profiled: Profiled, steps: int, device_type: str, top: int = 10) -> list[str]:
    """Lines for ``name``: wall time a step, the device's (or the aten ops' own) busy time a step and its share;
    off the CPU, the calls a step by which the host queued that work (:data:`HOST_CALLS`); the host's time a step
    in each phase; then the ``top`` kernels (ops) by own time a step. Kernels are what the device ran; on the CPU,
    aten ops."""
    events = profiled.averages
    timed = sorted(((own_time(e, device_type), e.key) for e in events if own_time(e, device_type) > 0), reverse=True)
    if device_type == "cpu":  # a CPU's aten ops nest (linear calls mm): their own times, not their totals, add up
        timed = [(t, key) for t, key in timed if key.startswith("aten::")]
    busy = sum(t for t, _ in timed) / 1e3 / steps  # ms a step
    step_ms = 1e3 * profiled.wall / steps
    what = "device busy" if device_type != "cpu" else "aten ops' own time"
    lines = [f"  {name}: {step_ms:.1f} ms a step (wall, under the profiler), {what} {busy:.1f} ms "
             f"({100 * busy / step_ms:.0f}%)"]
    if device_type != "cpu":
        calls = {what: sum(e.count for e in events if e.key in names) / steps for what, names in HOST_CALLS.items()}
        lines.append("    the host queued it by " + ", ".join(f"{n:,.0f} {what}" for what, n in calls.items()))
    if profiled.phases:
        lines.append("    the host's time a step by phase: " + ", ".join(
            f"{phase} {t / 1e3 / steps:.1f} ms" for phase, t in profiled.phases.items()))
    lines.append(f"    the top {top} {'ops' if device_type == 'cpu' else 'kernels'} a step:")
    for t, key in timed[:top]:
        ms = t / 1e3 / steps
        lines.append(f"    {ms:8.3f} ms  {100 * ms / max(busy, 1e-9):5.1f}%  {key[:100]}")
    return lines
