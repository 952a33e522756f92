"""Where a step's time goes, by torch's profiler: how busy the device kept, and the kernels (or, on the CPU, the
aten ops) that took the most of it.

A step whose device time is far below its wall time is bound by the host (dispatch and launches: CUDA graphs
and fewer ops are the lever); one whose device time is close to it is bound by its kernels, and the top of the
list says which (attention, the softmax's head, elementwise passes). ``gpu_step.py --profile`` prints this for
every model it times, after its rounds:

    python benchmarks/gpu_step.py --shape wt103-base --no-supernet --profile
    python benchmarks/gpu_step.py --shape wt2-par --compile reduce-overhead --profile
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


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


def profile_steps(run: Callable[[int], Any], steps: int, device_type: str) -> tuple[list[Any], float]:
    """``run(steps)`` (which waits for the device before it returns) under the profiler: the averaged events and
    the wall time in seconds."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run(steps)
        wall = time.perf_counter() - start
    return list(prof.key_averages()), wall


# the CUDA runtime's calls by what they queue: how much the host hands the GPU a step (a CUDA graph's replay is one
# call for all its kernels, which is why a step bound by the host gains from one)
HOST_CALLS = {"kernel launches": ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"),
              "CUDA-graph replays": ("cudaGraphLaunch", "cuGraphLaunch"),
              "copies and fills": ("cudaMemcpyAsync", "cudaMemsetAsync")}


def summary(name: str, events: list[Any], wall: float, steps: int, device_type: str, top: int = 10) -> list[str]:
    """Lines for ``name``: wall time a step, the device's (or the aten ops' own) busy time a step and its share;
    off the CPU, the calls a step by which the host queued that work (:data:`HOST_CALLS`); then the ``top``
    kernels (ops) by own time a step. Kernels are what the device ran; on the CPU, aten ops."""
    timed = sorted(((own_time(e, device_type), e.key) for e in events if own_time(e, device_type) > 0), reverse=True)
    if device_type == "cpu":  # a CPU's aten ops nest (linear calls mm): their own times, not their totals, add up
        timed = [(t, key) for t, key in timed if key.startswith("aten::")]
    busy = sum(t for t, _ in timed) / 1e3 / steps  # ms a step
    step_ms = 1e3 * wall / steps
    what = "device busy" if device_type != "cpu" else "aten ops' own time"
    lines = [f"  {name}: {step_ms:.1f} ms a step (wall, under the profiler), {what} {busy:.1f} ms "
             f"({100 * busy / step_ms:.0f}%); the top {top} {'ops' if device_type == 'cpu' else 'kernels'} a step:"]
    if device_type != "cpu":
        calls = {what: sum(e.count for e in events if e.key in names) / steps for what, names in HOST_CALLS.items()}
        lines.insert(1, "    the host queued it by " + ", ".join(f"{n:,.0f} {what}" for what, n in calls.items()))
    for t, key in timed[:top]:
        ms = t / 1e3 / steps
        lines.append(f"    {ms:8.3f} ms  {100 * ms / max(busy, 1e-9):5.1f}%  {key[:100]}")
    return lines
