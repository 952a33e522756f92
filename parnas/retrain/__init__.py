"""Retrain what a search found: the fixed PAR model of an architecture JSON, trained from scratch.

    parnas retrain --arch runs/search/architecture.json --config wt2-seed [--devices N --precision bf16-mixed]
    parnas retrain --arch transformer-xl --config wt2-seed          # baselines: transformer-xl, all-attention
    parnas retrain --arch ... --resume                               # continue from <out>/checkpoints/last.ckpt
    parnas evaluate RUN [--split test] [--mem-len 64]
    parnas generate RUN --prompt "The" --tokens 200 --seed 0
    parnas compare RUN_DIR... [--out PREFIX]

``run`` validates and trains (through :func:`parnas.training.fit.fit`), ``load`` rebuilds a
trained model from a checkpoint, ``evaluate`` measures and samples, ``compare``
tabulates runs, ``commands`` is the CLI.
"""
