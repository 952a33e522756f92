"""parnas's own block kinds: each registered once, with its settings, its shape checks and its FLOPs.

A kind's settings are a frozen dataclass whose ``__post_init__`` checks them alone (messages name the field; the config
prefixes ``model.<kind>.``); its ``check`` tests them against the run's shapes. FLOPs are forward FLOPs per predicted
token of one block (multiply-add = 2 FLOPs), counted from the shapes: NNI's profiler cannot see through custom attention
or an identity candidate. Nothing here imports torch: configs are checked before it loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from parnas.block_shares import SHARES, share_of
from parnas.errors import require
from parnas.kinds.registry import BlockKind, Check, register

# --- settings ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConvSettings:
    """``conv``: the causal convolution's kernel (the Evolved Transformer decoder's 7)."""

    kernel: int = 7

    def __post_init__(self) -> None:
        require(self.kernel > 0, f"kernel must be > 0, got {self.kernel}")


COMPRESS_FNS = ("mean", "max", "conv")


@dataclass(frozen=True)
class CompressiveSettings:
    """``compressive``: evicted states compressed ``rate`` to one by ``fn`` into a memory of ``length``."""

    rate: int = 3
    length: int = 16
    fn: str = "conv"

    def __post_init__(self) -> None:
        require(self.rate > 0, f"rate must be > 0, got {self.rate}")
        require(self.length > 0, f"length must be > 0, got {self.length}")
        require(self.fn in COMPRESS_FNS, f"fn must be {', '.join(COMPRESS_FNS)}, not {self.fn!r}")


@dataclass(frozen=True)
class LSHSettings:
    """``lsh``: ``n_hashes`` rounds of hashing into ``n_buckets`` buckets, attended in chunks of ``chunk_len``."""

    n_buckets: int = 4
    n_hashes: int = 2
    chunk_len: int = 16

    def __post_init__(self) -> None:
        require(self.n_buckets >= 2 and self.n_buckets % 2 == 0,
                 f"n_buckets must be even and >= 2 (random rotations hash into [xR; -xR]), got {self.n_buckets}")
        require(self.n_hashes >= 1, f"n_hashes must be >= 1, got {self.n_hashes}")
        require(self.chunk_len > 0, f"chunk_len must be > 0, got {self.chunk_len}")


@dataclass(frozen=True)
class UTSettings:
    """``ut``: at most ``max_steps`` steps a position; the ponder cost weighs ``tau`` in the loss."""

    max_steps: int = 4
    tau: float = 0.01

    def __post_init__(self) -> None:
        require(self.max_steps >= 1, f"max_steps must be >= 1, got {self.max_steps}")
        require(self.tau >= 0, f"tau must be >= 0, got {self.tau}")


@dataclass(frozen=True)
class MoESettings:
    """``moe``: ``n_experts`` feed-forward experts of ``model.d_ff``, each token routed to its ``top_k``
    (Switch: 1); an expert takes at most ``capacity_factor`` x its even share of a batch's routings (the
    rest pass through the residual), and the load-balancing loss weighs ``aux_weight``."""

    n_experts: int = 4
    top_k: int = 1
    capacity_factor: float = 1.25
    aux_weight: float = 0.01

    def __post_init__(self) -> None:
        require(self.n_experts >= 1, f"n_experts must be >= 1, got {self.n_experts}")
        require(1 <= self.top_k <= self.n_experts,
                 f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        require(self.capacity_factor > 0, f"capacity_factor must be > 0, got {self.capacity_factor}")
        require(self.aux_weight >= 0, f"aux_weight must be >= 0, got {self.aux_weight}")

    def capacity(self, tokens: int) -> int:
        """Routings one expert takes from ``tokens`` tokens: ``capacity_factor`` x its even share, at least one."""
        return max(1, math.ceil(self.capacity_factor * self.top_k * tokens / self.n_experts))


# --- checks against the run's shapes ---------------------------------------------------------------

def _check_lsh(cfg: Any, s: LSHSettings) -> None:
    """The chunks must tile [memory; segment], and a segment must hold a bucket's worth of positions."""
    L, M = cfg.data.seg_len, cfg.model.mem_len
    require(L % s.chunk_len == 0 and M % s.chunk_len == 0, f"model.lsh.chunk_len ({s.chunk_len}) must divide "
             f"data.seg_len ({L}) and model.mem_len ({M}) for lsh blocks")
    require(s.n_buckets <= L, f"model.lsh.n_buckets ({s.n_buckets}) must not exceed data.seg_len ({L})")


def _whole_share(name: str, unit: str) -> Check:
    """A check that kind ``name``'s share (:data:`SHARES`) of its config setting is a whole number, at least one
    ``unit``."""
    def check(cfg: Any, s: Any) -> None:
        of, share = SHARES[name]
        whole = getattr(cfg.model, of)
        n = whole * share
        require(abs(n - round(n)) < 1e-9 and round(n) >= 1, f"{name} keeps {share:g} of model.{of} ({whole}): "
                 f"{n:g} {unit}; choose a model.{of} that gives it whole {unit}, or other candidates")
    return check


# --- FLOPs per token ------------------------------------------------------------------------------

def attention_flops(cfg: Any, seg_len: int, batch_size: int, n_heads: int | None = None, extra_keys: int = 0) -> float:
    """Relative attention over memory and segment; ``n_heads`` of the config's width (default all of them)."""
    D, L = cfg.d_model, seg_len
    inner = D * (n_heads or cfg.n_heads) // cfg.n_heads  # heads x head width
    K = cfg.mem_len + seg_len + extra_keys  # keys attended
    projections = 2 * D * inner * (1 + 2 * K / L + 1)  # q on L positions, k and v on K, output
    positions = 2 * D * inner * K / (L * batch_size)  # W_r on the K distances, shared by the batch
    scores = 3 * 2 * K * inner  # content, position, weighted sum of values
    return projections + positions + scores


def _feed_forward(d_ff_of: Any) -> Any:
    return lambda cfg, seg_len, batch_size: 2 * 2 * cfg.d_model * d_ff_of(cfg)


def _compressive_flops(cfg: Any, seg_len: int, batch_size: int) -> float:
    s = cfg.settings_of("compressive")  # f_c on the L states a segment evicts, in groups of c
    D = cfg.d_model
    return attention_flops(cfg, seg_len, batch_size, extra_keys=s.length) + (2 * D * D if s.fn == "conv" else D)


def _conv_flops(cfg: Any, seg_len: int, batch_size: int) -> float:
    """D->2D, GLU (recomputed on k-1 past states per segment), depthwise k, D->D."""
    D, k = cfg.d_model, cfg.settings_of("conv").kernel
    return 2 * 2 * D * D * (seg_len + k - 1) / seg_len + 2 * k * D + 2 * D * D


def _moe_flops(cfg: Any, seg_len: int, batch_size: int) -> float:
    """The router, then each routing through one expert: at most capacity x n_experts routings per batch."""
    s = cfg.settings_of("moe")
    tokens = seg_len * batch_size
    routed = min(s.top_k * tokens, s.capacity(tokens) * s.n_experts) / tokens
    return 2 * cfg.d_model * s.n_experts + routed * 2 * 2 * cfg.d_model * cfg.d_ff


# --- the kinds ------------------------------------------------------------------------------------

for _kind in (
    BlockKind("attention", "parnas.nn.blocks:build_attention", True, "A", flops=attention_flops,
              source="Dai et al. 2019, Transformer-XL relative attention",
              attends=True),
    BlockKind("dense", "parnas.nn.blocks:build_dense", False, "D", flops=_feed_forward(lambda cfg: cfg.d_ff),
              source="Vaswani et al. 2017, position-wise feed-forward (ReLU)"),
    BlockKind("identity", "parnas.nn.blocks:build_identity", False, "I", flops=lambda cfg, L, B: 0.0,
              source="Mandava et al. 2020, PAR: skip the depth"),
    BlockKind("conv", "parnas.nn.variants:ConvBlock", True, "C", settings=ConvSettings, flops=_conv_flops,
              source="So et al. 2019 (Evolved Transformer): GLU + causal depthwise-separable convolution"),
    BlockKind("glu", "parnas.nn.variants:GLUBlock", False, "G",
              flops=lambda cfg, L, B: 2 * 3 * cfg.d_model * (2 * cfg.d_ff // 3),  # three matrices, 2/3 d_ff wide
              source="Shazeer 2020, SwiGLU feed-forward"),
    BlockKind("sqrelu", "parnas.nn.variants:SquaredReLUBlock", False, "S", flops=_feed_forward(lambda cfg: cfg.d_ff),
              source="So et al. 2021 (Primer): squared-ReLU feed-forward"),
    BlockKind("compressive", "parnas.nn.compressive:CompressiveBlock", True, "M", settings=CompressiveSettings,
              flops=_compressive_flops, reversible=False, source="Rae et al. 2019, Compressive Transformer memory",
              attends=True),
    BlockKind("shared", "parnas.nn.variants:UniversalBlock", True, "U", shared=True,
              flops=lambda cfg, L, B: attention_flops(cfg, L, B) + 2 * 2 * cfg.d_model * cfg.d_ff,
              source="Dehghani et al. 2019, Universal Transformer: one layer reused across depth",
              attends=True),
    BlockKind("ut", "parnas.nn.act:ACTBlock", True, "H", settings=UTSettings, reversible=False, capturable=False,
              source="Dehghani et al. 2019 with Graves 2016: one layer repeated under adaptive computation time",
              attends=True),
    BlockKind("lsh", "parnas.nn.lsh:build_lsh", True, "L", settings=LSHSettings, check=_check_lsh,
              source="Kitaev et al. 2020, Reformer: LSH attention with shared QK, chunked",
              attends=True),
    BlockKind("attention_half", "parnas.nn.blocks:build_attention_half", True, "F",
              check=_whole_share("attention_half", "heads"),
              flops=lambda cfg, L, B: attention_flops(cfg, L, B, share_of("attention_half", cfg.n_heads)),
              source="Latifi et al. 2022 (PLANER), Wang et al. 2020 (HAT): attention with fewer heads, here 1/2",
              attends=True),
    BlockKind("attention_quarter", "parnas.nn.blocks:build_attention_quarter", True, "Q",
              check=_whole_share("attention_quarter", "heads"),
              flops=lambda cfg, L, B: attention_flops(cfg, L, B, share_of("attention_quarter", cfg.n_heads)),
              source="Latifi et al. 2022 (PLANER), Wang et al. 2020 (HAT): attention with fewer heads, here 1/4",
              attends=True),
    BlockKind("dense_half", "parnas.nn.blocks:build_dense_half", False, "N", check=_whole_share("dense_half", "units"),
              flops=_feed_forward(lambda cfg: share_of("dense_half", cfg.d_ff)),
              source="Tsai et al. 2020 (LTS), Wang et al. 2020 (HAT): a narrower feed-forward, here 1/2 d_ff"),
    BlockKind("dense_double", "parnas.nn.blocks:build_dense_double", False, "W",
              check=_whole_share("dense_double", "units"),
              flops=_feed_forward(lambda cfg: share_of("dense_double", cfg.d_ff)),
              source="Tsai et al. 2020 (LTS), Wang et al. 2020 (HAT): a wider feed-forward, here 2 d_ff"),
    BlockKind("moe", "parnas.nn.moe:MoEBlock", False, "E", settings=MoESettings, flops=_moe_flops, reversible=False,
              source="Fedus et al. 2021 (Switch Transformer), as in PLANER: a mixture of feed-forward experts"),
):
    register(_kind, builtin=True)
del _kind
