"""The PAR Transformer-XL search space (Mandava et al. 2020).

A :class:`parnas.nn.model.TransformerXL` whose block at depth i is an NNI ``LayerChoice`` labelled ``block_<i>`` over
the configured candidates. Under ``nni.nas.space.model_context(sample)`` the same constructor builds each chosen block
and nothing else, so the fixed model *is* this class with no choice left: search and retrain cannot disagree about what
a block is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nni.mutable import Categorical
from nni.nas.nn.pytorch import LayerChoice, ModelSpace
from nni.nas.space import current_model, model_context
from torch import nn

from parnas import kinds
from parnas.config import BLOCK_KINDS, ModelConfig
from parnas.nn.model import TransformerXL


class PARTransformerXLSpace(TransformerXL, ModelSpace):
    """N blocks, each choosing among ``candidates`` (any registered kinds; PAR's three by default).

    A kind that shares weights across depth (``shared``) is one
    module that the choices at every depth hold as their candidate of that name.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, candidates: Sequence[str] = BLOCK_KINDS) -> None:
        self.candidates = kinds.check(candidates, "candidates")
        super().__init__(cfg, vocab_size)

    def build_block(self, index: int) -> nn.Module:
        """A ``LayerChoice`` over every candidate; under ``model_context`` only the chosen block.

        ``LayerChoice`` would build every candidate and keep the chosen one, so a fixed model's initial
        weights would depend on the candidates offered and on where its identity blocks stand. Building
        the chosen kind alone (checked against the candidates as ``LayerChoice`` checks it) draws a
        network's weights from the network and the seed only: ``AAD`` and ``IIAAID`` start alike.
        """
        label = f"block_{index}"
        sample = current_model()
        if sample is not None:
            return self.block_for(Categorical(list(self.candidates), label=label).freeze(sample), index)
        return LayerChoice({kind: self.block_for(kind, index) for kind in self.candidates}, label=label)


def fixed_model(cfg: ModelConfig, vocab_size: int, architecture: Mapping[str, str],
                candidates: Sequence[str] | None = None) -> PARTransformerXLSpace:
    """The space with every choice made: ``architecture`` maps ``block_<i>`` to a candidate name.

    Only the chosen blocks are built. ``candidates`` (by default PAR's three plus whatever else
    ``architecture`` chooses) only checks the choices.
    """
    if candidates is None:
        candidates = tuple(dict.fromkeys([*BLOCK_KINDS, *architecture.values()]))
    with model_context(dict(architecture)):
        return PARTransformerXLSpace(cfg, vocab_size, candidates)
