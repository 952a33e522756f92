"""``--dry-run``: what a configuration costs before any data is read or memory allocated.

Parameters are counted exactly on PyTorch's ``meta`` device (tied tensors once); training FLOPs per token by
torch's ``FlopCounterMode`` over one block of each kind at the run's shapes (a supernet runs every candidate, a
``ut`` block all its ``model.act_max_steps``), plus the embedding and head from their shapes, the adaptive
softmax's tail clusters weighted by a Zipf law (a dry run reads no corpus; the vocabulary is
``data.vocab_size``). Memory is :func:`parnas.training.memory.estimate_memory`'s lower bound. Where a latency
table prices the run's shapes (a search's ``search.latency_table``, else this device's cache), the steps'
time: eager steps, so a compiled run's figure is an upper bound.

A dry run refuses what the real run refuses from the same settings before it reads data (:func:`check_plan`),
in the same one line: a plan it prints is one the run gets past.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from parnas.architecture import layout_string
from parnas.config import Config, DataConfig, ModelConfig, cluster_widths
from parnas.data.corpora import default_cache_dir
from parnas.kinds import make_block
from parnas.nn.alignment import set_pad_multiple
from parnas.nn.blocks import Keeper
from parnas.nn.model import build_fixed_model
from parnas.training.devices import check_devices, training_device
from parnas.training.latency_table import LatencyTable, read_table, shape_differences, table_key
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
    return data.vocab_size if data.tokenizer == "sentencepiece" or recorded is None else recorded


def check_plan(cfg: Config, vocab_size: int, blocks: Sequence[Sequence[str]]) -> None:
    """Raise the ConfigError the real run would, for the checks it makes from its settings before it builds
    anything: a device or precision this machine lacks, cutoffs not below the vocabulary, training that does not
    fit this machine's memory (the same functions the run calls, so the same line)."""
    check_devices(cfg.train)
    cfg.model.check_vocab(vocab_size)
    check_memory(cfg, vocab_size, blocks)


def run_length(cfg: Config) -> tuple[int, int]:
    """(optimiser steps, tokens trained on) of a run: the batch is the whole step's, split across processes."""
    steps = cfg.train.stop_at or cfg.train.max_steps
    return steps, steps * cfg.data.step_tokens


def cached_table(key: dict, folder: Path) -> LatencyTable | None:
    """The newest table in the latency cache ``folder`` that prices ``key``'s device and shapes, its kinds and the
    training step, at any thread count (a dry run does not choose the run's threads); None if there is none.
    Reads only: the run itself checks, refreshes or removes cached tables."""
    def shapes(of: dict) -> dict:
        return {k: v for k, v in of.items() if k not in ("kinds", "threads")}

    try:
        files = sorted(folder.glob("*.json"), key=lambda f: f.stat().st_mtime_ns, reverse=True)
    except OSError:
        return None
    for file in files:
        try:
            table = read_table(file)
            if shapes(table.key) == shapes(key) and set(key["kinds"]) <= set(table.key["kinds"]) \
                    and "train" in table.modes:
                return table
        except Exception:  # noqa: BLE001 -- unreadable, damaged or another format: not this run's table
            continue
    return None


def run_table(cfg: Config, blocks: Sequence[Sequence[str]]) -> tuple[LatencyTable, str] | None:
    """The latency table that prices this run's steps and where it came from: a search's (several candidates a
    block) ``search.latency_table`` when its shapes are the run's, else the cache's for this machine's device."""
    kinds = sorted({k for b in blocks for k in b} | {"identity"})
    device = training_device(cfg.train)
    key = table_key(cfg, cfg.data.vocab_size, kinds, torch.device(device))
    given = cfg.search.latency_table if any(len(b) > 1 for b in blocks) else None
    if given:
        try:
            table = read_table(Path(given))
        except Exception:  # noqa: BLE001 -- the budget's own check names what is wrong with the file
            return None
        differs = shape_differences(table.key, key)
        usable = not differs and set(kinds) <= set(table.key["kinds"])
        return (table, f"search.latency_table {given}") if usable else None
    try:  # the folder of parnas.training.latency_cache.cache_path, named without importing the timing code
        table = cached_table(key, default_cache_dir() / "latency")
    except Exception:  # noqa: BLE001 -- a cache folder that cannot be named: no table
        return None
    return None if table is None else (table, "the latency cache")


def expected_time(cfg: Config, blocks: Sequence[Sequence[str]], steps: int) -> str:
    """One line: the time ``steps`` training steps take by the run's latency table (:func:`run_table`), or that
    no table prices them."""
    found = run_table(cfg, blocks)
    if found is None:
        return ("  expected time: no latency table for this device at these shapes (`parnas latency` with the same "
                "settings times one on the device; a search may name one timed elsewhere, search.latency_table)")
    table, source = found
    ms = table.predict([k for b in blocks for k in b if k != "identity"])
    eager = "eager steps" + (f"; train.compile={cfg.train.compile} is faster" if cfg.train.compile != "none" else "")
    supernet = ", every candidate of every block" if any(len(b) > 1 for b in blocks) else ""
    return (f"  expected time {clock(steps * ms / 1000)}: {steps:,} steps x {ms:.2f} ms on {table.key['device']} "
            f"({source}{supernet}; {eager}; validation, compiling and start-up not counted)")


def clock(seconds: float) -> str:
    """``seconds`` as h:mm:ss (m:ss under an hour)."""
    whole = round(seconds)
    h, m, s = whole // 3600, whole // 60 % 60, whole % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


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
    head = sum(p.numel() for p in body.head.parameters() if id(p) not in shared)
    counts = {kind: sum(kind in b for b in blocks) for kind in per_kind}
    shared_kinds = {k for k in per_kind if m.shares_weights(k)}
    block_params = sum(per_kind[k] * (1 if k in shared_kinds else counts[k]) for k in per_kind)
    if m.share_position_bias and counts.get("attention", 0) > 1:  # u and v once for all attention blocks
        block_params -= (counts["attention"] - 1) * 2 * m.d_model
    total = embedding + head + block_params
    flops = {k: block_train_flops(k, cfg) for k in per_kind if k != "identity"}
    train_flops = head_train_flops(m, vocab) + sum(flops[k] * counts[k] for k in flops)
    estimate = estimate_memory(cfg, vocab, blocks)
    steps, tokens = run_length(cfg)
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
        f"  steps {steps:,}{' (train.stop_at)' if cfg.train.stop_at else ''}, tokens {tokens:,} "
        f"({cfg.data.batch_size} x {cfg.data.seg_len} a step)",
        expected_time(cfg, blocks, steps),
        "  dry run: nothing read, allocated or written",
    ])
