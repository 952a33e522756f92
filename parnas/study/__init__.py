"""``parnas study``: the claim check over search and retrain together. Searches several seeds and
budgets, retrains what was found beside Transformer-XL and sandwich baselines, times them side by side,
and writes a verdict (``parnas.study.plan`` plans it, ``parnas.study.run`` runs it, ``parnas.study.verdicts``
concludes, ``parnas.study.report`` writes the tables and figure).
"""
