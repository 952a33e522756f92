"""What a finished run prints: the few figures a training (``train``, ``retrain``) and a search (any strategy) are
judged by, side by side so that they read alike. Plain dicts in, text out: nothing here imports torch."""

from __future__ import annotations

from typing import Any

from parnas import strategy_registry
from parnas.architecture import layout, layout_string, legend
from parnas.config import TARGET_LABELS


def training_summary(metrics: dict[str, Any], out_dir: str) -> str:
    """The few figures a finished training run is judged by, rounded, in one short block."""
    tps, params = metrics.get("train_tokens_per_s"), metrics.get("parameters")
    ppl = ", ".join(f"{name} perplexity {metrics[key]:.2f}" for name, key in (("validation", "val_ppl"),
                                                                              ("test", "test_ppl"))
                    if metrics.get(key) is not None)
    lines = [f"{metrics['architecture']} after {metrics['steps']:,} steps: {ppl or 'no perplexity (not finite)'}"]
    speed = [f"{params:,} parameters" if params else None,
             f"{metrics['attention_blocks']} attention blocks" if "attention_blocks" in metrics else None,
             f"{tps:,.0f} train tokens/s" if tps else None,
             f"{metrics['eval_tokens_per_s']:,.0f} eval tokens/s" if metrics.get("eval_tokens_per_s") else None,
             f"peak memory {metrics['peak_memory_mb']:,.0f} MB" if metrics.get("peak_memory_mb") else None]
    lines.append("  " + ", ".join(s for s in speed if s))
    lines.append(f"  metrics in {out_dir}/metrics.json ({legend(metrics['architecture'])})")
    return "\n".join(lines)


def search_summary(record: dict[str, Any]) -> str:
    """What ``parnas search`` prints of a finished search's record, whichever strategy made it: the architecture, its
    perplexity and what that is, its predicted latency against the budget, and each block's probabilities."""
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
