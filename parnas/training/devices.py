"""The device a run trains on, and the check that this machine has it, made before anything is written.

``train.accelerator`` and ``train.precision`` are checked for their values on any machine when a config is read
(a GPU checkpoint stays readable on a laptop); :func:`check_devices` asks whether *this* machine honours them, at
the start of every command that trains, before Lightning would refuse with a traceback after files were written.
torch is imported only when the answer needs it, so a CPU run's config check stays quick.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from parnas.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from parnas.config import TrainConfig

CUDA_ACCELERATORS = ("gpu", "cuda")


def training_device(train: TrainConfig) -> torch.device:
    """The device Lightning's ``train.accelerator`` picks here (rank 0's): ``cuda`` and ``gpu`` take CUDA
    (``gpu`` falls back to MPS, as Lightning's does), ``auto`` takes CUDA, then MPS, then the CPU."""
    import torch

    accelerator = train.accelerator
    if accelerator in (*CUDA_ACCELERATORS, "auto") and torch.cuda.is_available():
        return torch.device("cuda", 0)
    if accelerator in ("gpu", "mps", "auto") and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def check_devices(train: TrainConfig) -> None:
    """Refuse, with one line (:class:`ConfigError`), a device or precision this machine lacks: a GPU
    asked for where torch sees none, more CUDA processes than CUDA devices, bfloat16 on a GPU without it, CUDA
    graphs (``train.compile=reduce-overhead``) off CUDA."""
    if train.compile == "reduce-overhead":
        where = training_device(train).type
        if where != "cuda":
            raise ConfigError(f"train.compile=reduce-overhead replays CUDA graphs, which need CUDA: this run trains on "
                              f"the {where.upper()}; use train.compile=default (or none)")
    wants_gpu = train.accelerator in (*CUDA_ACCELERATORS, "mps")
    bf16 = train.precision.startswith("bf16")
    if not wants_gpu and not (bf16 and train.accelerator == "auto"):
        return  # the CPU, or auto at full precision: every machine has what it needs
    import torch

    device = training_device(train)
    if wants_gpu and device.type == "cpu":
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        what = "MPS" if train.accelerator == "mps" else "CUDA"
        raise ConfigError(f"train.accelerator={train.accelerator} asks for a GPU, but torch {torch.__version__} "
                          f"({build}) sees no {what} device here; use train.accelerator=cpu (or auto)")
    if train.accelerator == "cuda" and device.type != "cuda":
        raise ConfigError("train.accelerator=cuda asks for a CUDA GPU, but torch sees none here (only MPS); "
                          "use train.accelerator=gpu or auto")
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if train.devices > count:
            raise ConfigError(f"train.devices={train.devices} asks for {train.devices} CUDA processes, but this "
                              f"machine has {count} CUDA device{'s' * (count != 1)}; set train.devices={count} "
                              "or fewer")
        if bf16 and not torch.cuda.is_bf16_supported(including_emulation=False):  # Ampere and newer compute it
            major, minor = torch.cuda.get_device_capability(device)
            raise ConfigError(f"train.precision={train.precision} needs bfloat16, which "
                              f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) does "
                              "not support; use train.precision=16-mixed or 32-true")


def pinned(batch: Any, device: torch.device) -> Any:
    """``batch`` (tensors, possibly nested) with its host tensors in page-locked memory when bound for a CUDA device.
    A copy from pageable memory may first wait for the stream's queued kernels, so the host could not run ahead of
    the GPU by even one step; from pinned memory a ``non_blocking`` copy is queued behind them like a kernel."""
    if device.type != "cuda":
        return batch
    import torch
    from lightning_utilities.core.apply_func import apply_to_collection

    return apply_to_collection(batch, torch.Tensor,
                               lambda t: t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t)
