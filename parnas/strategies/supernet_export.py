"""The architecture a search exports, read off the supernet: each choice's most probable kind (the most
probable layout within a latency budget when that is over it), its perplexity with the supernet's weights,
and the record of one such evaluation (a line of ``history.jsonl``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from nni.nas.oneshot.pytorch.supermodule.differentiable import DifferentiableMixedLayer
from torch import Tensor

from parnas.architecture import layout_string
from parnas.strategies.costs import CostModel
from parnas.training.evaluation import model_device
from parnas.training.task import on_device, segment_nll


@contextmanager
def exported(choices: Sequence[DifferentiableMixedLayer], kinds: Sequence[str]) -> Iterator[None]:
    """Inside, choice i runs only candidate ``kinds[i]``: the exported architecture with the supernet's
    weights. Memories are unaffected (a choice keeps one whatever runs), so this is exactly the fixed model.
    A compiled supernet (``train.compile``) runs eager inside: its graphs hold the mixed forward, and tracing each
    exported layout anew would compile a set of graphs per layout evaluated."""
    for m, kind in zip(choices, kinds, strict=True):
        m.forward = m[kind].forward  # instance attribute: shadows the mixed forward
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        for m in choices:
            del m.forward


def fit_budget(probabilities: Sequence[Mapping[str, float]], costs: CostModel, budget: float) -> list[str] | None:
    """The most probable layout whose cost ratio is within ``budget`` (None if none is): each block takes
    argmax_k log p_k - mu x cost_k, the smallest mu that fits found by bisection (Lagrangian relaxation)."""
    def layout(mu: float) -> list[str]:
        return [max(p, key=lambda k: math.log(max(p[k], 1e-30)) - mu * costs.per_kind[k]) for p in probabilities]

    if costs.ratio([min(p, key=costs.per_kind.__getitem__) for p in probabilities]) > budget:
        return None
    low, high = 0.0, 1.0
    while costs.ratio(layout(high)) > budget:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (low, mid) if costs.ratio(layout(mid)) <= budget else (mid, high)
    return layout(high)


@torch.no_grad()
def exported_nll(model: torch.nn.Module, choices: Sequence[DifferentiableMixedLayer], kinds: Sequence[str],
                 batches: Iterable[tuple[Tensor, Tensor]]) -> Tensor:
    """(total NLL, predicted tokens) of the exported architecture over ``batches``, memory carried, dropout off,
    on the device the model's weights are on."""
    device = model_device(model)
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    was_training, mems = model.training, None
    model.eval()
    with exported(choices, kinds):
        for batch in batches:
            x, y, groups = on_device(model, batch, device)  # targets grouped on the host
            nll, mems = segment_nll(model, x, y, mems, groups)
            sums += torch.stack([nll.double().sum(), sums.new_full((), y.numel())])  # a fill: no upload
    model.train(was_training)
    return sums


@dataclass(frozen=True)
class Evaluated:
    """One evaluation: the exported architecture's own perplexity (supernet weights) and the supernet's."""

    step: int
    tau: float | None  # None: the search drew no Gumbel sample and read no tau
    probabilities: dict[str, dict[str, float]]
    kinds: list[str]
    val_ppl: float  # the exported (argmax) architecture, weights inherited, no retraining
    supernet_val_ppl: float  # candidates mixed by softmax(alpha)
    cost_ratio: float | None  # predicted cost relative to Transformer-XL's
    fitted_to_budget: bool = False  # the argmax was over budget; kinds is the most probable layout within it
    valid_fraction: float = 1.0  # the part of the validation split both perplexities read (< 1: mid-search)

    @property
    def architecture(self) -> str:
        return layout_string(self.kinds)

    def history_line(self) -> dict[str, Any]:
        tau = {} if self.tau is None else {"tau": self.tau}
        return {"step": self.step, **tau, "probabilities": self.probabilities,
                "val_ppl": self.val_ppl, "supernet_val_ppl": self.supernet_val_ppl,
                "architecture": self.architecture, "exported_cost_ratio": self.cost_ratio,
                "fitted_to_budget": self.fitted_to_budget,
                **({"valid_fraction": self.valid_fraction} if self.valid_fraction < 1 else {})}
