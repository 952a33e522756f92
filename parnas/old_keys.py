"""Keys a config may no longer hold, each refused in one line that names what to use instead.

Nothing has been released, so nothing is upgraded: an earlier key is an error, and these maps only make it say
where the setting went (issue #65; read by :func:`parnas.overrides.from_dict`). Keys are full config paths.
"""

from __future__ import annotations

PAR = "search.par-gumbel-darts"
# keys of earlier versions that live elsewhere now: old -> new
RENAMED = {
    "model.conv_kernel": "model.conv.kernel", "model.compress_rate": "model.compressive.rate",
    "model.compress_len": "model.compressive.length", "model.compress_fn": "model.compressive.fn",
    "model.n_buckets": "model.lsh.n_buckets", "model.n_hashes": "model.lsh.n_hashes",
    "model.chunk_len": "model.lsh.chunk_len", "model.act_max_steps": "model.ut.max_steps",
    "model.act_tau": "model.ut.tau",
    **{f"search.{key}": f"{PAR}.{key}" for key in ("tau_start", "tau_end", "forward", "arch_warmup_steps",
                                                    "latency_budget", "penalty_weight", "select")},
}
# settings taken away: key -> what to do instead
REMOVED = {
    f"{PAR}.mode": "the logits and the weights step on the same batch (bilevel DARTS was removed: no table measured "
                   "it); drop the key",
    f"{PAR}.export_samples": f"the final pick ({PAR}.select.*) retrains the supernet's best layouts; drop the key",
    f"{PAR}.arch_weight_decay": "the logits' optimiser has no weight decay; drop the key",
    f"{PAR}.dual_lr": f"the budget's multiplier steps at a fixed rate; drop the key (or fix it: {PAR}.penalty_weight)",
    f"{PAR}.budget_hinge": "the budget's hinge is on the exported layout's cost; drop the key",
    "search.gumbel-darts.tau_start": "NNI's gumbel-darts runs at NNI's own temperature; drop the key",
    "search.gumbel-darts.tau_end": "NNI's gumbel-darts runs at NNI's own temperature; drop the key",
    f"{PAR}.hard": "the Gumbel sample is soft: every candidate weighted, the weights summing to 1; drop the key",
    f"{PAR}.tau_schedule": "tau falls exponentially, as in the original PAR search; drop the key",
    f"{PAR}.select.guard": "the shallower Transformer-XL always enters the final pick; drop the key",
    "train.weight_decay": "the optimiser has no weight decay; drop the key",
    **{f"model.{kind}.{share}": f"{kind} keeps a fixed share of model.{of} (parnas.block_shares; "
                               "another share is another kind, a plugin's); drop the key"
       for kind, share, of in (("attention_half", "fraction", "n_heads"), ("attention_quarter", "fraction", "n_heads"),
                               ("dense_half", "ratio", "d_ff"), ("dense_double", "ratio", "d_ff"))},
    "model.pre_norm": "blocks are post-norm, as Transformer-XL's and PAR's; drop the key",
    "train.accumulate": "a step is one batch (raise data.batch_size, or train.devices); drop the key",
    "model.share_weights": "blocks share one module across depth as the shared kind (model.blocks or "
                           "search.candidates); drop the key",
    "data.sp_model_type": "SentencePiece tokenizers are unigram models; drop the key",
    f"{PAR}.select.rank": "the pick's entrants are the supernet's most probable layouts; drop the key",
    f"{PAR}.select.pool": "the pick's entrants are the supernet's most probable layouts; drop the key",
    f"{PAR}.select.early_valid_fraction": "the early rounds judge on a fixed quarter of the validation split; drop "
                                          "the key",
}
for _old in ("mode", "export_samples", "tau_schedule", "hard", "arch_weight_decay", "dual_lr", "budget_hinge"):
    REMOVED[f"search.{_old}"] = REMOVED[f"{PAR}.{_old}"]


def old_key_message(key: str) -> str | None:
    """The one line that refuses ``key`` (a full config path) when it is a key of an earlier version, else None."""
    if key in RENAMED:
        return f"{key} is now {RENAMED[key]}: use that key"
    if key in REMOVED:
        return f"{key} was removed: {REMOVED[key]}"
    return None
