"""``parnas study``: the claim check over search and retrain together (``plan`` plans it, ``run`` runs it,
``verdicts`` concludes, ``report`` writes the tables and figure), and the ranking tables of a search space.
"""
