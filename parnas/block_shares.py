"""The fixed shares of PLANER's and HAT's narrower and wider block kinds, read by the kinds' checks and costs
(:mod:`parnas.kinds.builtin`, no torch) and by their factories (:mod:`parnas.nn.blocks`) alike.

Fewer heads keep a share of ``model.n_heads``, each as wide as the config's; another feed-forward width keeps a share
of ``model.d_ff``. Each kind is its share: another share is another kind (a plugin's).
"""

from __future__ import annotations

SHARES = {"attention_half": ("n_heads", 0.5), "attention_quarter": ("n_heads", 0.25),
          "dense_half": ("d_ff", 0.5), "dense_double": ("d_ff", 2.0)}  # kind -> (the model setting, its share)


def share_of(kind: str, whole: int) -> int:
    """The heads (of ``model.n_heads``) or the inner width (of ``model.d_ff``) a ``kind`` of :data:`SHARES` keeps."""
    return round(whole * SHARES[kind][1])
