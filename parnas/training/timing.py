"""How a device's work is timed (CUDA events on a GPU, the wall clock elsewhere), a phase that runs long said in one
progress line so that no run sits silent, and a device that fails mid-timing said in one line.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from parnas.errors import ParnasError

PROGRESS_AFTER_S = 5.0  # a phase that has run this long says what it does, once
clock = time.monotonic  # what a phase's length is read from

# what a failed or vanished accelerator raises (torch's AcceleratorError, or the CUDA runtime's messages)
DEVICE_FAILURES = ("CUDA error", "CUDA driver", "no CUDA GPUs are available", "device-side assert",
                   "unspecified launch failure", "CUDA-capable device")


def stderr_line(line: str) -> None:
    print(f"parnas: {line}", file=sys.stderr, flush=True)


class Phase:
    """A phase of ``total`` units of work (models warmed up, rounds timed). ``done(k)`` after each unit: once the
    phase has run over ``after`` seconds, ``emit`` gets one line, ``<what>: <k> of <total> <unit> done (<s> s so
    far)``, and no more. ``emit`` None says nothing."""

    def __init__(self, what: str, total: int, unit: str, emit: Callable[[str], None] | None,
                 after: float = PROGRESS_AFTER_S) -> None:
        self.what, self.total, self.unit, self.emit, self.after = what, total, unit, emit, after
        self.start, self.said = clock(), False

    def done(self, k: int) -> None:
        if self.emit is None or self.said:
            return
        elapsed = clock() - self.start
        if elapsed > self.after:
            self.said = True
            self.emit(f"{self.what}: {k} of {self.total} {self.unit} done ({elapsed:.0f} s so far)")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_ms(work: Callable[[], None], device: torch.device) -> float:
    """Milliseconds ``work()`` takes on ``device``: on CUDA between two CUDA events around it (what the GPU's
    stream took, launch gaps included, no host clock), elsewhere by the host's clock around synchronised work."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    sync(device)
    begin = time.perf_counter()
    work()
    sync(device)
    return (time.perf_counter() - begin) * 1e3


def is_device_failure(error: BaseException) -> bool:
    """Whether ``error`` is the accelerator failing (lost, reset, faulted) rather than a bug in the work."""
    return isinstance(error, torch.AcceleratorError) or (
        isinstance(error, RuntimeError) and any(s in str(error) for s in DEVICE_FAILURES))


@contextmanager
def device_failures_said(what: str, device: torch.device | str) -> Iterator[None]:
    """Turns a device that fails or runs out of memory during ``what`` into one line (:class:`ParnasError`), so a
    caller that writes its result only at the end writes nothing; any other error goes on as it is."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise ParnasError(f"{what}: {device} ran out of memory; nothing was written (lower data.batch_size or "
                          "data.seg_len)") from None
    except RuntimeError as e:
        if not is_device_failure(e):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ParnasError(f"{what}: {device} failed ({first}); nothing was written") from None
