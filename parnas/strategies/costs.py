"""What an architecture costs, for the latency budget, the penalty and the Pareto plot.

:class:`CostModel` is ``constant + sum of the blocks' costs``, read relative to the standard Transformer-XL at the same
``n_blocks``. Its numbers come from the device's latency table (:mod:`parnas.training.latency_table`, the default:
what a user pays) or from forward FLOPs per token counted from the shapes (a deterministic proxy, not what you pay:
it says attention is cheaper than a dense block at short contexts, where a device says the opposite). NNI's FLOPs
profiler cannot see through ``nn.Embedding``, custom attention or an ``nn.Identity`` candidate, so FLOPs are counted
here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from parnas import kinds
from parnas.config import TARGET_UNITS, ModelConfig, transformer_xl_layout
from parnas.kinds import make_block
from parnas.training.latency_table import LatencyTable


def flops_per_token(kind: str, cfg: ModelConfig, seg_len: int, batch_size: int) -> float:
    """Forward FLOPs per predicted token of one block (multiply-add = 2 FLOPs): the kind's own ``flops``
    formula (every built-in kind counts its shapes), or else 2 FLOPs per parameter (the position-wise
    estimate of Kaplan et al. 2020)."""
    registered = kinds.get(kind)
    if registered.flops is not None:
        return float(registered.flops(cfg, seg_len, batch_size))
    return 2.0 * sum(p.numel() for p in make_block(kind, cfg).parameters())


def flops_costs(kinds: Sequence[str], cfg: ModelConfig, seg_len: int, batch_size: int) -> dict[str, float]:
    """MFLOP per token for each kind."""
    return {k: flops_per_token(k, cfg, seg_len, batch_size) / 1e6 for k in kinds}


@dataclass(frozen=True)
class CostModel:
    """Per-kind block costs plus a constant part, in ``unit``; ``reference`` is Transformer-XL's total.
    ``device``: the device a latency table was timed on (None for a proxy such as FLOPs); ``target``: which
    latency it prices (None for a proxy)."""

    per_kind: dict[str, float]
    constant: float
    unit: str
    n_blocks: int
    device: str | None = None
    target: str | None = None  # the latency target of a latency table's costs (train, inference, generate)

    @property
    def reference(self) -> float:
        return self.total(transformer_xl_layout(self.n_blocks))

    def total(self, kinds: Sequence[str]) -> float:
        return self.constant + sum(self.per_kind[k] for k in kinds)

    def ratio(self, kinds: Sequence[str]) -> float:
        """Cost of a layout relative to the standard Transformer-XL's."""
        return self.total(kinds) / self.reference


def latency_costs(table: LatencyTable, n_blocks: int, target: str = "train") -> CostModel:
    """The table's costs for one latency target (``train``, ``inference`` or ``generate``)."""
    return CostModel(table.costs(target), table.constant_ms[target], TARGET_UNITS[target], n_blocks,
                     table.key["device"], target)


def flops_model(kinds: Sequence[str], cfg: ModelConfig, seg_len: int, batch_size: int) -> CostModel:
    """FLOPs of the blocks only (the constant part is left out): a proxy."""
    return CostModel(flops_costs(kinds, cfg, seg_len, batch_size), 0.0, "MFLOP/token", cfg.n_blocks)
