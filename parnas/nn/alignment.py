"""Matrix operands padded off the CPU to sizes a GPU's fast kernels take.

Tensor-core and SDPA's fused kernels want bf16/fp16 sizes in multiples of 8 elements; else a slower kernel runs.
A head of d_model / n_heads (41 in Dai et al.'s base), the position table (1 + K wide) and the output head's logits
often miss it, so each is padded with values that change no result (zero columns, logits of -inf). Nothing is
padded on the CPU. A module's ``pad_multiple``, where set, overrides the rule (1: none; 8 on the CPU in tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PAD_MULTIPLE = 8  # elements: 16 bytes of bf16


def pad_multiple(module: nn.Module, device: torch.device) -> int:
    """The multiple ``module`` pads its operands to on ``device``: its ``pad_multiple`` if not None, else
    :data:`PAD_MULTIPLE` off the CPU and 1 on it."""
    chosen = getattr(module, "pad_multiple", None)
    if chosen is not None:
        return chosen
    return 1 if device.type == "cpu" else PAD_MULTIPLE


def set_pad_multiple(model: nn.Module, multiple: int | None) -> None:
    """``pad_multiple`` of every module in ``model`` that pads (None: the rule again). Model FLOPs are counted
    with 1: what the padding adds is work a GPU does, not the model's."""
    for module in model.modules():
        if hasattr(type(module), "pad_multiple"):
            module.pad_multiple = multiple


def padded_logits(h: Tensor, weight: Tensor, bias: Tensor | None, multiple: int) -> Tensor:
    """``F.linear(h, weight, bias)`` with its columns padded to a multiple of ``multiple`` with -inf.

    A log-softmax over the padded row gives each real column the unpadded one's value (exp(-inf) adds 0 to the
    row's sum) and no target falls on a padded column, so a loss is unchanged, and so is every gradient: a padded
    column's softmax, its whole gradient, is 0. The product's output then has rows of an aligned length, as its
    backward's operands do. h (N, D), weight (C, D), bias (C,) -> (N, C + pad)"""
    pad = -weight.size(0) % multiple
    if not pad:
        return F.linear(h, weight, bias)
    if bias is None:
        bias = weight.new_zeros(weight.size(0))
    return F.linear(h, F.pad(weight, (0, 0, 0, pad)), F.pad(bias, (0, pad), value=float("-inf")))
