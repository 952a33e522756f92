"""The Transformer-XL body: embedding, a stack of blocks with memories, output head.

What a block *is* lives in :mod:`parnas.nn.blocks`; this file wires blocks together and owns the memory. The
block at depth i comes from :meth:`TransformerXL.build_block`, the one hook the NNI search space overrides (with a
``LayerChoice``), so search and retrain share every line here.

Memory contract: ``mems[i]`` holds, detached, the last :attr:`TransformerXL.memory_len` states that entered block
i on earlier segments, (B, M, D); a block whose ``uses_memory`` is False keeps ``None`` (a supernet's choice keeps
one). A :class:`parnas.nn.blocks.Keeper` inside a block gets its ``n_memories`` (B, *, D) tensors appended after
the blocks' entries; its ``aux_loss`` is summed into ``model.aux_loss`` and its ``metrics`` averaged into
``model.block_metrics``, for the task.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parnas.config import ModelConfig
from parnas.kinds import make_block
from parnas.nn.adaptive import (
    AdaptiveEmbedding,
    ProjectedAdaptiveSoftmax,
    TargetCapacity,
    TargetGroups,
    add_tail_nll,
    cutoffs_buffer,
    group_by_cluster,
    group_targets,
)
from parnas.nn.alignment import pad_multiple, padded_logits
from parnas.nn.blocks import AttentionBlock, Dropout, Keeper, sinusoid
from parnas.nn.reversible import reversible_stack
from parnas.nn.variants import DepthStep

Memory = list[Optional[Tensor]]
SKIPPED_KIND = "identity"  # the kind a fixed model skips: its blocks are never called (outside reversible pairs)


def blocks_run(kinds: Sequence[str], reversible: bool = False) -> tuple[str, ...]:
    """The kinds of the blocks a fixed model of ``kinds`` calls, in order: layouts that differ only in where their
    identity blocks stand are one network. Under reversible pairs a block's place decides its pair: all count."""
    return tuple(kinds) if reversible else tuple(k for k in kinds if k != SKIPPED_KIND)


class _TargetNLL(torch.autograd.Function):
    """-log_softmax(logits)[i, target_i] for each row. (N, C), (N,) -> (N,)

    Backward is softmax minus the one-hot target, written into one buffer; autograd's
    log_softmax, gather chain fills a zero (N, C) tensor, scatters into it and reads it again."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor) -> Tensor:  # type: ignore[override]
        logp = logits.float().log_softmax(-1)  # (N, C), float32 whatever the logits are (CUDA autocast's rule)
        ctx.save_for_backward(logp, target)
        return -logp.gather(1, target[:, None]).squeeze(1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        logp, target = ctx.saved_tensors
        grad_logits = logp.exp().mul_(grad[:, None])  # softmax * grad
        return grad_logits.scatter_add_(1, target[:, None], -grad[:, None]), None


class OutputHead(nn.Module):
    """Adaptive softmax (Grave et al.) when cutoffs are given, else a full softmax. With adaptive input or tied
    weights the adaptive softmax is Dai et al.'s projected one (:mod:`parnas.nn.adaptive`), which can share its
    weights and projections with the embedding; otherwise torch's. Off the CPU the loss pads the logits of the
    head (the full softmax's, or the shortlist's with the tail clusters' entries) to an aligned width with -inf:
    :mod:`parnas.nn.alignment`."""

    pad_multiple: int | None = None  # the head's logits padded to this multiple (None: parnas.nn.alignment's rule)

    def __init__(self, cfg: ModelConfig, vocab_size: int, embedding: nn.Module | None = None) -> None:
        super().__init__()
        self.cutoffs = list(cfg.cutoffs)
        if cfg.cutoffs and (cfg.adaptive_input or cfg.tie_weights):
            self.projected = ProjectedAdaptiveSoftmax(vocab_size, cfg.d_model, cfg.cutoffs, cfg.div_value)
            if embedding is not None:
                self.projected.tie(embedding, cfg.tie_projs)
        elif cfg.cutoffs:
            self.adaptive = nn.AdaptiveLogSoftmaxWithLoss(cfg.d_model, vocab_size, list(cfg.cutoffs),
                                                          div_value=cfg.div_value)
            cutoffs_buffer(self, cfg.cutoffs)
        else:
            self.proj = nn.Linear(cfg.d_model, vocab_size)
            if embedding is not None:
                self.proj.weight = embedding.weight

    def group_targets(self, y: Tensor, capacity: TargetCapacity | None = None) -> TargetGroups | None:
        """y's rows grouped by cluster, for :meth:`nll`; on the host, where the batch is made, nothing waits for
        the device. ``capacity``: the tail clusters padded to fixed sizes (a loss of static shape). None for a
        full softmax, which needs none."""
        return group_targets(y, self.cutoffs, capacity) if self.cutoffs else None

    def nll(self, h: Tensor, y: Tensor, groups: TargetGroups | None = None) -> Tensor:
        """Negative log-likelihood of each target; ``groups``: :meth:`group_targets` of y, made on the host (an
        adaptive softmax given none reads its cluster sizes back once). h (..., D), y (...) -> (...)"""
        flat_h, flat_y = h.reshape(-1, h.size(-1)), y.reshape(-1)
        multiple = pad_multiple(self, h.device)
        if hasattr(self, "projected"):
            return self.projected.nll(flat_h, flat_y, _TargetNLL, groups, multiple).view(y.shape)
        if hasattr(self, "adaptive"):
            return self._adaptive_nll(flat_h, flat_y, groups, multiple).view(y.shape)
        logits = padded_logits(flat_h, self.proj.weight, self.proj.bias, multiple)  # (N, V + pad)
        return F.cross_entropy(logits, flat_y, reduction="none").view(y.shape)

    def _adaptive_nll(self, h: Tensor, y: Tensor, groups: TargetGroups | None = None, multiple: int = 1) -> Tensor:
        """``-self.adaptive(h, y).output`` with one :class:`_TargetNLL` node per log-softmax, each tail cluster scored
        on its rows as ``groups`` order them (without them, one read-back, where torch's module makes one per
        cluster); the head's logits padded to a multiple of ``multiple``. h (N, D), y (N,) -> (N,)"""
        asm = self.adaptive
        cluster, groups = group_by_cluster(y, self.cutoffs_on_device, groups)  # cluster (N,): 0 head
        head_target = torch.where(cluster == 0, y, cluster + (asm.shortlist_size - 1))  # tail i+1: entry i
        nll = _TargetNLL.apply(padded_logits(h, asm.head.weight, asm.head.bias, multiple), head_target)  # (N,)
        return add_tail_nll(nll, h, y, groups, [0, *asm.cutoffs], lambda i, rows: asm.tail[i - 1](rows), _TargetNLL)

    def log_probs(self, h: Tensor) -> Tensor:
        """Log-probabilities over the whole vocabulary. (..., D) -> (..., V)"""
        flat = h.reshape(-1, h.size(-1))
        if hasattr(self, "projected"):
            out = self.projected.log_prob(flat)
        else:
            out = self.adaptive.log_prob(flat) if hasattr(self, "adaptive") else self.proj(flat).log_softmax(-1)
        return out.view(*h.shape[:-1], -1)


class TransformerXL(nn.Module):
    """A Transformer-XL language model whose blocks are given by ``cfg.layout``."""

    # the capacities its training batches' targets are grouped with, where set (a compiled model's: the loss's
    # shapes stay the same from batch to batch; parnas.training.compiling)
    target_capacity: TargetCapacity | None = None

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        cfg.check_vocab(vocab_size)
        self.cfg, self.vocab_size, self.mem_len = cfg, vocab_size, cfg.mem_len
        self.eval_mem_len, self.clamp_len = cfg.evaluation_memory, cfg.clamp_len
        self.embed = (AdaptiveEmbedding(vocab_size, cfg.d_model, cfg.cutoffs, cfg.div_value) if cfg.adaptive_input
                      else nn.Embedding(vocab_size, cfg.d_model))
        self.drop = Dropout(cfg.dropout)
        self._shared: dict[str, nn.Module] = {}  # kind -> the one module its blocks share (block_for)
        self.blocks = nn.ModuleList([self.build_block(i) for i in range(cfg.n_blocks)])
        self._keepers = [[m for m in b.modules() if isinstance(m, Keeper)] for b in self.blocks]
        # a decided identity block is not called at all (it keeps no memory); a choice still may be one
        self._skipped = [getattr(b, "kind", None) == SKIPPED_KIND for b in self.blocks]
        self.aux_loss: Tensor | float = 0.0
        self.block_metrics: dict[str, Tensor] = {}  # what keepers report of the last forward, e.g. act/steps
        self.head = OutputHead(cfg, vocab_size, self.embed if cfg.tie_weights else None)
        self.apply(_init_weights)
        if cfg.share_position_bias:
            share_position_bias(self)

    def build_block(self, index: int) -> nn.Module:
        """The block at depth ``index``. The search space overrides this."""
        return self.block_for(self.cfg.layout[index], index)

    def block_for(self, kind: str, index: int) -> nn.Module:
        """A block of ``kind`` for depth ``index``: a fresh one, or the shared module of a kind that shares weights
        across depth (the ``shared`` kind) behind its depth's timestep signal."""
        if not self.cfg.shares_weights(kind):
            return make_block(kind, self.cfg)
        if kind not in self._shared:
            self._shared[kind] = make_block(kind, self.cfg)
        return DepthStep(self._shared[kind], index, self.cfg.d_model)

    @property
    def memory_len(self) -> int:
        """States the memory keeps: ``mem_len`` in training, ``eval_mem_len`` in evaluation (``model.eval()``)."""
        return self.mem_len if self.training else self.eval_mem_len

    def evaluate_with(self, mem_len: int | None = None, clamp_len: int | None = None) -> None:
        """Evaluate from now on with a memory of ``mem_len`` states and positions clamped at ``clamp_len`` (0: not
        clamped), in every block that reads positions; None keeps the current one (at first, the config's)."""
        if mem_len is not None:
            self.eval_mem_len = mem_len
        if clamp_len is not None:
            for module in self.modules():
                if hasattr(module, "clamp_len"):
                    module.clamp_len = clamp_len

    @property
    def block_kinds(self) -> list[str]:
        """Kind of each block, or 'choice' where it is still undecided."""
        return [getattr(b, "kind", "choice") for b in self.blocks]

    def init_memory(self, batch_size: int, device: torch.device | None = None) -> Memory:
        """Empty memories: (B, 0, D) for blocks that may attend, None for the rest."""
        empty = torch.zeros(batch_size, 0, self.cfg.d_model, device=device, dtype=self.embed.weight.dtype)
        kept = [empty for keepers in self._keepers for m in keepers for _ in range(m.n_memories)]
        return [empty if getattr(b, "uses_memory", True) else None for b in self.blocks] + kept

    def forward(self, x: Tensor, mems: Memory | None = None) -> tuple[Tensor, Memory]:
        """x (B, L) token ids -> hidden states (B, L, D) and the memories for the next segment."""
        B, L = x.shape
        if mems is None:
            mems = self.init_memory(B, x.device)
        h = self.drop(self.embed(x) * math.sqrt(self.cfg.d_model))  # (B, L, D)
        M = next((m.size(1) for m in mems if m is not None), 0)
        pos = self.drop(sinusoid(M + L, self.cfg.d_model, h.device, h.dtype, self.clamp_len))  # (M+L, D)
        if self.cfg.reversible:
            return self._reversible(h, mems, pos)
        new_mems: Memory = []
        kept, new_kept, aux = iter(mems[len(self.blocks):]), [], []
        metrics: dict[str, list[Tensor]] = {}  # over blocks, e.g. act/steps, and each block's, act/steps/block_3
        per_block: dict[str, Tensor] = {}
        for index, (block, mem, keepers, skipped) in enumerate(zip(self.blocks, mems, self._keepers, self._skipped)):
            if skipped:
                new_mems.append(None)
                continue
            # a fair search's stacked step (parnas.strategies.fair) runs copies of the batch from one memory: the
            # memories carried on follow the last copy
            last = h if mem is None or len(h) == len(mem) else h[-len(mem):]  # (B, L, D)
            for keeper in keepers:  # memories a block keeps itself (compressive); a candidate a sampling search
                keeper.memory = [next(kept) for _ in range(keeper.n_memories)]  # skips leaves no loss or metrics
                keeper.metrics, keeper.aux_loss = {}, None
                new_kept += keeper.update_memory(keeper.memory, last[:, :0] if mem is None else mem, last,
                                                 self.memory_len)
            new_mems.append(None if mem is None else self._update(mem, last))
            h = block(h, h[:, :0] if mem is None else mem, pos)
            for keeper in keepers:
                keeper.memory = None
                aux += [] if keeper.aux_loss is None else [keeper.aux_loss]
                for name, value in keeper.metrics.items():  # a candidate a sampling search skipped left none
                    metrics.setdefault(name, []).append(value)
                    per_block[f"{name}/block_{index}"] = value
        self.aux_loss = torch.stack(aux).sum() if aux else 0.0
        self.block_metrics = {name: torch.stack(values).mean() for name, values in metrics.items()} | per_block
        return h, new_mems + new_kept

    def _reversible(self, h: Tensor, mems: Memory, pos: Tensor) -> tuple[Tensor, Memory]:
        """The body as reversible pairs (parnas.nn.reversible): each block's memory holds what entered it."""
        given = [h[:, :0] if mem is None else mem for mem in mems]
        h, entered = reversible_stack(self.blocks, h, given, pos)
        self.aux_loss, self.block_metrics = 0.0, {}
        return h, [None if mem is None else self._update(mem, e) for mem, e in zip(mems, entered)]

    def _update(self, mem: Tensor, h: Tensor) -> Tensor:
        """The last :attr:`memory_len` states of [mem; h], detached: the next segment's memory.
        A slice of h when the segment alone is long enough (no concatenation)."""
        M, L = mem.size(1), h.size(1)
        keep = min(self.memory_len, M + L)
        if keep <= L:
            return h[:, L - keep:].detach()  # (B, keep, D)
        return torch.cat([mem[:, M + L - keep:], h], dim=1).detach()  # (B, keep, D)

    def group_targets(self, y: Tensor, capacity: TargetCapacity | None = None) -> TargetGroups | None:
        """Targets (B, L) grouped for :meth:`nll` by the output head, on their device (the host, where the batch
        is made: the step then reads nothing back), each tail cluster padded to ``capacity`` where one is given;
        None where the head needs none."""
        return self.head.group_targets(y, capacity)

    def nll(self, h: Tensor, y: Tensor, groups: TargetGroups | None = None) -> Tensor:
        """Per-token negative log-likelihood of targets y (B, L) given hidden states h (B, L, D); ``groups``:
        :meth:`group_targets` of y, moved to h's device."""
        return self.head.nll(h, y, groups)

    def log_probs(self, h: Tensor) -> Tensor:
        return self.head.log_probs(h)


def full_memory_steps(cfg: ModelConfig, seg_len: int, memory: int | None = None) -> int:
    """Segments of ``seg_len`` after which every memory is full: the memory's ``memory`` states (default
    ``mem_len``), and a compressive block's ``length`` compressed ones (``rate`` evicted states each), so that
    what comes after is timed at steady state (and a compiled model has compiled)."""
    s = cfg.settings_of("compressive")
    memory = cfg.mem_len if memory is None else memory
    return math.ceil((memory + s.rate * s.length) / seg_len) + 1


def share_position_bias(model: nn.Module) -> None:
    """One content bias u and one position bias v for every attention block (and every attention candidate of a
    supernet), as Dai et al.'s Transformer-XL keeps them; their count then matches its parameter count. Blocks
    with fewer heads share the first heads' biases' shape among themselves."""
    first: dict[tuple[int, int], AttentionBlock] = {}
    for block in (m for m in model.modules() if isinstance(m, AttentionBlock)):
        shared = first.setdefault((block.n_heads, block.d_head), block)
        block.u, block.v = shared.u, shared.v


def _init_weights(module: nn.Module) -> None:
    """Transformer-XL's initialisation: N(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


def build_fixed_model(cfg: ModelConfig, vocab_size: int, blocks: Sequence[str] | None = None) -> TransformerXL:
    """A fixed model with the given block kinds in order (``cfg.layout`` by default)."""
    if blocks is not None:
        cfg = replace(cfg, n_blocks=len(blocks), blocks=tuple(blocks))
    return TransformerXL(cfg, vocab_size)
