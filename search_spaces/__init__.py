"""NNI model spaces searched by parnas."""

from search_spaces.par import PARTransformerXLSpace, check_candidates, fixed_model

__all__ = ["PARTransformerXLSpace", "check_candidates", "fixed_model"]
