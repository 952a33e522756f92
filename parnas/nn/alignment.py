"""Matrix operands padded off the CPU to sizes a GPU's fast kernels take.

cuBLAS's fastest tensor-core kernels, and SDPA's fused CUDA kernels, want bf16/fp16 operands whose sizes and row
strides are multiples of 16 bytes, 8 elements (NVIDIA's "Matrix Multiplication Background" guide, Tensor Core
requirements); any other size gets a slower kernel, or SDPA its unfused math path. Three operands of a
Transformer-XL miss it often: a head of d_model / n_heads (Dai et al.'s WikiText-103 base: 41), the position table
with its zero column in front (1 + K wide: odd for every even K, whatever the widths), and the output head's logits
(a shortlist plus one entry per tail cluster: 20,003 at WikiText-103's cutoffs, 252 at wt2-par's). Each is padded
with values that change no result: zero columns in a product's shared dimension, zero columns that are dropped
after it, logits of -inf.

On the CPU nothing is padded: the padding is for a GPU's kernels, and the CPU's figures are the unpadded operands'.
A module's ``pad_multiple`` attribute, where set, overrides the rule (1 pads nothing: how a benchmark times the
unpadded operands beside the padded; 8 on the CPU: how a test checks that padding changes nothing).
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
