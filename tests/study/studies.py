"""What the study tests share: the command line of a ``parnas study`` of ``tiny`` small enough for a test, and
the rows of a study's table around a made-up front."""

SEEDS, RANDOM = 2, 1  # retrain seeds, random orderings per found layout


def study_args(corpus, out, *extra):
    settings = [f"data.path={corpus}", "data.vocab_size=300", "model.cutoffs=[100,200]", "data.eval_batch_size=32",
                "train.eval_every=1000", "train.warmup_steps=3", "search.log_every=5"]
    return ["study", "--config", "tiny", *[a for s in settings for a in ("--set", s)], "--seeds", str(SEEDS),
            "--budgets", "none", "--out", str(out), "--steps", "12,10",
            "--random-orderings", str(RANDOM), *extra]


def front_rows(found_ppls, front_std=None):
    rows = [{"role": "transformer-xl", "layout": "ADADADAD", "latency_ratio": 1.0, "val_ppl": 40.0,
             "val_ppl_std": front_std},
            {"role": "front", "layout": "ADADAD", "latency_ratio": 0.8, "val_ppl": 42.0, "val_ppl_std": front_std},
            {"role": "front", "layout": "ADAD", "latency_ratio": 0.6, "val_ppl": 46.0, "val_ppl_std": front_std},
            {"role": "front", "layout": "AD", "latency_ratio": 0.4, "val_ppl": 55.0, "val_ppl_std": front_std}]
    found = [{"role": "found", "layout": "AIAIDDDI", "latency_ratio": 0.7, "val_ppl": sum(p) / len(p),
              "val_ppl_seeds": p} for p in found_ppls]
    return rows + found, found
