"""NNI model spaces searched by parnas."""

from parnas.search_spaces.par import PARTransformerXLSpace, fixed_model

__all__ = ["PARTransformerXLSpace", "fixed_model"]
