"""``parnas study``: the claim check over search and retrain together. Searches several seeds and
budgets, retrains what was found beside Transformer-XL and sandwich baselines, times them side by side,
and writes a verdict (``parnas.study.run`` plans and runs it, ``parnas.study.report`` writes the tables and figure).
"""
