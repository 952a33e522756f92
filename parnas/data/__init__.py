"""Text to token ids: corpora (found, or downloaded and checked), tokenizers, context batching and the
adaptive-softmax cutoffs chosen from token frequencies. Knows nothing of models or training.
"""
