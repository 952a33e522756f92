"""``parnas evaluate`` and ``parnas generate``: a checkpoint's perplexity, and samples from it.

Evaluation is :func:`parnas.training.evaluation.split_metrics`, the function that wrote the perplexity at the end of
training, with the checkpoint's tokenizer: the same checkpoint gives the same figure. Sampling feeds the prompt in
training-length segments, then one token at a time, carrying the memory. A prompt ending with a whole word keeps it
(the first token drawn starts a new word: "The album was" + "th" would print "The album wasth"), and shows as the user
wrote it (:func:`shown_prompt`), not as its ids decode. The unknown token is never drawn: dropping it at decoding
would print text the model did not condition on, and fewer tokens than asked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parnas.config import generation_memory
from parnas.data.corpora import resolve_corpus
from parnas.data.tokenizer import Tokenizer, file_digest
from parnas.errors import ConfigError, DataError, ParnasError
from parnas.retrain.load import TrainedModel
from parnas.training.data_module import SegmentData
from parnas.training.evaluation import divergence, divergence_step, model_device, split_metrics
from parnas.training.task import diverged_error


def evaluate_checkpoint(trained: TrainedModel, split: str, mem_len: int | None = None,
                        data_path: str | None = None, clamp_len: int | None = None) -> dict[str, Any]:
    """Whole-split perplexity of ``trained`` and tokens/s (:func:`parnas.training.evaluation.split_metrics`), where
    its weights are. ``mem_len``, ``clamp_len``: None keeps the checkpoint's (``model.eval_mem_len``, ``clamp_len``)."""
    if split not in ("valid", "test"):
        raise ConfigError(f"--split must be valid or test, not {split!r}")
    cfg = trained.config
    for flag, value in (("--mem-len", mem_len), ("--clamp-len", clamp_len)):
        if value is not None and value < 0:
            raise ConfigError(f"{flag} must be >= 0")
    trained.model.evaluate_with(mem_len, clamp_len)
    corpus = resolve_corpus(cfg.data.dataset, data_path or cfg.data.path)
    check_corpus(trained, corpus)
    ids = trained.tokenizer.encode_file(corpus / f"{split}.txt")
    data = SegmentData({split: ids}, cfg.data.batch_size, cfg.data.eval_batch_size, cfg.data.seg_len)
    out = split_metrics(trained.model, data, split, cfg.train.precision)
    name = "val" if split == "valid" else split
    return {"split": split, "ppl": out[f"{name}_ppl"], "loss": out[f"{name}_loss"], "tokens": out[f"{name}_tokens"],
            "eval_tokens_per_s": out[f"{name}_eval_tokens_per_s"], "eval_seconds": out[f"{name}_eval_seconds"],
            "mem_len": trained.model.eval_mem_len, "clamp_len": trained.model.clamp_len,
            "step": trained.step, "corpus": str(corpus), "device": str(model_device(trained.model)),
            "diverged": evaluation_divergence(trained, split, out[f"{name}_loss"]) is not None}


def evaluation_divergence(trained: TrainedModel, split: str, loss: float | None) -> ParnasError | None:
    """The line a checkpoint whose ``split`` loss (None: not finite) diverged ends ``parnas evaluate`` with, the one
    its training ended with (the step its validations stayed diverged since); None when it did not diverge."""
    vocab_size, step = trained.model.vocab_size, trained.step
    first = divergence_step(trained.history, step, vocab_size)
    what = "the validation loss" if split == "valid" else f"the {split} loss"
    return divergence(loss, vocab_size, first, trained.config.train.lr, what, measured_at=step)


def weights_divergence(trained: TrainedModel) -> ParnasError | None:
    """The line a checkpoint whose weights are not all finite ends a command with (its training's, checked before any
    work: sampling would draw from NaN probabilities); None when every floating-point weight is finite."""
    weights = {name: t for name, t in trained.model.state_dict().items()
               if t.is_floating_point() and t.device.type != "meta"}  # a meta model has no values to check
    finite = [torch.isfinite(t).all() for t in weights.values()]
    if not finite or bool(torch.stack(finite).all()):  # one read back to the host, not one per tensor
        return None
    bad = [name for name, ok in zip(weights, finite) if not bool(ok)]
    step = divergence_step(trained.history, trained.step, trained.model.vocab_size)
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    return diverged_error(step, f"the checkpoint's weights are not finite: {bad[0]}{more}", trained.config.train.lr)


def check_corpus(trained: TrainedModel, corpus: Path) -> None:
    """``corpus`` must be the one the checkpoint's tokenizer was built on (its train split's recorded sha256): another
    corpus' perplexity measures text whose token statistics the model never saw, under a vocabulary made for other."""
    if file_digest(corpus / "train.txt") != trained.tokenizer.corpus_sha256:
        trained_on = trained.config.data.path or trained.config.data.dataset
        raise DataError(f"{corpus} is not the corpus the checkpoint's tokenizer was built on (its train.txt is not "
                        f"the one recorded), so its perplexity would not measure this model; give --data-path the "
                        f"corpus it was trained on ({trained_on}), wherever it is now")


MAX_TOKENS = 100_000  # tokens one `parnas generate` samples at most: each is a forward pass; more is a typo


@dataclass(frozen=True)
class Sampling:
    tokens: int = 200
    temperature: float = 1.0  # 0: always the most likely token
    top_k: int = 0  # 0: the whole vocabulary
    seed: int = 0
    mem_len: int | None = None  # None: the checkpoint's (parnas.config.generation_memory)
    clamp_len: int | None = None  # None: the checkpoint's model.clamp_len

    def __post_init__(self) -> None:
        if self.tokens <= 0:
            raise ConfigError("--tokens must be > 0")
        if self.tokens > MAX_TOKENS:
            raise ConfigError(f"--tokens {self.tokens:,} is above the {MAX_TOKENS:,} one run samples at most: "
                              "ask for fewer")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError("--temperature must be >= 0 (0 picks the most likely token)")
        if self.top_k < 0:
            raise ConfigError("--top-k must be >= 0 (0 keeps the whole vocabulary)")
        if not 0 <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
            raise ConfigError(f"--seed must be in 0..2**64 - 1, got {self.seed}")
        for flag, value in (("--mem-len", self.mem_len), ("--clamp-len", self.clamp_len)):
            if value is not None and value < 0:
                raise ConfigError(f"{flag} must be >= 0")


def prompt_ids(trained: TrainedModel, prompt: str) -> list[int]:
    """eos (a line starts after one, as in training) then the prompt's lines, eos between them."""
    tok = trained.tokenizer
    ids = [tok.eos_id]
    for i, line in enumerate(prompt.split("\n")):
        if i:
            ids.append(tok.eos_id)
        ids.extend(tok.encode(line) if line else [])
    return ids


def ends_a_word(trained: TrainedModel, prompt: str) -> bool:
    """Whether the prompt, as the tokenizer reads it, ends with a letter or digit (a word the continuation must
    not extend). SentencePiece drops a trailing space, so "The album was " ends a word too."""
    text = trained.tokenizer.decode(prompt_ids(trained, prompt)[1:])
    return text[-1:].isalnum()


def shown_prompt(prompt: str, decoded: str) -> str:
    """The prompt as printed: the user's own text, less the trailing spaces its decoded ids lack (SentencePiece
    drops them, and the continuation's first word brings its own)."""
    trailing = len(prompt) - len(prompt.rstrip(" \t"))
    kept = min(trailing, len(decoded) - len(decoded.rstrip(" \t")))
    return prompt[:len(prompt) - trailing + kept]


class TextStream:
    """The text of ids as they come, handed to ``write`` piece by piece: the pieces join into what
    ``tokenizer.decode`` gives for all the ids (the prompt's excepted, :meth:`add_prompt`). Only the current line is
    decoded again as it grows; a token whose text would change what was written (pieces that join into one
    character) waits until the line's text extends it again."""

    def __init__(self, tokenizer: Tokenizer, write: Callable[[str], None]) -> None:
        self.tokenizer, self.write = tokenizer, write
        self.line: list[int] = []
        self.shown = ""  # of the current line, as its ids decode
        self.generated = 0
        self.pieces: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def _write(self, piece: str) -> None:
        self.pieces.append(piece)
        self.write(piece)

    def add_prompt(self, prompt: str, ids: Sequence[int]) -> None:
        """The prompt as the user wrote it; its ``ids`` taken in unwritten, to decode the continuation with its line."""
        ids = [int(i) for i in ids]
        self._write(shown_prompt(prompt, self.tokenizer.decode(ids)))
        breaks = [k for k, i in enumerate(ids) if i == self.tokenizer.eos_id]
        self.line = ids[breaks[-1] + 1:] if breaks else ids
        self.shown = self.tokenizer.decode(self.line)

    def add(self, ids: Sequence[int], generated: bool = False) -> None:
        for i in ids:
            if i == self.tokenizer.eos_id:
                self._show()
                self._write("\n")
                self.line, self.shown = [], ""
            else:
                self.line.append(int(i))
        self._show()
        self.generated += len(ids) if generated else 0

    def _show(self) -> None:
        text = self.tokenizer.decode(self.line)
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self._write(text[len(self.shown):])
            self.shown = text


@torch.no_grad()
def generate(trained: TrainedModel, prompt: str, opts: Sampling,
             stream: TextStream | None = None) -> tuple[str, list[int]]:
    """Sample ``opts.tokens`` tokens after ``prompt``, handed to ``stream`` as they are drawn; returns the prompt as
    written + the continuation, and the new ids. Runs where the model's weights are, its generator too."""
    diverged = weights_divergence(trained)
    if diverged is not None:
        raise diverged
    model, cfg = trained.model.eval(), trained.config
    device = model_device(model)
    model.evaluate_with(opts.mem_len if opts.mem_len is not None else generation_memory(cfg.model, cfg.data.seg_len),
                        opts.clamp_len)
    generator = torch.Generator(device=device).manual_seed(opts.seed) if opts.temperature else None  # greedy: none
    ids = prompt_ids(trained, prompt)
    context = torch.tensor([ids], device=device)  # (1, P)
    stream = stream if stream is not None else TextStream(trained.tokenizer, lambda piece: None)
    stream.add_prompt(prompt, ids[1:])  # without the line start before it
    mems, L = None, cfg.data.seg_len
    for t in range(0, context.size(1), L):  # the prompt in training-length segments
        h, mems = model(context[:, t:t + L], mems)  # (1, <=L, D)
    new: list[int] = []
    for _ in range(opts.tokens):
        logp = model.log_probs(h[:, -1]).float()  # (1, V)
        logp[:, trained.tokenizer.unk_id] = float("-inf")  # the unknown-token marker is no text to print
        if not new and ends_a_word(trained, prompt):
            starts = torch.from_numpy(trained.tokenizer.word_starts()).to(device)  # (V,)
            logp = logp.masked_fill(~starts, float("-inf"))
        if opts.temperature == 0:
            token = logp.argmax(-1, keepdim=True)  # (1, 1)
        else:
            logits = logp / opts.temperature
            if 0 < opts.top_k < logits.size(-1):
                kth = logits.topk(opts.top_k, dim=-1).values[:, -1:]  # (1, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = torch.multinomial(logits.softmax(-1), 1, generator=generator)  # (1, 1)
        new.append(int(token))
        stream.add(new[-1:], generated=True)
        h, mems = model(token, mems)  # (1, 1, D)
    return stream.text, new
