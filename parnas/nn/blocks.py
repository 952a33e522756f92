"""The three kinds of block a PAR Transformer-XL is built from.

Every block has the same call, ``block(h, mem, pos) -> h'``, with ``h`` (B, L, D) the segment entering the block,
``mem`` (B, M, D) the cached states that entered it on earlier segments (M may be 0) and ``pos`` (M+L, D) the sinusoid
relative-position table, and returns a tensor shaped like ``h``. One signature is what lets NNI call every candidate of
a ``LayerChoice`` alike. ``uses_memory`` tells the body whether to keep a memory for the block.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from parnas.block_shares import share_of
from parnas.nn.alignment import PAD_MULTIPLE, pad_multiple

if TYPE_CHECKING:  # annotations only: the kinds registry builds these blocks, so nothing here imports it
    from parnas.config import ModelConfig


def keep_mask(shape: torch.Size, p: float, device: torch.device | None = None) -> Tensor:
    """Inverted-dropout factors, float32: 1/(1-p) with probability 1 - p, else 0, from one 31-bit draw per entry.
    Float factors make applying the mask, forward and backward, one multiply (bool masks cost more on the CPU)."""
    bits = torch.empty(shape, dtype=torch.int32, device=device).random_()  # uniform on [0, 2^31)
    return bits.float().ge_(p * 2**31).mul_(1.0 / (1.0 - p))


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Inverted dropout, no op at p = 0 or in evaluation: :func:`keep_mask` for float32 on the CPU, else torch's fused
    ``F.dropout``; either way from torch's generator, so ``torch.manual_seed`` fixes it."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return F.dropout(x, p, True)
    return x * keep_mask(x.shape, p, x.device)


def relu_dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``dropout(relu(x))``, the same masks from the same draws. On the CPU relu(x * mask): the ReLU runs in place and
    its output is the one the next layer keeps, so backward holds one tensor fewer than torch's ReLU then dropout."""
    if not training or p == 0.0 or x.device.type != "cpu" or x.dtype != torch.float32:
        return dropout(F.relu(x), p, training)
    return torch.relu_(x * keep_mask(x.shape, p, x.device))


class Dropout(nn.Dropout):
    """``nn.Dropout`` computed by :func:`dropout`."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)


class ReLUDropout(nn.Dropout):
    """ReLU then dropout, computed by :func:`relu_dropout`."""

    def forward(self, x: Tensor) -> Tensor:
        return relu_dropout(x, self.p, self.training)


def sinusoid(klen: int, d_model: int, device: torch.device | None = None,
             dtype: torch.dtype = torch.float32, clamp_len: int = 0) -> Tensor:
    """Relative-position table for distances klen-1, ..., 1, 0 (Dai et al., eq. 2). (K, D)

    ``clamp_len`` > 0: a distance beyond it reads ``clamp_len``'s row, as Dai et al.'s ``clamp_len`` does."""
    distance = torch.arange(klen - 1, -1, -1.0, device=device)
    if clamp_len:
        distance = distance.clamp_(max=clamp_len)
    inv_freq = 1.0 / (10000 ** (torch.arange(0.0, d_model, 2.0, device=device) / d_model))
    angle = distance[:, None] * inv_freq[None, :]  # (K, D/2)
    return torch.cat([angle.sin(), angle.cos()], dim=-1).to(dtype)  # (K, D)


def rel_shift(x: Tensor, K: int | None = None) -> Tensor:
    """Scores against the position table -> scores against key positions, as a view (Dai et al., appendix B).

    ``x[..., i, 1+k]`` scores query i against distance K-1-k and ``x[..., 0]`` is zero (the table's zero column in
    front); the result's ``[..., i, j]`` scores distance M+i-j, garbage where j > M+i (to be masked). Columns past
    1+K are padding (:mod:`parnas.nn.alignment`); K defaults to W-1. (..., L, W) -> (..., L, K)"""
    *batch, L, W = x.shape
    shifted = x.reshape(*batch, L * W)[..., L:].view(*batch, L, W - 1)
    return shifted if K is None or K == W - 1 else shifted[..., :K]


_CAUSAL_BIASES: dict[tuple[int, int, torch.device, torch.dtype], Tensor] = {}
CAUSAL_BIAS_SHAPES = 32  # the most shapes kept (the oldest made goes first)


def causal_bias(L: int, M: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """0 where query i may see key j (j <= M+i), -inf elsewhere: (L, M+L), made once per shape in eager mode.

    Made outside inference mode, so a table first made during evaluation also serves training. Under
    ``torch.compile`` it is made in the graph instead (a constant the compiler folds): Dynamo then traces no
    cache (it warns of a ``functools.lru_cache``, and guards on what a cache holds)."""
    if torch.compiler.is_compiling():
        return _causal_bias(L, M, device, dtype)
    key = (L, M, torch.device(device), dtype)
    bias = _CAUSAL_BIASES.get(key)
    if bias is None:
        if len(_CAUSAL_BIASES) >= CAUSAL_BIAS_SHAPES:
            del _CAUSAL_BIASES[next(iter(_CAUSAL_BIASES))]
        with torch.inference_mode(False), torch.no_grad():
            bias = _CAUSAL_BIASES[key] = _causal_bias(L, M, device, dtype)
    return bias


causal_bias.cache_clear = _CAUSAL_BIASES.clear  # type: ignore[attr-defined]  # as functools' caches have


def _causal_bias(L: int, M: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    future = torch.ones(L, M + L, dtype=torch.bool, device=device).triu(M + 1)
    return torch.zeros(L, M + L, device=device, dtype=dtype).masked_fill(future, float("-inf"))


def sdpa(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float, dropout_p: float,
         head_multiple: int = PAD_MULTIPLE) -> Tensor:
    """``F.scaled_dot_product_attention`` over (H, B) batches, shapes as :meth:`AttentionBlock._attend`. A head size
    off a multiple of ``head_multiple`` is padded with zero columns so that a fused kernel may run (zeros add
    nothing to a score; the padded output columns are dropped; ``scale`` stays the unpadded one)."""
    Dh = q.size(-1)
    pad = -Dh % head_multiple
    if pad:
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))  # (H, B, *, Dh + pad)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=bias.transpose(0, 1), dropout_p=dropout_p,
                                         scale=scale).transpose(0, 1)  # (H, B, L, Dh + pad)
    return out[..., :Dh] if pad else out


@functools.lru_cache(maxsize=32)
def causal_block_mask(L: int, M: int, device: torch.device) -> BlockMask:
    """FlexAttention's form of :func:`causal_bias`: query i sees key j <= M+i; blocks wholly in the future are
    skipped, not computed and masked. Made once per shape."""
    with torch.inference_mode(False), torch.no_grad():
        return create_block_mask(lambda b, h, i, j: j <= M + i, None, None, L, M + L, device=device)


@functools.cache
def compiled_flex_attention() -> Callable[..., Tensor]:
    """``flex_attention`` compiled, made on first use: called eagerly, it is an unfused reference that writes the
    whole score matrix; compiled, a fused kernel. Inside a compiled model the plain one is traced instead. Static
    shapes: a kernel per memory length while the memory fills, then none."""
    return torch.compile(flex_attention, dynamic=False)


def flex(q: Tensor, k: Tensor, v: Tensor, position: Tensor, scale: float) -> Tensor:
    """FlexAttention reading each (query i, key j) position score at distance M+i-j from the unshifted ``position``
    inside the kernel, and skipping key blocks wholly in the future: no (H, B, L, K) bias written out, as SDPA's.
    No attention dropout. q (H, B, L, Dh); k and v (H, B, K, Dh); ``position`` (H, B, L, W >= 1+K), unscaled, index
    1+K-1-d scoring distance d. -> (H, B, L, Dh)"""
    L, K = q.size(2), k.size(2)

    def add_position(score: Tensor, h: Tensor, b: Tensor, i: Tensor, j: Tensor) -> Tensor:
        # distance M+i-j sits at L-i+j; keys in the future (j > M+i) are masked, read at K so as not to overrun
        return score + scale * position[h, b, i, torch.clamp(L - i + j, max=K)]

    attend = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
    return attend(q, k, v, score_mod=add_position, block_mask=causal_block_mask(L, K - L, q.device), scale=scale)


class Keeper(nn.Module):
    """A module inside a block that keeps state of its own across segments or reports to the task: the body
    (parnas.nn.model) finds every Keeper, keeps ``n_memories`` extra (B, *, D) tensors for it, sets them on
    ``memory`` before its block runs and takes the next from ``update_memory``; it sums what a Keeper leaves in
    ``aux_loss`` into the model's loss and averages its ``metrics`` (name -> scalar) into the model's
    ``block_metrics``. This base keeps nothing and reports nothing: override what a kind needs."""

    n_memories = 0

    def __init__(self) -> None:
        super().__init__()
        self.memory: list[Tensor] | None = None  # set by the body around each call
        self.aux_loss: Tensor | None = None
        self.metrics: dict[str, Tensor] = {}

    def update_memory(self, memory: list[Tensor], mem: Tensor, h: Tensor, mem_len: int) -> list[Tensor]:
        """The next segment's ``n_memories`` tensors, from this segment's and what entered the block."""
        return []


class AttentionBlock(nn.Module):
    """Relative multi-head self-attention over [memory; segment], causal.

    ``kernel`` (``model.attention_kernel``) is what computes it off the CPU: ``sdpa`` (the position scores a bias to
    ``F.scaled_dot_product_attention``) or ``flex`` (:func:`flex`). On the CPU it is :meth:`_attend` in training mode
    and SDPA in eval mode, either way. A segment of one query (token-by-token generation) goes to SDPA with either:
    there are no key blocks to skip, and flex would compile a kernel for each memory length up to ``mem_len``."""

    kind = "attention"
    uses_memory = True
    pad_multiple: int | None = None  # heads, position table padded to this multiple (None: parnas.nn.alignment)

    def __init__(self, d_model: int, n_heads: int, dropout: float, dropatt: float,
                 kernel: str = "sdpa", d_head: int | None = None) -> None:
        super().__init__()
        if kernel == "flex" and dropatt:
            raise ValueError(f"the flex attention kernel has no attention dropout (dropatt {dropatt})")
        self.kernel = kernel
        self.n_heads, self.d_head = n_heads, d_head or d_model // n_heads  # fewer heads keep the config's width
        inner = n_heads * self.d_head
        # queries, keys and values in one product over [memory; segment] (Dai et al.'s qkv_net): rows [q; k; v]
        self.qkv = nn.Linear(d_model, 3 * inner, bias=False)
        self.r = nn.Linear(d_model, inner, bias=False)  # W_r: positions -> keys
        self.u = nn.Parameter(torch.zeros(n_heads, self.d_head))  # content bias
        self.v = nn.Parameter(torch.zeros(n_heads, self.d_head))  # position bias
        self.out = nn.Linear(inner, d_model, bias=False)
        self.norm = nn.LayerNorm(d_model)
        self.drop = Dropout(dropout)
        self.dropatt = dropatt

    @property
    def q_weight(self) -> Tensor:
        """The query rows of :attr:`qkv` (a view); the key and value rows follow them: :attr:`kv_weight`."""
        return self.qkv.weight[:self.n_heads * self.d_head]

    @property
    def kv_weight(self) -> Tensor:
        return self.qkv.weight[self.n_heads * self.d_head:]

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        # heads lead the batch order (H, B): the position scores are then one bmm per head over all
        # B*L queries, read in place from the projection (no copy of q, no B copies of r)
        B, L, D = h.shape
        M, H, Dh = mem.size(1), self.n_heads, self.d_head
        K = M + L
        c = torch.cat([mem, h], dim=1) if M else h  # (B, K, D)
        # one product: the memory's queries are made and dropped (what M more rows cost is less than a second
        # product, its backward and the gradients' sum where the host launches every op, as on a GPU)
        qkv = self.qkv(c).view(B, K, 3, H, Dh)
        q = qkv[:, M:, 0]  # (B, L, H, Dh), a view: the biases' sums below are the copies
        k, v = qkv[:, :, 1:].permute(2, 3, 0, 1, 4)  # 2 x (H, B, K, Dh)
        # the position scores in one product per head; off the CPU its operands are padded to aligned sizes (a head
        # of 41 with zero columns, the table's 1+K columns with zero columns after them: parnas.nn.alignment)
        m = pad_multiple(self, h.device)
        Dp, W = Dh + -Dh % m, 1 + K + -(1 + K) % m
        r = F.pad(self.r(pos).view(K, H, Dh).permute(1, 2, 0), (1, W - 1 - K, 0, Dp - Dh))  # (H, Dp, W)
        scale = 1.0 / math.sqrt(Dh)
        qv = (q + self.v).reshape(B * L, H, Dh)
        if Dp > Dh:
            qv = F.pad(qv, (0, Dp - Dh))  # (B*L, H, Dp)
        position = torch.bmm(qv.transpose(0, 1), r).view(H, B, L, W)  # column 1+K-1-d scores distance d
        q = (q + self.u).permute(2, 0, 1, 3)  # (H, B, L, Dh)
        if self.kernel == "flex" and h.device.type != "cpu" and L > 1:
            a = flex(q, k, v, position, scale)
        else:
            bias = torch.add(causal_bias(L, M, h.device, position.dtype), rel_shift(position, K),
                             alpha=scale)  # (H, B, L, K)
            if h.device.type == "cpu" and self.training:  # by mode, not grad: a reversible block recomputes
                a = self._attend(q, k, v, bias, scale)     # its forward with grad and must get the same numbers
            else:  # evaluating, the CPU's fused SDPA kernel reads q, k and v in place: no copies
                a = sdpa(q, k, v, bias, scale, self.dropatt if self.training else 0.0, m)
        a = self.out(a.permute(1, 2, 0, 3).reshape(B, L, H * Dh))  # (B, L, D)
        return self.norm(h + self.drop(a))  # post-norm, as Transformer-XL's

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
        """softmax(bias + scale q k^T) v over (H, B) batches, what SDPA computes. On the CPU SDPA takes
        its math path for a bias that needs a gradient, which adds safe-softmax passes this causal
        mask never needs (every query sees itself); one ``baddbmm`` also folds the bias add into
        the product. q (H, B, L, Dh), k and v (H, B, K, Dh), bias (H, B, L, K) -> (H, B, L, Dh)"""
        H, B, L, Dh = q.shape
        K = k.size(2)
        scores = torch.baddbmm(bias.view(H * B, L, K), q.reshape(H * B, L, Dh),
                               k.reshape(H * B, K, Dh).transpose(1, 2), alpha=scale)  # (H*B, L, K)
        weights = dropout(scores.softmax(-1), self.dropatt, self.training)
        return torch.bmm(weights, v.reshape(H * B, K, Dh)).view(H, B, L, Dh)


class DenseBlock(nn.Module):
    """Position-wise feed-forward sublayer with its residual and LayerNorm."""

    kind = "dense"
    uses_memory = False

    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        # ReLU and its dropout are one module; the indices stay those of the unfused
        # (Linear, ReLU, Dropout, Linear, Dropout), so checkpoints keep their keys
        self.net = nn.Sequential(OrderedDict([("0", nn.Linear(d_model, d_ff)), ("1", ReLUDropout(dropout)),
                                              ("3", nn.Linear(d_ff, d_model)), ("4", Dropout(dropout))]))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        return self.norm(h + self.net(h))


class IdentityBlock(nn.Module):
    """Skips the block: PAR's way to spend no compute at a depth."""

    kind = "identity"
    uses_memory = False

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        return h


# --- the built-in kinds' factories (named in the kind registry, built from the model config alone) ---------

def build_attention(cfg: ModelConfig) -> AttentionBlock:
    return AttentionBlock(cfg.d_model, cfg.n_heads, cfg.dropout, cfg.dropatt, cfg.attention_kernel)


def build_dense(cfg: ModelConfig) -> DenseBlock:
    return DenseBlock(cfg.d_model, cfg.d_ff, cfg.dropout)


def fewer_heads(cfg: ModelConfig, kind: str) -> AttentionBlock:
    """Attention with the ``kind``'s share of the config's heads, each of the config's head width."""
    return AttentionBlock(cfg.d_model, share_of(kind, cfg.n_heads), cfg.dropout, cfg.dropatt,
                          cfg.attention_kernel, d_head=cfg.d_model // cfg.n_heads)


def other_width(cfg: ModelConfig, kind: str) -> DenseBlock:
    """A dense block with the ``kind``'s share of ``model.d_ff``."""
    return DenseBlock(cfg.d_model, share_of(kind, cfg.d_ff), cfg.dropout)


build_attention_half = functools.partial(fewer_heads, kind="attention_half")
build_attention_quarter = functools.partial(fewer_heads, kind="attention_quarter")
build_dense_half = functools.partial(other_width, kind="dense_half")
build_dense_double = functools.partial(other_width, kind="dense_double")


def build_identity(cfg: ModelConfig) -> IdentityBlock:
    return IdentityBlock()
