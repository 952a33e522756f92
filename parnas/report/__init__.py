"""What a run leaves for people: the search's history, pictures (probabilities, heat map, architecture),
the Pareto figure, readers of nnictl experiments, and ``parnas plot``. Reads files; trains nothing.
"""
