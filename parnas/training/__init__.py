"""Training with Lightning: the language-model task (memory carried, exact resume), the fit loop and its
callbacks, checkpoints, interrupts, the device and memory checks, and the latency tables timed on the device.

Uses :mod:`parnas.nn` and :mod:`parnas.data`; the search strategies and retraining build on it.
"""
