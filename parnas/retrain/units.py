"""What a perplexity is per (the tokenizer's token, and its vocabulary): per SentencePiece piece is not per word,
nor comparable across tokenizers, so every perplexity evaluate, compare and retrain print says it. Only the standard
library, so ``parnas compare`` stays quick to refuse."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TOKENS = {"sentencepiece": "SentencePiece piece", "word": "word", "char": "byte"}


def perplexity_units(kind: str, vocab_size: int) -> str:
    """``per SentencePiece piece, vocabulary 1,000``: the token a perplexity is per, and how many there are."""
    return f"per {TOKENS.get(kind, f'{kind} token')}, vocabulary {vocab_size:,}"


def run_units(metrics: Mapping[str, Any]) -> str | None:
    """A finished run's units from its ``metrics.json`` (its tokenizer, its vocabulary); None where it does not say."""
    config, vocab = metrics.get("config"), metrics.get("vocab_size")
    kind = config.get("data", {}).get("tokenizer") if isinstance(config, dict) else None
    return perplexity_units(kind, int(vocab)) if isinstance(kind, str) and isinstance(vocab, int) else None
