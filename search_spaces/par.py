"""The PAR Transformer-XL search space (Mandava et al. 2020).

A :class:`parnas.nn.model.TransformerXL` whose block at depth i is an NNI
``LayerChoice`` labelled ``block_<i>`` over the configured candidates. Under
``nni.nas.space.model_context(sample)`` the same constructor returns each
chosen block itself, so the fixed model *is* this class with no choice left:
search and retrain cannot disagree about what a block is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nni.nas.nn.pytorch import LayerChoice, ModelSpace
from nni.nas.space import model_context
from torch import nn

from parnas import kinds
from parnas.config import BLOCK_KINDS, ModelConfig
from parnas.nn.model import TransformerXL


class PARTransformerXLSpace(TransformerXL, ModelSpace):
    """N blocks, each choosing among ``candidates`` (any registered kinds; PAR's three by default).

    A kind that shares weights across depth (``shared``, ``model.share_weights``) is one
    module that the choices at every depth hold as their candidate of that name.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, candidates: Sequence[str] = BLOCK_KINDS) -> None:
        self.candidates = kinds.check(candidates, "candidates")
        super().__init__(cfg, vocab_size)

    def build_block(self, index: int) -> nn.Module:
        return LayerChoice({kind: self.block_for(kind, index) for kind in self.candidates}, label=f"block_{index}")


def fixed_model(cfg: ModelConfig, vocab_size: int, architecture: Mapping[str, str],
                candidates: Sequence[str] | None = None) -> PARTransformerXLSpace:
    """The space with every choice made: ``architecture`` maps ``block_<i>`` to a candidate name.

    By default the candidates are PAR's three plus whatever else ``architecture`` chooses.
    """
    if candidates is None:
        candidates = tuple(dict.fromkeys([*BLOCK_KINDS, *architecture.values()]))
    with model_context(dict(architecture)):
        return PARTransformerXLSpace(cfg, vocab_size, candidates)
