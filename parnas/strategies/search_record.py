"""What a search leaves: the record of PAR's Gumbel-DARTS search in ``architecture.json``."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from parnas import architecture
from parnas.architecture import layout_string
from parnas.config import Config
from parnas.strategies.nni_trial import in_nni_trial

if TYPE_CHECKING:  # the summary is printed for any strategy's record: it loads no torch
    from parnas.data.tokenizer import Tokenizer
    from parnas.strategies.gumbel_darts import PARDartsModule
    from parnas.strategies.supernet_export import Evaluated


def search_record(cfg: Config, tokenizer: Tokenizer, module: PARDartsModule, result: Evaluated, *, steps: int,
                  seconds: float, latency: dict[str, Any] | None,
                  selection: dict[str, Any] | None = None) -> dict[str, Any]:
    """The architecture record of a finished ``par-gumbel-darts`` search: the exported layout, softmax(alpha) per
    block, and the search's figures (perplexities, the budget and lambda, costs, time), validated. ``selection``:
    the final pick's record (:func:`parnas.strategies.final_pick.final_pick`: every entrant's short-retrain
    perplexities, the guard's, the verdict), kept under ``search.selection`` (None: no final pick ran)."""
    search, costs, kinds, par = cfg.search, module.costs, result.kinds, module.par
    chosen = {architecture.label(i): kind for i, kind in enumerate(kinds)}
    probabilities = {label: {k: round(p, 4) for k, p in dist.items()} for label, dist in result.probabilities.items()}
    budget = par.latency_budget
    trial = os.environ.get("NNI_TRIAL_JOB_ID") if in_nni_trial() else None
    return architecture.make_record(
        chosen, cfg.model, tokenizer.vocab_size, probabilities=probabilities, tokenizer=tokenizer.identity(),
        search={"strategy": cfg.search.strategy, "steps": steps,
                **par.read(), **({"tau_final": module.tau} if par.samples else {}),
                "val_ppl": round(result.val_ppl, 4), "supernet_val_ppl": round(result.supernet_val_ppl, 4),
                "discretisation_gap": round(result.val_ppl - result.supernet_val_ppl, 4),
                "val_ppl_is": "the exported architecture with the supernet's weights, not retrained",
                "val_mem_len": cfg.model.evaluation_memory, "seed": cfg.train.seed,
                "candidates": list(search.candidates), "penalty_weight": par.penalty_weight, "latency_budget": budget,
                "lambda_final": None if budget is None else
                par.penalty_weight if module.fixed_lambda else round(module.dual, 6),
                "fitted_to_budget": result.fitted_to_budget, "argmax": layout_string(module.argmax()),
                "latency": latency, "block_costs": {k: round(v, 4) for k, v in costs.per_kind.items()},
                "cost_unit": costs.unit, "architecture_cost": round(costs.total(kinds), 4),
                "cost_ratio": round(costs.ratio(kinds), 4),
                "expected_cost": round(float(module.expected_ratio().detach()) * costs.reference, 4),
                "arch_lr": search.arch_lr, "weight_lr": search.weights_lr(cfg.train)[1], "seconds": round(seconds, 1),
                "step_seconds": round(seconds / max(1, steps), 4), "nni_trial": trial, "selection": selection})

