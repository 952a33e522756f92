"""A trained model back from a checkpoint (:func:`parnas.training.checkpoint.load`, ``weights_only``): its config,
its architecture (rebuilt as retrain built it) and its tokenizer's own file, so sampling needs no corpus and evaluation
encodes the corpus with exactly the tokenizer the model was trained with."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from parnas.config import Config
from parnas.data.tokenizer import CharTokenizer, SentencePieceTokenizer, Tokenizer, WordTokenizer
from parnas.errors import ConfigError
from parnas.nn.model import TransformerXL
from parnas.training import checkpoint as ckpt

TOKENIZERS: dict[str, type[Tokenizer]] = {"sentencepiece": SentencePieceTokenizer, "word": WordTokenizer,
                                          "char": CharTokenizer}


@dataclass
class TrainedModel:
    model: TransformerXL
    config: Config
    tokenizer: Tokenizer
    step: int
    history: tuple[dict[str, Any], ...] = ()  # the run's validations up to this checkpoint: {"step", "val_ppl", ...}


def device_for(accelerator: str) -> torch.device:
    """``--accelerator``: ``auto`` is CUDA if present, else the CPU; ``gpu`` (CUDA device 0) and ``mps`` must exist."""
    if accelerator == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if accelerator == "gpu" and not torch.cuda.is_available():
        raise ConfigError("--accelerator gpu asked for, but no CUDA device is available; use --accelerator cpu")
    if accelerator == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("--accelerator mps asked for, but MPS is not available; use --accelerator cpu")
    if accelerator not in ("cpu", "gpu", "mps"):
        raise ConfigError(f"--accelerator must be auto, cpu, gpu or mps, not {accelerator!r}")
    return torch.device("cuda" if accelerator == "gpu" else accelerator)


def restore_tokenizer(meta: Mapping[str, Any], folder: Path, source: str) -> Tokenizer:
    """The tokenizer whose file the checkpoint carries, checked against its recorded identity."""
    kind, data, corpus = meta.get("kind"), meta.get("file"), meta.get("corpus_sha256")
    if (kind not in TOKENIZERS or not isinstance(data, torch.Tensor) or data.dtype != torch.uint8
            or not isinstance(corpus, str)):
        raise ckpt.CheckpointError(f"{source}: its tokenizer record is missing or damaged")
    path = folder / Path(str(meta.get("filename", "tokenizer"))).name
    path.write_bytes(data.numpy().tobytes())
    try:
        tokenizer = TOKENIZERS[kind](path)
    except Exception as e:  # a file SentencePiece or the vocabulary reader cannot parse
        raise ckpt.CheckpointError(f"{source}: its tokenizer cannot be loaded ({e})") from None
    if meta.get("sha256") != tokenizer.sha256:
        raise ckpt.CheckpointError(f"{source}: its tokenizer file does not match its recorded sha256")
    tokenizer.corpus_sha256 = corpus  # evaluation checks the corpus against it
    return tokenizer


def load_trained(path: str | Path, device: torch.device, workdir: Path) -> TrainedModel:
    """Rebuild the model of checkpoint ``path`` on ``device``, weights loaded strictly; ``workdir`` receives the
    tokenizer file (keep it while the tokenizer is used)."""
    from parnas.search_spaces import fixed_model

    source = str(path)
    checkpoint = ckpt.load(path)
    meta = checkpoint["parnas"]
    cfg, record = ckpt.fixed_model_record(checkpoint, source)
    tokenizer = restore_tokenizer(meta["tokenizer"], workdir, source)
    if tokenizer.vocab_size != record["model"]["vocab_size"]:
        raise ckpt.CheckpointError(f"{source}: its tokenizer has {tokenizer.vocab_size} pieces but the model "
                                   f"{record['model']['vocab_size']}")
    model = fixed_model(replace(cfg.model, blocks=()), tokenizer.vocab_size, record["architecture"])
    # the task holds the model as ``_model`` (NNI's set_model): strip that prefix
    state = {k.split(".", 1)[1] if k.startswith(("_model.", "model.")) else k: v
             for k, v in checkpoint["state_dict"].items()}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ckpt.CheckpointError(f"{source}: its weights do not fit its architecture "
                                   f"({str(e).splitlines()[0]})") from None
    return TrainedModel(model.to(device).eval(), cfg, tokenizer, int(checkpoint.get("global_step", 0)),
                        tuple(meta.get("val_history") or ()))


def scratch_dir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="parnas-")
