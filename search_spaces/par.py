"""The PAR Transformer-XL search space (Mandava et al. 2020).

A :class:`parnas.model.TransformerXL` whose block at depth i is an NNI
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

from parnas.blocks import make_block
from parnas.config import BLOCK_KINDS, ModelConfig, check_candidates
from parnas.model import TransformerXL


class PARTransformerXLSpace(TransformerXL, ModelSpace):
    """N blocks, each choosing among ``candidates`` ('attention', 'dense', 'identity')."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, candidates: Sequence[str] = BLOCK_KINDS) -> None:
        self.candidates = check_candidates(candidates)
        super().__init__(cfg, vocab_size)

    def build_block(self, index: int) -> nn.Module:
        return LayerChoice({kind: make_block(kind, self.cfg) for kind in self.candidates}, label=f"block_{index}")


def fixed_model(cfg: ModelConfig, vocab_size: int, architecture: Mapping[str, str],
                candidates: Sequence[str] = BLOCK_KINDS) -> PARTransformerXLSpace:
    """The space with every choice made: ``architecture`` maps ``block_<i>`` to a candidate name."""
    with model_context(dict(architecture)):
        return PARTransformerXLSpace(cfg, vocab_size, candidates)
