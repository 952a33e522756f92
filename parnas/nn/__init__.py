"""The model, everything ``torch.nn``: the blocks a depth may choose, the other kinds (convolution, GLU,
squared ReLU, compressive memory, shared weights), the Transformer-XL body and its output head.

Imports only :mod:`parnas.config` and the kind registry: a model change stays inside this package.
"""
