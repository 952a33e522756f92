"""``--dry-run``: what a configuration costs before any data is read or memory allocated.

The model is built on PyTorch's ``meta`` device (shapes, no storage): its parameters are counted
exactly, tied tensors once. Training FLOPs per token are counted by torch's ``FlopCounterMode`` over a
forward and backward of one block of each kind, on meta tensors at the run's batch, segment and full
memory (the matrix products torch counts; a supernet runs every candidate of every block; a ``ut`` block all
its ``model.act_max_steps`` steps, its bound, since when it halts depends on the data), plus the
embedding projections and output head counted from their shapes, the adaptive softmax's tail
clusters weighted by the fraction of targets a Zipf (1/rank) law puts in them (the real fraction
depends on the corpus, which a dry run does not read). Memory is :func:`parnas.training.memory.estimate_memory`'s
lower bound. The vocabulary is ``data.vocab_size``: the tokenizer is not built.

A dry run refuses what the real run refuses from the same settings before it reads data or builds anything
(:func:`check_plan`: the device, the cutoffs against the vocabulary, the memory), in the same one line: a plan it
prints is one the run gets past. What needs the corpus (a segment longer than a split) is left to the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from parnas.architecture import layout_string
from parnas.config import Config, DataConfig, ModelConfig, cluster_widths
from parnas.kinds import make_block
from parnas.nn.alignment import set_pad_multiple
from parnas.nn.blocks import Keeper
from parnas.nn.model import build_fixed_model
from parnas.training.devices import check_devices
from parnas.training.memory import check_memory, estimate_memory, size


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def block_train_flops(kind: str, cfg: Config) -> float:
    """FLOPs of one block's forward and backward per trained token, counted by torch on meta tensors."""
    from torch.utils.flop_counter import FlopCounterMode

    m, B, L = cfg.model, cfg.data.batch_size, cfg.data.seg_len
    with torch.device("meta"):
        block = make_block(kind, m).train()
        set_pad_multiple(block, 1)  # the model's FLOPs: not what padding its operands for a GPU adds
        h = torch.empty(B, L, m.d_model, requires_grad=True)
        mem, pos = torch.empty(B, m.mem_len, m.d_model), torch.empty(m.mem_len + L, m.d_model)
    if isinstance(block, Keeper):  # a block that keeps state of its own (compressive): empty memories
        block.memory = [torch.empty(B, 0, m.d_model, device="meta") for _ in range(block.n_memories)]
    with FlopCounterMode(display=False) as counter:
        block(h, mem, pos).sum().backward()
    return counter.get_total_flops() / (B * L)


def zipf_fractions(vocab_size: int, cutoffs: Sequence[int]) -> list[float]:
    """The fraction of Zipf-distributed targets in each tail cluster."""
    weights = 1.0 / np.arange(1, vocab_size + 1)
    edges = [*cutoffs, vocab_size]
    return [float(weights[a:b].sum() / weights.sum()) for a, b in zip(edges, edges[1:])]


def head_train_flops(m: ModelConfig, vocab_size: int) -> float:
    """Embedding projections and output head, forward and backward (3 x forward), per trained token."""
    if not m.cutoffs:
        return 3 * 2 * m.d_model * vocab_size
    edges = [0, *m.cutoffs, vocab_size]
    sizes = [b - a for a, b in zip(edges, edges[1:])]
    widths = cluster_widths(m.d_model, len(sizes), m.div_value)
    fractions = [1.0 - sum(zipf_fractions(vocab_size, m.cutoffs)), *zipf_fractions(vocab_size, m.cutoffs)]
    projected = m.adaptive_input or m.tie_weights
    head = 2 * widths[0] * (sizes[0] + len(m.cutoffs)) + (2 * m.d_model * widths[0] if projected and m.div_value > 1
                                                          else 0)
    tails = sum(p * 2 * (m.d_model * d + d * s) for p, d, s in zip(fractions[1:], widths[1:], sizes[1:]))
    if projected and m.div_value == 1:
        tails = sum(p * 2 * m.d_model * s for p, s in zip(fractions[1:], sizes[1:]))
    embedding = sum(p * 2 * m.d_model * d for p, d in zip(fractions, widths)) if m.adaptive_input and \
        m.div_value > 1 else 0.0
    return 3 * (head + tails + embedding)


def planned_vocabulary(data: DataConfig, recorded: int | None = None) -> int:
    """The vocabulary the run will have, without reading its corpus: SentencePiece trains exactly
    ``data.vocab_size`` pieces; a word or character vocabulary is the corpus's (``data.vocab_size`` is ignored
    then), which an architecture's record knows (``recorded``) and ``data.vocab_size`` otherwise stands in for."""
    if data.tokenizer == "sentencepiece" or recorded is None:
        return data.vocab_size
    return recorded


def check_plan(cfg: Config, vocab_size: int, blocks: Sequence[Sequence[str]]) -> None:
    """Raise the ConfigError the real run would, for the checks it makes from its settings before it builds
    anything: a device or precision this machine lacks, cutoffs not below the vocabulary, training that does not
    fit this machine's memory (the same functions the run calls, so the same line)."""
    check_devices(cfg.train)
    cfg.model.check_vocab(vocab_size)
    check_memory(cfg, vocab_size, blocks)


def dry_run(cfg: Config, blocks: Sequence[Sequence[str]], what: str) -> str:
    """The report of ``--dry-run``, after the run's own refusals (:func:`check_plan`): ``blocks`` holds each
    block's kinds (one for a fixed model, the candidates for a search's supernet); ``what`` names the run
    (``transformer-xl``, ``architecture.json``, ``supernet``)."""
    m, vocab = cfg.model, cfg.data.vocab_size
    check_plan(cfg, vocab, blocks)
    with torch.device("meta"):
        body = build_fixed_model(replace(m, blocks=()), vocab, ["identity"] * m.n_blocks)  # embedding, head, norm
        per_kind = {kind: _params(make_block(kind, m)) for kind in dict.fromkeys(k for b in blocks for k in b)}
    embedding = _params(body.embed)
    shared = {id(p) for p in body.embed.parameters()}
    head = sum(p.numel() for p in body.head.parameters() if id(p) not in shared) + _params(body.final_norm)
    counts = {kind: sum(kind in b for b in blocks) for kind in per_kind}
    shared_kinds = {k for k in per_kind if m.shares_weights(k)}
    block_params = sum(per_kind[k] * (1 if k in shared_kinds else counts[k]) for k in per_kind)
    if m.share_position_bias and counts.get("attention", 0) > 1:  # u and v once for all attention blocks
        block_params -= (counts["attention"] - 1) * 2 * m.d_model
    total = embedding + head + block_params
    flops = {k: block_train_flops(k, cfg) for k in per_kind if k != "identity"}
    train_flops = head_train_flops(m, vocab) + sum(flops[k] * counts[k] for k in flops)
    estimate = estimate_memory(cfg, vocab, blocks)
    layout = layout_string([b[0] for b in blocks]) if all(len(b) == 1 for b in blocks) else \
        f"{m.n_blocks} blocks choosing among {', '.join(blocks[0])}"
    kinds = ", ".join(f"{k} {counts[k]} x {per_kind[k]:,}" + (" (one shared module)" if k in shared_kinds else "")
                      for k in per_kind)
    return "\n".join([
        f"{what}: {layout}; vocabulary {vocab:,} (data.vocab_size: no corpus read), d_model {m.d_model}, "
        f"batch {cfg.data.batch_size} x segment {cfg.data.seg_len}, memory {m.mem_len}",
        f"  parameters {total:,}: embedding {embedding:,}, output head {head:,}"
        f"{' (its tied weights counted with the embedding)' if m.tie_weights else ''}, blocks {block_params:,} "
        f"({kinds})",
        f"  training FLOPs per token {train_flops / 1e6:,.4g} M (forward + backward, matrix products"
        + ("; the adaptive softmax's tail clusters at Zipf frequencies)" if m.cutoffs else ")"),
        f"  memory at least {size(estimate.total)} per process: parameters, gradients and Adam "
        f"{size(estimate.parameter_bytes)}, activations {size(estimate.activation_bytes)} "
        f"({cfg.train.precision})",
        "  dry run: nothing read, allocated or written",
    ])
