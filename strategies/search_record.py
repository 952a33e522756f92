"""What a search leaves: the record of PAR's Gumbel-DARTS search in ``architecture.json``, and the few lines
``parnas search`` prints of any strategy's record (as :func:`parnas.training.fit.summary` does for a training).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from parnas import architecture, strategy_registry
from parnas.architecture import layout, layout_string, legend
from parnas.config import TARGET_LABELS, Config
from strategies.nni_trial import in_nni_trial

if TYPE_CHECKING:  # the summary is printed for any strategy's record: it loads no torch
    from parnas.data.tokenizer import Tokenizer
    from strategies.gumbel_darts import PARDartsModule
    from strategies.supernet_export import Evaluated


def search_record(cfg: Config, tokenizer: Tokenizer, module: PARDartsModule, result: Evaluated, *, steps: int,
                  seconds: float, latency: dict[str, Any] | None,
                  sampled: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The architecture record of a finished ``par-gumbel-darts`` search: the exported layout, softmax(alpha) per
    block, and the search's figures (perplexities, the budget and lambda, costs, time), validated."""
    search, costs, kinds = cfg.search, module.costs, result.kinds
    chosen = {architecture.label(i): kind for i, kind in enumerate(kinds)}
    probabilities = {label: {k: round(p, 4) for k, p in dist.items()} for label, dist in result.probabilities.items()}
    budget = search.latency_budget
    trial = os.environ.get("NNI_TRIAL_JOB_ID") if in_nni_trial() else None
    return architecture.make_record(
        chosen, cfg.model, tokenizer.vocab_size, probabilities=probabilities, tokenizer=tokenizer.identity(),
        search={"strategy": strategy_registry.PAR_GUMBEL_DARTS, "mode": search.mode, "steps": steps,
                "tau_final": module.tau, "val_ppl": round(result.val_ppl, 4),
                "supernet_val_ppl": round(result.supernet_val_ppl, 4),
                "discretisation_gap": round(result.val_ppl - result.supernet_val_ppl, 4),
                "val_ppl_is": "the exported architecture with the supernet's weights, not retrained",
                "val_mem_len": cfg.model.evaluation_memory, "seed": cfg.train.seed,
                "candidates": list(search.candidates),
                "penalty_weight": search.penalty_weight, "latency_budget": budget,
                "budget_hinge": search.budget_hinge if budget is not None else None,
                "lambda_final": None if budget is None else
                search.penalty_weight if module.fixed_lambda else round(module.dual, 6),
                "fitted_to_budget": result.fitted_to_budget,
                "argmax": layout_string(module.argmax()), "sampled": sampled,
                "latency": latency,
                "block_costs": {k: round(v, 4) for k, v in costs.per_kind.items()}, "cost_unit": costs.unit,
                "architecture_cost": round(costs.total(kinds), 4),
                "cost_ratio": round(costs.ratio(kinds), 4),
                "expected_cost": round(float(module.expected_ratio().detach()) * costs.reference, 4),
                "hard": search.hard, "forward": search.forward, "arch_lr": search.arch_lr,
                "seconds": round(seconds, 1),
                "step_seconds": round(seconds / max(1, steps), 4),
                "nni_trial": trial})


def search_summary(record: dict[str, Any]) -> str:
    """The few lines ``parnas search`` prints of a finished search's record, whichever strategy made it: the
    architecture, its perplexity and what that perplexity is, its predicted latency against the budget, and each
    block's probabilities."""
    search, kinds = record["search"], layout(record)
    lines = [f"architecture {layout_string(kinds)} ({legend(search.get('candidates') or kinds)}) "
             f"after {search['steps']} steps"]
    what = ("exported architecture (supernet weights, not retrained)" if "trials" not in search else
            f"best of {search['trials']} trials (trained from scratch in its trial)")
    line = f"  val ppl {search['val_ppl']:.2f} {what}" \
        if search.get("val_ppl") is not None else "  val ppl of the exported architecture: not finite"
    if search.get("discretisation_gap") is not None:
        line += (f"; {search['supernet_val_ppl']:.2f} supernet (discretisation gap "
                 f"{search['discretisation_gap']:+.2f})")
    elif search.get("supernet_val_ppl") is not None:
        line += f"; {search['supernet_val_ppl']:.2f} supernet"
    name = search.get("strategy")
    known = strategy_registry.is_known(name)
    if known and strategy_registry.get(name).source == strategy_registry.NNI:
        line += f" -- NNI's {name}"
    elif name != strategy_registry.PAR_GUMBEL_DARTS:
        line += f" -- {name}"
    lines.append(line)
    latency = search.get("latency")
    if latency:
        budget = latency["budget"]
        verdict = "" if budget is None else (f", budget {budget:.2f}: " +
                                             ("met" if latency["within_budget"] else "NOT MET"))
        source = f" (table {latency['table']})" if latency.get("table") else ""
        target = latency.get("target", "train")
        lines.append(f"  predicted {TARGET_LABELS[target]} {latency['target_ms']:.3g} ms = {latency['ratio']:.2f} x "
                     f"Transformer-XL's {latency['transformer_xl_ms']:.3g} ms on {latency['device']}{source}{verdict}")
    if search.get("fitted_to_budget"):
        lines.append(f"  the argmax {search['argmax']} was over the budget: exported the most probable layout "
                     "within it")
    for label, probs in record["probabilities"].items():
        lines.append(f"  {label}: " + "  ".join(f"{k} {p:.3f}" for k, p in probs.items()))
    return "\n".join(lines)
