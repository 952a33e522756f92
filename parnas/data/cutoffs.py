"""Optimal adaptive-softmax cutoffs under Grave et al.'s GPU cost model (arXiv:1609.04309).

A product of an ``m x k`` by a ``k x n`` matrix costs ``max(min_macs, m*k*n)`` multiply-adds (the paper's
per-product constant cannot move the optimum). For torch's ``nn.AdaptiveLogSoftmaxWithLoss``, ``B`` target
tokens and cutoffs ``0 < c_1 < ... < c_K < V``, the head is ``B x d`` by ``d x (c_1 + K)`` and tail cluster ``i``
takes only its ``B * p_i`` tokens through ``d x d_i`` then ``d_i x size_i`` (``d_i = int(d // div_value**i)``;
``projection=False``: the paper's single product at full ``d``). Masses are taken in id order, because the model
groups ids by range.

:func:`exact_cutoffs` is the O(K N^2) dynamic programme of the original TensorFlow PAR Transformer-XL.
:func:`optimal_cutoffs` finds the same optimum in O(K N log N): each cluster's cost obeys the quadrangle
inequality (its mass is additive, mass x size a sum over a square of a non-negative matrix, ``max(min_macs, x)``
convex and non-decreasing), so the optimal next cutoff never decreases as a cluster's start grows and divide and
conquer finds every row's minimum (Yao 1980). Ties (products under the floor) go to the largest cutoffs in both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from parnas.errors import ParnasError

if TYPE_CHECKING:
    from parnas.config import DataConfig
    from parnas.data.tokenizer import Tokenizer

PAPER_MIN_MACS = 50 * 500 * 512  # k0 * B0 * d on the paper's K40 GPU


class CutoffsError(ParnasError):
    """A cutoffs request that cannot be met (too many clusters, no counts)."""


@dataclass(frozen=True)
class SoftmaxCost:
    """Grave et al.'s cost of one training step's adaptive softmax, in multiply-adds."""

    tokens: float = 1024.0  # B: target tokens a step (batch_size * seg_len)
    d_model: int = 128
    div_value: float = 4.0
    min_macs: float = float(PAPER_MIN_MACS)
    projection: bool = True

    def matmul(self, m: np.ndarray | float, k: np.ndarray | float, n: np.ndarray | float) -> np.ndarray:
        return np.maximum(self.min_macs, np.asarray(m, dtype=np.float64) * k * n)

    def hidden(self, cluster: int) -> int:
        """Tail cluster ``cluster``'s (1-based) projection size, as torch computes it."""
        try:
            return int(self.d_model // (self.div_value ** cluster))
        except OverflowError:  # div_value ** cluster beyond a float: nothing is left
            return 0

    def head(self, c1: np.ndarray | int, n_clusters: int) -> np.ndarray:
        return self.matmul(self.tokens, self.d_model, np.asarray(c1) + n_clusters)

    def tail(self, cluster: int, mass: np.ndarray | float, size: np.ndarray | int) -> np.ndarray:
        rows = self.tokens * np.asarray(mass, dtype=np.float64)
        if not self.projection:
            return self.matmul(rows, self.d_model, size)
        h = self.hidden(cluster)
        return self.matmul(rows, self.d_model, h) + self.matmul(rows, h, size)

    def cost(self, probs: np.ndarray, cutoffs: Sequence[int]) -> float:
        """Cost of ``cutoffs`` (empty: a full softmax) for unigram probabilities ``probs`` in id order."""
        prefix = _prefix(probs)
        n, cuts = len(probs), [int(c) for c in cutoffs]
        _check_cutoffs(cuts, n)
        if not cuts:
            return float(self.matmul(self.tokens, self.d_model, n))
        total = float(self.head(cuts[0], len(cuts)))
        for i, (a, b) in enumerate(zip(cuts, [*cuts[1:], n]), start=1):
            total += float(self.tail(i, prefix[b] - prefix[a], b - a))
        return total


@dataclass(frozen=True)
class Cutoffs:
    cutoffs: tuple[int, ...]
    cost: float  # multiply-adds a step under the cost model


def unigram_counts(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """Occurrences of every id in ``ids`` (length ``vocab_size``)."""
    counts = np.bincount(np.asarray(ids, dtype=np.int64).ravel(), minlength=vocab_size)
    if len(counts) > vocab_size:
        raise CutoffsError(f"token id {len(counts) - 1} is outside the vocabulary of {vocab_size}")
    return counts


def probabilities(counts: np.ndarray) -> np.ndarray:
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 1 or counts.sum() <= 0 or (counts < 0).any():
        raise CutoffsError("unigram counts must be non-negative and not all zero: the train split needs tokens")
    return counts / counts.sum()


def check_clusters(n_clusters: int, vocab_size: int) -> None:
    """K tail clusters need ``0 < c_1 < ... < c_K < V``: at least K + 1 ids."""
    if n_clusters < 1:
        raise CutoffsError(f"--clusters must be >= 1 (the number of tail clusters), got {n_clusters}")
    if n_clusters > vocab_size - 1:
        raise CutoffsError(f"--clusters {n_clusters} needs a vocabulary of at least {n_clusters + 1} ids "
                           f"(a head plus {n_clusters} non-empty clusters), this one has {vocab_size}; "
                           f"use --clusters {max(vocab_size - 1, 1)} or fewer")


def check_model(n_clusters: int, model: SoftmaxCost) -> None:
    """torch shrinks tail cluster i to ``d_model // div_value**i`` features; zero features is no model."""
    if model.projection and model.hidden(n_clusters) < 1:
        most = next(i - 1 for i in range(1, n_clusters + 1) if model.hidden(i) < 1)
        fewer = f"use --clusters {most} or fewer, or " if most else "use "
        raise CutoffsError(f"--clusters {n_clusters} leaves tail cluster {n_clusters} no features (d_model "
                           f"{model.d_model} // div_value {model.div_value:g}**{n_clusters} = 0); {fewer}"
                           "a smaller model.div_value")


def _checked_prefix(probs: np.ndarray, n_clusters: int, model: SoftmaxCost) -> tuple[np.ndarray, int, int]:
    """Cumulative probabilities, vocabulary size and K, once the request is known to make sense."""
    probs = np.asarray(probs, dtype=np.float64)
    check_clusters(n_clusters, len(probs))
    check_model(n_clusters, model)
    return _prefix(probs), len(probs), n_clusters


def exact_cutoffs(probs: np.ndarray, n_clusters: int, model: SoftmaxCost) -> Cutoffs:
    """The O(K N^2) dynamic programme of the original TensorFlow PAR Transformer-XL: the reference answer (largest
    cutoffs among ties)."""
    prefix, n, k = _checked_prefix(probs, n_clusters, model)
    future = np.full(n + 1, np.inf)
    future[n] = 0.0
    choices = {}
    for i in range(k, 0, -1):
        value, choice = np.full(n + 1, np.inf), np.zeros(n + 1, dtype=np.int64)
        col_hi = n - (k - i)
        for a in range(i, col_hi):
            b = np.arange(a + 1, col_hi + 1)
            v = model.tail(i, prefix[b] - prefix[a], b - a) + future[b]
            j = _last_argmin(v)
            value[a], choice[a] = v[j], b[j]
        future, choices[i] = value, choice
    return _finish(model, future, choices, n, k)


def optimal_cutoffs(probs: np.ndarray, n_clusters: int, model: SoftmaxCost) -> Cutoffs:
    """The same optimum as :func:`exact_cutoffs` in O(K N log N) (divide and conquer on a Monge matrix)."""
    prefix, n, k = _checked_prefix(probs, n_clusters, model)
    future = np.full(n + 1, np.inf)
    future[k:n] = model.tail(k, prefix[n] - prefix[k:n], n - np.arange(k, n))  # the last cluster ends at V
    choices = {k: np.full(n + 1, n, dtype=np.int64)}
    for i in range(k - 1, 0, -1):
        nxt = future

        def cost(a: np.ndarray, b: np.ndarray, i: int = i, nxt: np.ndarray = nxt) -> np.ndarray:
            return model.tail(i, prefix[b] - prefix[a], b - a) + nxt[b]

        value, choice = np.full(n + 1, np.inf), np.zeros(n + 1, dtype=np.int64)
        lo, hi = i, n - (k - i) - 1  # rows: where cluster i may start
        value[lo:hi + 1], choice[lo:hi + 1] = _monotone_row_minima(cost, lo, hi, n - (k - i))
        future, choices[i] = value, choice
    return _finish(model, future, choices, n, k)


def _monotone_row_minima(cost: Callable[[np.ndarray, np.ndarray], np.ndarray], lo: int, hi: int, col_hi: int
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Leftmost minimum of ``cost(a, b)`` over ``b in (a, col_hi]`` for each row ``a in [lo, hi]``,
    assuming the argmin is non-decreasing in ``a``. Divide and conquer, one vectorised pass per level."""
    values, args = np.empty(hi - lo + 1), np.empty(hi - lo + 1, dtype=np.int64)
    r_lo, r_hi = np.array([lo]), np.array([hi])
    c_lo, c_hi = np.array([lo + 1]), np.array([col_hi])
    while r_lo.size:
        mid = (r_lo + r_hi) // 2
        start = np.maximum(c_lo, mid + 1)
        length = c_hi - start + 1
        seg = np.repeat(np.arange(mid.size), length)
        offsets = np.cumsum(length) - length
        cols = start[seg] + np.arange(seg.size) - offsets[seg]
        v = cost(mid[seg], cols)
        mins = np.minimum.reduceat(v, offsets)
        best = np.maximum.reduceat(np.where(v == mins[seg], cols, -1), offsets)  # rightmost minimum
        values[mid - lo], args[mid - lo] = mins, best
        left, right = mid > r_lo, mid < r_hi
        r_lo, r_hi, c_lo, c_hi = (np.concatenate(x) for x in (
            (r_lo[left], mid[right] + 1), (mid[left] - 1, r_hi[right]),
            (c_lo[left], best[right]), (best[left], c_hi[right])))
    return values, args


def _finish(model: SoftmaxCost, future: np.ndarray, choices: dict[int, np.ndarray], n: int, k: int) -> Cutoffs:
    starts = np.arange(1, n - k + 1)
    totals = model.head(starts, k) + future[starts]
    j = _last_argmin(totals)
    cuts = [int(starts[j])]
    for i in range(1, k):
        cuts.append(int(choices[i][cuts[-1]]))
    return Cutoffs(tuple(cuts), float(totals[j]))


def _last_argmin(v: np.ndarray) -> int:
    return len(v) - 1 - int(np.argmin(v[::-1]))


def _prefix(probs: np.ndarray) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(np.asarray(probs, dtype=np.float64))))


def _check_cutoffs(cuts: Sequence[int], n: int) -> None:
    if any(a >= b for a, b in zip(cuts, cuts[1:])) or (cuts and (cuts[0] <= 0 or cuts[-1] >= n)):
        raise CutoffsError(f"cutoffs {list(cuts)} must be strictly increasing, > 0 and < the vocabulary size {n}")


def cluster_table(probs: np.ndarray, cutoffs: Sequence[int]) -> list[tuple[int, int, float]]:
    """``(first id, end id, unigram mass)`` of the head's shortlist and of each tail cluster."""
    prefix, bounds = _prefix(probs), [0, *cutoffs, len(probs)]
    return [(a, b, float(prefix[b] - prefix[a])) for a, b in zip(bounds, bounds[1:])]


# --- counts from a corpus -------------------------------------------------------------------------

def train_counts(cfg: DataConfig, tokenizer_file: str | Path | None = None) -> tuple[Tokenizer, np.ndarray]:
    """Unigram counts of the train split of ``cfg``'s corpus, by id: with ``cfg``'s tokenizer and cached ids, as
    training has them, or with ``tokenizer_file`` (:func:`load_tokenizer`), which encodes the split uncached."""
    from parnas.data.corpora import load_splits, resolve_corpus

    if tokenizer_file is None:
        tokenizer, splits = load_splits(cfg)
        return tokenizer, unigram_counts(splits["train"], tokenizer.vocab_size)
    tokenizer = load_tokenizer(tokenizer_file)
    corpus = resolve_corpus(cfg.dataset, cfg.path)
    return tokenizer, unigram_counts(tokenizer.encode_file(corpus / "train.txt"), tokenizer.vocab_size)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A SentencePiece ``*.model``, a word or char ``vocab.txt``, or a folder holding one of them."""
    from parnas.data.tokenizer import CharTokenizer, SentencePieceTokenizer, WordTokenizer

    path = Path(path).expanduser()
    if path.is_dir():
        found = [path / name for name in ("spm.model", "vocab.txt") if (path / name).is_file()]
        if not found:
            raise CutoffsError(f"{path} holds no spm.model or vocab.txt; pass a tokenizer file or a kind "
                               "(sentencepiece, word, char)")
        path = found[0]
    if not path.is_file():
        raise CutoffsError(f"no tokenizer file {path}; pass an spm.model, a vocab.txt, or a kind "
                           "(sentencepiece, word, char)")
    try:
        if path.suffix == ".model":
            return SentencePieceTokenizer(path)
        entries = path.read_text(encoding="utf-8").split("\n")[:-1]
        is_char = all(e in ("<eos>", "<unk>") or e.isdigit() and int(e) < 256 for e in entries)
        return (CharTokenizer if is_char else WordTokenizer)(path)
    except (OSError, RuntimeError, UnicodeDecodeError, KeyError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CutoffsError(f"cannot load the tokenizer {path}: {first}") from None
