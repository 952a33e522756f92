"""Retrain what a search found, then measure it: ``run`` trains (through :func:`parnas.training.fit.fit`), ``load``
rebuilds a trained model from a checkpoint, ``evaluate`` measures and samples, ``compare`` tabulates runs,
``commands`` is the CLI (usage: docs/reference.md, "Retraining what was found")."""
