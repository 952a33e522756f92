"""Run configuration: frozen dataclasses, read from YAML, overridden by `--set`.

A config has four sections, ``model``, ``data``, ``train`` and ``search``. Every key is
checked against the dataclass (:mod:`parnas.overrides`): an unknown key, a wrong type or an
impossible value raises :class:`ConfigError` naming the key. Presets live as YAML files in
``parnas/presets`` and are loaded by name (``--config tiny``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from parnas import kinds, reading, strategy_registry
from parnas.arguments import presets  # the preset names, as --help lists them (re-exported here)
from parnas.errors import ConfigError
from parnas.overrides import from_dict, merge, parse_overrides, unflatten

BLOCK_KINDS = ("attention", "dense", "identity")  # PAR's candidates: the default search space (any kind: kinds)
# search.candidates by name: PAR's three, or PLANER's space (Latifi et al. 2022): PAR's three with fewer heads,
# other feed-forward widths and a mixture of experts
CANDIDATE_PRESETS = {"par": BLOCK_KINDS,
                     "planer": (*BLOCK_KINDS, "attention_half", "attention_quarter", "dense_half", "dense_double",
                                "moe")}
# What Lightning accepts that makes sense here (its deprecated aliases "16"/"bf16" and TPUs left out).
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
# torch.compile's modes for the fixed model ("none": eager; "reduce-overhead": CUDA graphs, on a GPU only)
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")
# what computes attention off the CPU (parnas.nn.blocks): SDPA with the position scores as a bias, or FlexAttention
ATTENTION_KERNELS = ("sdpa", "flex")
SEARCH_FORWARDS = ("mixed", "sampled")  # what a search step runs in each block (parnas.strategies.sampled)
BUDGET_HINGES = ("exported", "expected")  # which cost a latency budget's hinge is on (parnas.strategies.gumbel_darts)
SPECIAL_PIECES = 2  # a SentencePiece vocabulary's <unk> and <eos> (ids 0 and 1), before the corpus's own pieces
LATENCY_TARGETS = ("train", "inference", "generate")  # what a search's latency prices (parnas.training.latency)
TARGET_UNITS = {"train": "ms/step", "inference": "ms/segment", "generate": "ms/token"}
TARGET_LABELS = {"train": "train step", "inference": "inference segment", "generate": "generated token"}
PRECISIONS = ("32-true", "32", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true", "64")


def cluster_widths(d_model: int, n_clusters: int, div_value: float) -> list[int]:
    """Embedding width of each adaptive cluster: ``d_model // div_value**i`` (all ``d_model`` at div_value 1)."""
    return [int(d_model // div_value ** i) for i in range(n_clusters)]


@dataclass(frozen=True)
class ModelConfig:
    """Transformer-XL body: what every model has. ``blocks`` is the fixed layout; empty means the
    standard Transformer-XL (attention, dense, attention, dense, ...). ``share_weights``: kinds whose
    blocks share one module across depth (the ``shared`` kind always does).

    A kind's own settings are its own (:mod:`parnas.kinds`): a config gives them as
    ``model.<kind>.<setting>`` (``model.lsh.chunk_len: 8``); ``kind_settings`` holds those given, and
    :meth:`settings_of` a kind's, its defaults where none were given. The flat keys of earlier versions
    (``model.chunk_len``) still load, with a one-line note.

    ``eval_mem_len``: the memory (states per block) every evaluation keeps: validation, ``parnas evaluate`` and
    ``generate``, the ``inference`` and ``generate`` latency targets. Dai et al. evaluate with a longer memory
    than they train with, as users generate. None: each reader's default, ``mem_len`` (``mem_len + seg_len``
    to generate, :func:`generation_memory`); 0 is no memory, as ``--mem-len 0`` is. ``clamp_len`` (Dai et
    al.'s, 0: none): distances beyond it read its sinusoid, wherever the model runs. Model settings, because
    the model keeps its memory: every model built from a config evaluates at them, and a latency table's key,
    an architecture file and its retrain carry them as they carry ``mem_len``.
    """

    n_blocks: int = 6
    d_model: int = 128
    n_heads: int = 4
    d_ff: int = 512
    mem_len: int = 16
    dropout: float = 0.1
    dropatt: float = 0.0
    pre_norm: bool = False
    cutoffs: tuple[int, ...] = (250, 2500)
    div_value: float = 4.0
    tie_weights: bool = False
    adaptive_input: bool = False  # Baevski & Auli's adaptive input, with the softmax's cutoffs and div_value
    tie_projs: tuple[bool, ...] = ()  # per cluster: share the output projection with the embedding's (Dai et al.)
    share_position_bias: bool = False  # one content and one position bias (u, v) for all attention blocks
    blocks: tuple[str, ...] = ()
    share_weights: tuple[str, ...] = ()
    eval_mem_len: int | None = None  # the memory at evaluation and generation (None: the training one)
    clamp_len: int = 0  # relative distances beyond this read its position (0: none)
    reversible: bool = False  # reversible residual pairs (F, G): activations recomputed in backward
    attention_kernel: str = "sdpa"  # off the CPU: one of ATTENTION_KERNELS (the same weights and function)
    kind_settings: dict[str, Any] = field(default_factory=dict)  # kind -> its settings, as given (model.<kind>.*)

    def __post_init__(self) -> None:
        for key in ("n_blocks", "d_model", "n_heads", "d_ff"):
            _require(getattr(self, key) > 0, f"model.{key} must be > 0")
        _require(self.mem_len >= 0, "model.mem_len must be >= 0")
        _require(self.eval_mem_len is None or self.eval_mem_len >= 0,
                 f"model.eval_mem_len must be >= 0 (or null: the training memory), got {self.eval_mem_len}")
        _require(self.clamp_len >= 0, f"model.clamp_len must be >= 0 (0: no clamp), got {self.clamp_len}")
        _require(self.d_model % self.n_heads == 0,
                 f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        _require(self.d_model % 2 == 0, f"model.d_model ({self.d_model}) must be even (sinusoid positions)")
        for key in ("dropout", "dropatt"):
            _require(0.0 <= getattr(self, key) < 1.0, f"model.{key} must be in [0, 1)")
        _require(self.attention_kernel in ATTENTION_KERNELS, f"model.attention_kernel must be one of "
                 f"{', '.join(ATTENTION_KERNELS)}, not {self.attention_kernel!r}")
        _require(self.attention_kernel != "flex" or self.dropatt == 0.0,
                 f"model.attention_kernel=flex has no attention dropout: set model.dropatt=0 (not {self.dropatt:g}) "
                 "or use model.attention_kernel=sdpa")
        _require(all(a < b for a, b in zip(self.cutoffs, self.cutoffs[1:])) and all(c > 0 for c in self.cutoffs),
                 f"model.cutoffs {list(self.cutoffs)} must be positive and strictly increasing")
        _require(self.div_value >= 1.0, "model.div_value must be >= 1")
        _require(not self.adaptive_input or bool(self.cutoffs),
                 "model.adaptive_input needs model.cutoffs (its clusters are the softmax's)")
        _require(not (self.tie_weights and self.cutoffs and not self.adaptive_input and self.div_value != 1),
                 f"model.tie_weights with an adaptive softmax of div_value {self.div_value:g} needs "
                 "model.adaptive_input=true (each cluster's output weight is its embedding's), or div_value=1")
        _require(not self.tie_projs or len(self.tie_projs) == len(self.cutoffs) + 1,
                 f"model.tie_projs has {len(self.tie_projs)} entries: give one per cluster "
                 f"({len(self.cutoffs) + 1} with cutoffs {list(self.cutoffs)}), or none")
        _require(not any(self.tie_projs) or self.adaptive_input,
                 "model.tie_projs ties the softmax's projections to the adaptive input's: set model.adaptive_input")
        if self.cutoffs and (self.adaptive_input or self.tie_weights):
            _require(self.div_value == math.floor(self.div_value),
                     f"model.div_value {self.div_value:g} must be a whole number for model.adaptive_input or tied "
                     "weights")
            narrowest = cluster_widths(self.d_model, len(self.cutoffs) + 1, self.div_value)[-1]
            _require(narrowest >= 1, f"model.div_value {self.div_value:g} leaves the last of {len(self.cutoffs) + 1} "
                     f"clusters {narrowest} wide at d_model {self.d_model}: lower it or use fewer cutoffs")
        for kind in self.blocks:
            _require(kinds.is_known(kind), f"model.blocks: {kinds.unknown_message(kind)}")
        for kind, settings in self.kind_settings.items():
            declared = kinds.get(kind).settings
            _require(declared is not None and isinstance(settings, declared),
                     f"model.{kind}: settings must be {getattr(declared, '__name__', 'none (the kind has none)')}")
        if self.share_weights:
            kinds.check(self.share_weights, "model.share_weights")
            _require("identity" not in self.share_weights, "model.share_weights: identity has no weights to share")
        _require(not self.blocks or len(self.blocks) == self.n_blocks,
                 f"model.blocks has {len(self.blocks)} entries but model.n_blocks is {self.n_blocks}")
        if self.reversible:  # parnas.nn.reversible
            _require(self.n_blocks % 2 == 0,
                     f"model.reversible pairs the blocks (F, G): model.n_blocks must be even, not {self.n_blocks}")
            bad = sorted(kind for kind in set(self.layout) if not kinds.get(kind).reversible)
            _require(not bad, f"model.reversible cannot recompute {', '.join(bad)} blocks in the backward pass "
                     "(they keep their own memory or loss): use other kinds or model.reversible=false")

    @classmethod
    def regroup(cls, values: Mapping[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """For :func:`parnas.overrides.from_dict`: ``model.<kind>`` sections built into that kind's settings
        (``kind_settings``), the flat keys of earlier versions moved there with a one-line note."""
        if "kind_settings" in values:
            raise ConfigError(f"unknown config key {prefix}kind_settings; give a kind's settings as "
                              f"{prefix}<kind>.<setting>")
        values, given = upgrade_flat_settings(values, prefix), {}
        fields = {f.name for f in dataclasses.fields(cls)} - {"kind_settings"}
        for key in [k for k in values if k not in fields and kinds.is_known(k)]:
            section = values.pop(key)
            if not isinstance(section, Mapping):
                raise ConfigError(f"{prefix}{key} must be a mapping of the {key} kind's settings, got {section!r}")
            given[key] = {**given.get(key, {}), **section}
        built = {}
        for kind, section in given.items():
            settings = kinds.get(kind).settings
            if settings is None:
                raise ConfigError(f"{prefix}{kind}: the {kind} kind has no settings")
            try:
                made = from_dict(settings, section, f"{prefix}{kind}.")
            except ConfigError as e:
                message = str(e)
                raise ConfigError(message if f"{prefix}{kind}." in message else f"{prefix}{kind}.{message}") from None
            if made != settings():  # only what differs from the defaults: one config, one value
                built[kind] = made
        return values, {"kind_settings": built} if built else {}

    def settings_of(self, kind: str) -> Any:
        """Kind ``kind``'s settings: those given, else its defaults (None for a kind without settings)."""
        given = self.kind_settings.get(kind)
        return given if given is not None else kinds.default_settings(kind)

    def to_dict(self) -> dict[str, Any]:
        """As a config gives it: each built-in kind's settings (and any given) as a ``<kind>`` section."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "kind_settings"}
        named = dict.fromkeys([*kinds.with_settings(), *self.kind_settings])
        return out | {kind: dataclasses.asdict(self.settings_of(kind)) for kind in named}

    @property
    def evaluation_memory(self) -> int:
        """States the memory keeps in evaluation: ``eval_mem_len``, else the training ``mem_len``."""
        return self.mem_len if self.eval_mem_len is None else self.eval_mem_len

    @property
    def layout(self) -> tuple[str, ...]:
        """The block kinds in order (the standard Transformer-XL when ``blocks`` is empty)."""
        return self.blocks or transformer_xl_layout(self.n_blocks)

    def shares_weights(self, kind: str) -> bool:
        """Whether all blocks of ``kind`` reuse one module (Universal Transformer-style depth recurrence)."""
        return kind in self.share_weights or kinds.get(kind).shared

    def check_vocab(self, vocab_size: int) -> None:
        """Cutoffs only make sense strictly inside the vocabulary."""
        if self.cutoffs and self.cutoffs[-1] >= vocab_size:
            raise ConfigError(f"model.cutoffs {list(self.cutoffs)} must all be < the vocabulary size {vocab_size}")


@dataclass(frozen=True)
class DataConfig:
    """Corpus, tokenizer and context batching (B streams of segments of L tokens)."""

    dataset: str = "wikitext-2"
    path: str | None = None
    tokenizer: str = "sentencepiece"
    vocab_size: int = 12000
    sp_model_type: str = "unigram"
    batch_size: int = 32
    seg_len: int = 32
    eval_batch_size: int = 32

    @property
    def step_tokens(self) -> int:
        """Tokens a training step computes on one device: ``batch_size`` streams of ``seg_len``."""
        return self.batch_size * self.seg_len

    def __post_init__(self) -> None:
        _require(self.tokenizer in ("sentencepiece", "word", "char"),
                 f"data.tokenizer must be sentencepiece, word or char, not {self.tokenizer!r}")
        _require(self.sp_model_type in ("unigram", "bpe"), "data.sp_model_type must be unigram or bpe")
        for key in ("vocab_size", "batch_size", "seg_len", "eval_batch_size"):
            _require(getattr(self, key) > 0, f"data.{key} must be > 0")
        _require(self.tokenizer != "sentencepiece" or self.vocab_size > SPECIAL_PIECES,
                 f"data.vocab_size={self.vocab_size} leaves a SentencePiece vocabulary no room for the corpus's "
                 f"pieces (its first {SPECIAL_PIECES} are <unk> and the end of a line): set a larger data.vocab_size")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping. Steps count optimiser updates."""

    max_steps: int = 1000
    stop_at: int = 0  # stop after this many steps (0: max_steps); the schedule still spans max_steps
    lr: float = 2.5e-4
    warmup_steps: int = 100
    min_lr: float = 0.0
    clip: float = 0.25
    weight_decay: float = 0.0
    accumulate: int = 1
    eval_every: int = 500
    log_every: int = 50
    ckpt_every: int = 1000
    seed: int = 0
    accelerator: str = "auto"
    devices: int = 1  # processes per machine
    num_nodes: int = 1  # machines (DDP across them; launched by torchrun or SLURM)
    threads: int = 0  # torch's threads per process (0: parnas.threads chooses, or OMP_NUM_THREADS if set)
    precision: str = "32-true"
    compile: str = "none"  # torch.compile the fixed model: one of COMPILE_MODES
    out_dir: str = "runs/train"

    def __post_init__(self) -> None:
        for key in ("max_steps", "accumulate", "eval_every", "log_every", "ckpt_every", "devices", "num_nodes"):
            _require(getattr(self, key) > 0, f"train.{key} must be > 0")
        _require(self.threads >= 0, f"train.threads must be >= 0 (0: chosen per run), got {self.threads}")
        _require(0 <= self.stop_at <= self.max_steps,
                 "train.stop_at must be in [0, train.max_steps] (0: run to the end)")
        _require(self.lr > 0, "train.lr must be > 0")
        _require(0 <= self.min_lr <= self.lr, "train.min_lr must be in [0, train.lr]")
        _require(self.warmup_steps >= 0, "train.warmup_steps must be >= 0")
        _require(self.clip >= 0, "train.clip must be >= 0 (0 turns clipping off)")
        _require(self.weight_decay >= 0, f"train.weight_decay must be >= 0, got {self.weight_decay}")
        _require(self.accelerator in ACCELERATORS,
                 f"train.accelerator must be one of {', '.join(ACCELERATORS)}, not {self.accelerator!r}")
        _require(self.precision in PRECISIONS,
                 f"train.precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        _require(self.compile in COMPILE_MODES,
                 f"train.compile must be one of {', '.join(COMPILE_MODES)}, not {self.compile!r}")


@dataclass(frozen=True)
class SearchConfig:
    """The Gumbel-DARTS search (strategies/): what is chosen, how tau anneals, how logits learn.

    ``mode``: ``joint`` updates logits and weights from the same training batch
    (the original TensorFlow PAR Transformer-XL's procedure); ``bilevel`` is first-order DARTS, logits stepping on
    the validation stream with its own memory.

    The cost of an architecture is its predicted step time relative to the
    standard Transformer-XL at the same ``n_blocks`` (``penalty_cost: latency``,
    timed on the device; ``flops`` is a proxy, not what you pay).
    ``latency_budget`` (e.g. 0.65) makes it a constraint the exported
    architecture must meet: a hinge, lambda x max(0, cost - budget), on the
    ``budget_hinge`` cost: ``exported`` (the argmax layout's, its gradient that
    of the expected cost) or ``expected`` (under softmax(alpha), as PLANER does).
    Its multiplier lambda is found by dual ascent at rate ``dual_lr``, or fixed
    by ``penalty_weight`` (PLANER's form). Without a budget, ``penalty_weight``
    is a fixed lambda on the expected cost itself.

    ``latency_table``: a table written by ``parnas latency`` (on the target
    device, e.g. a GPU) to price the blocks with instead of timing them here; its
    shapes must be the run's, its device may be any.

    ``strategy``: a name in the strategy registry (:mod:`parnas.strategy_registry`): its default,
    ``par-gumbel-darts``, is this search; NNI's own and plugins' are the others (``parnas search --strategy``).

    ``latency_target``: which latency the cost is: ``train`` (a training step),
    ``inference`` (a forward pass over a batch of segments) or ``generate``
    (one token decoded at batch 1, as ``parnas generate`` does).

    ``forward``: what a training step runs in each block: ``mixed``, every
    candidate, weighted by the Gumbel sample (DARTS); ``sampled``, one candidate
    drawn from softmax(alpha), so the step costs a sampled architecture's, and
    the logits learn from the loss by REINFORCE. ``sampled`` runs in one process
    (a rank would skip the weights of what it did not pick).

    ``export_samples``: at the end, also draw this many layouts from softmax(alpha)
    (those over the budget are dropped) and export whichever of them and the argmax
    has the lowest validation perplexity with the supernet's weights (0: the argmax).
    """

    candidates: tuple[str, ...] = BLOCK_KINDS
    mode: str = "joint"
    tau_start: float = 1.0
    tau_end: float = 0.1
    tau_schedule: str = "exponential"
    hard: bool = False
    forward: str = "mixed"  # one of SEARCH_FORWARDS
    arch_lr: float = 3.0e-3
    arch_weight_decay: float = 0.0
    arch_warmup_steps: int = 0
    penalty_weight: float = 0.0
    penalty_cost: str = "latency"
    latency_budget: float | None = None
    budget_hinge: str = "exported"
    latency_table: str | None = None
    latency_target: str = "train"
    strategy: str = strategy_registry.DEFAULT
    trials: int = 8  # a multi-trial strategy's trials, each training one architecture for train.max_steps
    export_samples: int = 0
    dual_lr: float = 0.05
    log_every: int = 10
    out_dir: str = "runs/search"

    @classmethod
    def regroup(cls, values: Mapping[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """For :func:`parnas.overrides.from_dict`: ``candidates`` may name a preset (CANDIDATE_PRESETS)."""
        values = dict(values)
        named = values.get("candidates")
        if isinstance(named, str):
            if named not in CANDIDATE_PRESETS:
                raise ConfigError(f"{prefix}candidates: no preset named {named!r}; presets: "
                                  f"{', '.join(CANDIDATE_PRESETS)}, or give a list of kinds")
            values["candidates"] = list(CANDIDATE_PRESETS[named])
        return values, {}

    def __post_init__(self) -> None:
        kinds.check(self.candidates, "search.candidates")
        _require(len(self.candidates) >= 2,
                 f"search.candidates must name at least two kinds, got {list(self.candidates)}")
        _require(self.mode in ("joint", "bilevel"), f"search.mode must be joint or bilevel, not {self.mode!r}")
        _require(self.tau_schedule in ("exponential", "linear", "cosine"),
                 f"search.tau_schedule must be exponential, linear or cosine, not {self.tau_schedule!r}")
        _require(self.tau_end > 0, "search.tau_end must be > 0")
        _require(self.tau_end <= self.tau_start,
                 f"search.tau_end ({self.tau_end}) must not exceed search.tau_start ({self.tau_start})")
        _require(self.arch_lr > 0, "search.arch_lr must be > 0")
        _require(self.arch_weight_decay >= 0, "search.arch_weight_decay must be >= 0")
        _require(self.arch_warmup_steps >= 0, "search.arch_warmup_steps must be >= 0")
        _require(self.penalty_weight >= 0, f"search.penalty_weight must be >= 0, got {self.penalty_weight}")
        _require(self.penalty_cost in ("latency", "flops"),
                 f"search.penalty_cost must be latency or flops, not {self.penalty_cost!r}")
        if self.latency_budget is not None:
            _require(0.0 < self.latency_budget <= 1.0,
                     f"search.latency_budget must be in (0, 1] (a fraction of Transformer-XL's step time), "
                     f"got {self.latency_budget}")
            _require(self.penalty_cost == "latency", "search.latency_budget is a fraction of measured latency: "
                     "set search.penalty_cost=latency")
        _require(self.budget_hinge in BUDGET_HINGES,
                 f"search.budget_hinge must be one of {', '.join(BUDGET_HINGES)}, not {self.budget_hinge!r}")
        _require(self.budget_hinge == "exported" or self.latency_budget is not None,
                 f"search.budget_hinge={self.budget_hinge} hinges the cost at search.latency_budget: set one")
        _require(self.latency_table is None or self.penalty_cost == "latency",
                 "search.latency_table prices blocks by measured latency: set search.penalty_cost=latency")
        _require(strategy_registry.is_known(self.strategy),
                 f"search.strategy: {strategy_registry.unknown_message(self.strategy)}")
        _require(self.trials >= 1, f"search.trials must be >= 1, got {self.trials}")
        _require(self.export_samples >= 0, f"search.export_samples must be >= 0, got {self.export_samples}")
        _require(self.forward in SEARCH_FORWARDS,
                 f"search.forward must be one of {', '.join(SEARCH_FORWARDS)}, not {self.forward!r}")
        _require(self.forward == "mixed" or self.forward in strategy_registry.get(self.strategy).forwards,
                 f"search.forward={self.forward} is not a mode of search.strategy={self.strategy}, which runs its "
                 f"own supernet; strategies that run it: {', '.join(strategy_registry.running(self.forward))}")
        _require(self.latency_target in LATENCY_TARGETS,
                 f"search.latency_target must be one of {', '.join(LATENCY_TARGETS)}, not {self.latency_target!r}")
        _require(self.latency_target == "train" or self.penalty_cost == "latency",
                 f"search.latency_target={self.latency_target} is a measured latency: set search.penalty_cost=latency")
        _require(self.dual_lr > 0, f"search.dual_lr must be > 0, got {self.dual_lr}")
        _require(self.log_every > 0, "search.log_every must be > 0")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    search: SearchConfig = field(default_factory=SearchConfig)

    def __post_init__(self) -> None:
        # Checked here, once, rather than inside every DDP process Lightning would start.
        processes = self.train.devices * self.train.num_nodes
        for key in ("batch_size", "eval_batch_size"):
            size = getattr(self.data, key)
            _require(size % processes == 0,
                     f"data.{key} ({size}) must be divisible by the {processes} processes "
                     "(train.devices x train.num_nodes): each process reads whole streams")
        _require(self.search.forward == "mixed" or processes == 1,
                 f"search.forward=sampled runs in one process, not {processes} (train.devices x train.num_nodes): DDP "
                 "would wait for the gradients of candidates a rank did not run")
        offered = [*self.model.layout, *self.search.candidates, *self.model.kind_settings]
        for kind in dict.fromkeys(offered):  # each kind a run may build, or was given settings for, against the shapes
            registered = kinds.loaded(kind)  # a plugin is checked once loaded: its settings given, or its block built
            if registered is not None and registered.check is not None:
                registered.check(self, self.model.settings_of(kind))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"model": self.model.to_dict()}


# the flat keys of the kinds' settings before each kind owned its own: read, with a note, as model.<kind>.<setting>
FLAT_KIND_SETTINGS = {"conv_kernel": ("conv", "kernel"), "compress_rate": ("compressive", "rate"),
                      "compress_len": ("compressive", "length"), "compress_fn": ("compressive", "fn"),
                      "n_buckets": ("lsh", "n_buckets"), "n_hashes": ("lsh", "n_hashes"),
                      "chunk_len": ("lsh", "chunk_len"), "act_max_steps": ("ut", "max_steps"),
                      "act_tau": ("ut", "tau")}


def upgrade_flat_settings(model: Mapping[str, Any], prefix: str = "model.", note: bool = True) -> dict[str, Any]:
    """A model section with the flat keys of earlier versions moved to their kinds' sections, with a one-line
    ``note`` on stderr for each (a setting given both ways keeps the kind's section's value)."""
    model = dict(model)
    for old, (kind, key) in FLAT_KIND_SETTINGS.items():
        if old in model:
            if note:
                print(f"parnas: {prefix}{old} is deprecated: use {prefix}{kind}.{key}", file=sys.stderr)
            value, section = model.pop(old), model.get(kind)
            model[kind] = {key: value, **section} if isinstance(section, Mapping) else section or {key: value}
    return model


def generation_memory(model: ModelConfig, seg_len: int) -> int:
    """States the memory keeps while ``parnas generate`` decodes: ``model.eval_mem_len``, else ``mem_len + seg_len``,
    the longest context a training step showed the model."""
    return model.mem_len + seg_len if model.eval_mem_len is None else model.eval_mem_len


def transformer_xl_layout(n_blocks: int) -> tuple[str, ...]:
    """The standard Transformer-XL at ``n_blocks``: attention, dense, attention, dense, ..."""
    return tuple(("attention", "dense")[i % 2] for i in range(n_blocks))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def read_yaml(source: str | Path) -> dict[str, Any]:
    """Read a config file, or a preset by name (``tiny``, ``wt2-seed``)."""
    path = Path(source)
    if not path.suffix and not path.exists():
        preset = resources.files("parnas") / "presets" / f"{source}.yaml"
        if not preset.is_file():
            raise ConfigError(f"no config file or preset named {str(source)!r}; presets: {', '.join(presets())}")
        text = preset.read_text()
    else:
        try:
            text = reading.read_text(path)
        except OSError as e:
            raise ConfigError(f"cannot read config {source}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{source} is not a YAML config (not UTF-8 text)") from None
    try:
        values = reading.parse_yaml(text, str(source))
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} is not valid YAML: {str(e).splitlines()[0]}") from None
    if values is None:  # nothing but blanks and comments: almost surely not the file meant
        raise ConfigError(f"{source}: empty config; omit --config for the defaults")
    if not isinstance(values, dict):
        raise ConfigError(f"{source} must hold a mapping of sections (model, data, train)")
    return values


def load_config(source: str | Path | None = None, overrides: Sequence[str] = (),
                extra: Mapping[str, Any] | None = None) -> Config:
    """File or preset, then ``extra`` (e.g. NNI trial parameters), then ``--set`` pairs."""
    values = read_yaml(source) if source is not None else {}
    values = merge(values, unflatten(extra or {}))
    values = merge(values, parse_overrides(overrides))
    return from_dict(Config, values)
