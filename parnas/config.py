"""Run configuration: frozen dataclasses, read from YAML, overridden by `--set`.

A config has four sections, ``model``, ``data``, ``train`` and ``search``. Every key is checked against the dataclass
(:mod:`parnas.overrides`): an unknown key, a wrong type or an impossible value raises :class:`ConfigError` naming the
key. Presets live as YAML files in ``parnas/presets`` and are loaded by name (``--config tiny``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parnas import kinds, strategy_registry
from parnas.arguments import presets as presets  # the preset names, as --help lists them (read here too)
from parnas.config_files import is_preset, read_yaml
from parnas.errors import ConfigError, require
from parnas.kinds.registry import KINDS
from parnas.overrides import from_dict, merge, parse_overrides, unflatten
from parnas.registry import OwnsSettings

BLOCK_KINDS = ("attention", "dense", "identity")  # PAR's candidates: the default search space (any kind: kinds)
# search.candidates by name: PAR's three, or PLANER's space (Latifi et al. 2022): PAR's three with fewer heads,
# other feed-forward widths and a mixture of experts
CANDIDATE_PRESETS = {"par": BLOCK_KINDS,
                     "planer": (*BLOCK_KINDS, "attention_half", "attention_quarter", "dense_half", "dense_double",
                                "moe")}
# What Lightning accepts that makes sense here (its deprecated aliases "16"/"bf16" and TPUs left out).
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
# torch.compile's modes for the model, a search's supernet too ("none": eager; "reduce-overhead": CUDA graphs, GPU only)
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")
# what computes attention off the CPU (parnas.nn.blocks): SDPA with the position scores as a bias, or FlexAttention
ATTENTION_KERNELS = ("sdpa", "flex")
SPECIAL_PIECES = 2  # a SentencePiece vocabulary's <unk> and <eos> (ids 0 and 1), before the corpus's own pieces
LATENCY_TARGETS = ("train", "inference", "generate")  # what a search's latency prices (parnas.training.latency)
TARGET_UNITS = {"train": "ms/step", "inference": "ms/segment", "generate": "ms/token"}
TARGET_LABELS = {"train": "train step", "inference": "inference segment", "generate": "generated token"}
PRECISIONS = ("32-true", "32", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true", "64")


def cluster_widths(d_model: int, n_clusters: int, div_value: float) -> list[int]:
    """Embedding width of each adaptive cluster: ``d_model // div_value**i`` (all ``d_model`` at div_value 1)."""
    return [int(d_model // div_value ** i) for i in range(n_clusters)]


@dataclass(frozen=True)
class ModelConfig(OwnsSettings):
    """Transformer-XL body: what every model has (settings: docs/reference.md). ``blocks`` is the fixed layout;
    empty means the standard Transformer-XL. A kind's own settings, ``model.<kind>.<setting>``, are held as given
    in ``kind_settings`` and read through :meth:`settings_of`. ``eval_mem_len`` and ``clamp_len`` are model
    settings because the model keeps its memory: every model built from a config evaluates at them, and a latency
    table's key, an architecture file and its retrain carry them as they carry ``mem_len``.
    """

    n_blocks: int = 6
    d_model: int = 128
    n_heads: int = 4
    d_ff: int = 512
    mem_len: int = 16
    dropout: float = 0.1
    dropatt: float = 0.0
    cutoffs: tuple[int, ...] = (250, 2500)
    div_value: float = 4.0
    tie_weights: bool = False
    adaptive_input: bool = False  # Baevski & Auli's adaptive input, with the softmax's cutoffs and div_value
    tie_projs: tuple[bool, ...] = ()  # per cluster: share the output projection with the embedding's (Dai et al.)
    share_position_bias: bool = False  # one content and one position bias (u, v) for all attention blocks
    blocks: tuple[str, ...] = ()
    eval_mem_len: int | None = None  # the memory at evaluation and generation (None: the training one)
    clamp_len: int = 0  # relative distances beyond this read its position (0: none)
    reversible: bool = False  # reversible residual pairs (F, G): activations recomputed in backward
    attention_kernel: str = "sdpa"  # off the CPU: one of ATTENTION_KERNELS (the same weights and function)
    kind_settings: dict[str, Any] = field(default_factory=dict)  # kind -> its settings, as given (model.<kind>.*)
    OWNERS, WHAT, GIVEN = KINDS, "kind", "kind_settings"

    def __post_init__(self) -> None:
        for key in ("n_blocks", "d_model", "n_heads", "d_ff"):
            require(getattr(self, key) > 0, f"model.{key} must be > 0")
        require(self.mem_len >= 0, "model.mem_len must be >= 0")
        require(self.eval_mem_len is None or self.eval_mem_len >= 0,
                 f"model.eval_mem_len must be >= 0 (or null: the training memory), got {self.eval_mem_len}")
        require(self.clamp_len >= 0, f"model.clamp_len must be >= 0 (0: no clamp), got {self.clamp_len}")
        require(self.d_model % self.n_heads == 0,
                 f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        require(self.d_model % 2 == 0, f"model.d_model ({self.d_model}) must be even (sinusoid positions)")
        for key in ("dropout", "dropatt"):
            require(0.0 <= getattr(self, key) < 1.0, f"model.{key} must be in [0, 1)")
        require(self.attention_kernel in ATTENTION_KERNELS, f"model.attention_kernel must be one of "
                 f"{', '.join(ATTENTION_KERNELS)}, not {self.attention_kernel!r}")
        require(self.attention_kernel != "flex" or self.dropatt == 0.0,
                 f"model.attention_kernel=flex has no attention dropout: set model.dropatt=0 (not {self.dropatt:g}) "
                 "or use model.attention_kernel=sdpa")
        require(all(a < b for a, b in zip(self.cutoffs, self.cutoffs[1:])) and all(c > 0 for c in self.cutoffs),
                 f"model.cutoffs {list(self.cutoffs)} must be positive and strictly increasing")
        require(self.div_value >= 1.0, "model.div_value must be >= 1")
        require(not self.adaptive_input or bool(self.cutoffs),
                 "model.adaptive_input needs model.cutoffs (its clusters are the softmax's)")
        require(not (self.tie_weights and self.cutoffs and not self.adaptive_input and self.div_value != 1),
                 f"model.tie_weights with an adaptive softmax of div_value {self.div_value:g} needs "
                 "model.adaptive_input=true (each cluster's output weight is its embedding's), or div_value=1")
        require(not self.tie_projs or len(self.tie_projs) == len(self.cutoffs) + 1,
                 f"model.tie_projs has {len(self.tie_projs)} entries: give one per cluster "
                 f"({len(self.cutoffs) + 1} with cutoffs {list(self.cutoffs)}), or none")
        require(not any(self.tie_projs) or self.adaptive_input,
                 "model.tie_projs ties the softmax's projections to the adaptive input's: set model.adaptive_input")
        if self.cutoffs and (self.adaptive_input or self.tie_weights):
            require(self.div_value == math.floor(self.div_value),
                     f"model.div_value {self.div_value:g} must be a whole number for model.adaptive_input or tied "
                     "weights")
            narrowest = cluster_widths(self.d_model, len(self.cutoffs) + 1, self.div_value)[-1]
            require(narrowest >= 1, f"model.div_value {self.div_value:g} leaves the last of {len(self.cutoffs) + 1} "
                     f"clusters {narrowest} wide at d_model {self.d_model}: lower it or use fewer cutoffs")
        for kind in self.blocks:
            require(kinds.is_known(kind), f"model.blocks: {kinds.unknown_message(kind)}")
        self.check_given("model.")
        require(not self.blocks or len(self.blocks) == self.n_blocks,
                 f"model.blocks has {len(self.blocks)} entries but model.n_blocks is {self.n_blocks}")
        if self.reversible:  # parnas.nn.reversible
            require(self.n_blocks % 2 == 0,
                     f"model.reversible pairs the blocks (F, G): model.n_blocks must be even, not {self.n_blocks}")
            bad = sorted(kind for kind in set(self.layout) if not kinds.get(kind).reversible)
            require(not bad, f"model.reversible cannot recompute {', '.join(bad)} blocks in the backward pass "
                     "(they keep their own memory or loss): use other kinds or model.reversible=false")

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
        return kinds.get(kind).shared

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
    batch_size: int = 32
    seg_len: int = 32
    eval_batch_size: int = 32

    @property
    def step_tokens(self) -> int:
        """Tokens a training step computes on one device: ``batch_size`` streams of ``seg_len``."""
        return self.batch_size * self.seg_len

    def __post_init__(self) -> None:
        require(self.tokenizer in ("sentencepiece", "word", "char"),
                 f"data.tokenizer must be sentencepiece, word or char, not {self.tokenizer!r}")
        for key in ("vocab_size", "batch_size", "seg_len", "eval_batch_size"):
            require(getattr(self, key) > 0, f"data.{key} must be > 0")
        require(self.tokenizer != "sentencepiece" or self.vocab_size > SPECIAL_PIECES,
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
    eval_every: int = 500
    log_every: int = 50
    ckpt_every: int = 1000
    seed: int = 0
    accelerator: str = "auto"
    devices: int = 1  # processes per machine
    num_nodes: int = 1  # machines (DDP across them; launched by torchrun or SLURM)
    threads: int = 0  # torch's threads per process (0: parnas.threads chooses, or OMP_NUM_THREADS if set)
    precision: str = "32-true"
    compile: str = "none"  # torch.compile the model (or a search's supernet): one of COMPILE_MODES
    out_dir: str = "runs/train"

    def __post_init__(self) -> None:
        for key in ("max_steps", "eval_every", "log_every", "ckpt_every", "devices", "num_nodes"):
            require(getattr(self, key) > 0, f"train.{key} must be > 0")
        require(self.threads >= 0, f"train.threads must be >= 0 (0: chosen per run), got {self.threads}")
        require(0 <= self.seed < 2**32, f"train.seed must be in 0..{2**32 - 1} (2**32 - 1, the seeds Lightning's "
                 f"seed_everything and NumPy take), got {self.seed}")
        require(0 <= self.stop_at <= self.max_steps,
                 "train.stop_at must be in [0, train.max_steps] (0: run to the end)")
        require(self.lr > 0, "train.lr must be > 0")
        require(0 <= self.min_lr <= self.lr, "train.min_lr must be in [0, train.lr]")
        require(self.warmup_steps >= 0, "train.warmup_steps must be >= 0")
        require(self.clip >= 0, "train.clip must be >= 0 (0 turns clipping off)")
        require(self.accelerator in ACCELERATORS,
                 f"train.accelerator must be one of {', '.join(ACCELERATORS)}, not {self.accelerator!r}")
        require(self.precision in PRECISIONS,
                 f"train.precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        require(self.compile in COMPILE_MODES,
                 f"train.compile must be one of {', '.join(COMPILE_MODES)}, not {self.compile!r}")


@dataclass(frozen=True)
class SearchConfig(OwnsSettings):
    """What every search has (settings: docs/reference.md, "Searching"): the candidates, the strategy, the cost,
    its target and logging. A strategy's own settings, ``search.<strategy>.<setting>``, are held as given in
    ``strategy_settings``; :attr:`settings` are the chosen strategy's. The cost of an architecture is its
    predicted step time relative to the standard Transformer-XL at the same ``n_blocks`` (``flops``: a proxy).
    ``weight_lr`` exists because a supernet is judged by how its weights rank layouts and may want a faster rate
    than a fixed model; ``train.lr`` stays what the final pick and ``parnas retrain`` train with.
    """

    candidates: tuple[str, ...] = BLOCK_KINDS
    arch_lr: float = 3.0e-3
    weight_lr: float | None = None
    penalty_cost: str = "latency"
    latency_table: str | None = None
    latency_target: str = "train"
    strategy: str = strategy_registry.DEFAULT
    trials: int = 8
    log_every: int = 10
    out_dir: str = "runs/search"
    strategy_settings: dict[str, Any] = field(default_factory=dict)  # strategy -> its settings, as given
    OWNERS, WHAT, GIVEN = strategy_registry.STRATEGIES, "strategy", "strategy_settings"

    @classmethod
    def regroup(cls, values: Mapping[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """For :func:`parnas.overrides.from_dict`: ``candidates`` may name a preset (CANDIDATE_PRESETS), and
        ``search.<strategy>`` sections are built into that strategy's settings (``strategy_settings``)."""
        named = values.get("candidates")
        if isinstance(named, str):
            if named not in CANDIDATE_PRESETS:
                raise ConfigError(f"{prefix}candidates: no preset named {named!r}; presets: "
                                  f"{', '.join(CANDIDATE_PRESETS)}, or give a list of kinds")
            values = {**values, "candidates": list(CANDIDATE_PRESETS[named])}
        return super().regroup(values, prefix)

    def __post_init__(self) -> None:
        kinds.check(self.candidates, "search.candidates")
        require(len(self.candidates) >= 2,
                 f"search.candidates must name at least two kinds, got {list(self.candidates)}")
        require(self.arch_lr > 0, "search.arch_lr must be > 0")
        require(self.weight_lr is None or self.weight_lr > 0,
                 f"search.weight_lr must be > 0 (or null: train.lr), got {self.weight_lr}")
        require(self.penalty_cost in ("latency", "flops"),
                 f"search.penalty_cost must be latency or flops, not {self.penalty_cost!r}")
        require(self.latency_table is None or self.penalty_cost == "latency",
                 "search.latency_table prices blocks by measured latency: set search.penalty_cost=latency")
        require(strategy_registry.is_known(self.strategy),
                 f"search.strategy: {strategy_registry.unknown_message(self.strategy)}")
        self.check_given("search.")
        require(self.trials >= 1, f"search.trials must be >= 1, got {self.trials}")
        require(self.latency_target in LATENCY_TARGETS,
                 f"search.latency_target must be one of {', '.join(LATENCY_TARGETS)}, not {self.latency_target!r}")
        require(self.latency_target == "train" or self.penalty_cost == "latency",
                 f"search.latency_target={self.latency_target} is a measured latency: set search.penalty_cost=latency")
        require(self.log_every > 0, "search.log_every must be > 0")

    @property
    def settings(self) -> Any:
        """The settings of the strategy this search runs (``search.strategy``)."""
        return self.settings_of(self.strategy)

    def weights_lr(self, train: TrainConfig) -> tuple[str, float]:
        """The setting that gives a supernet's weights their learning rate, and the rate."""
        return ("train.lr", train.lr) if self.weight_lr is None else ("search.weight_lr", self.weight_lr)


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
            require(size % processes == 0,
                     f"data.{key} ({size}) must be divisible by the {processes} processes "
                     "(train.devices x train.num_nodes): each process reads whole streams")
        strategy = strategy_registry.loaded(self.search.strategy)  # a plugin is checked once loaded, as a kind is
        settings = self.search.settings if strategy is not None and strategy.settings is not None else None
        if hasattr(settings, "check"):  # what the strategy's own settings need of the rest of the config
            settings.check(self)
        if self.train.compile == "reduce-overhead":
            syncing = kinds.syncing(self.model.layout)
            require(not syncing, f"train.compile=reduce-overhead replays the step as CUDA graphs, and "
                     f"{', '.join(syncing)} blocks read values back to the host in their forward, which a graph "
                     "cannot hold: use train.compile=default (or none) for this layout")
        offered = [*self.model.layout, *self.search.candidates, *self.model.kind_settings]
        for kind in dict.fromkeys(offered):  # each kind a run may build, or was given settings for, against the shapes
            registered = kinds.loaded(kind)  # a plugin is checked once loaded: its settings given, or its block built
            if registered is not None and registered.check is not None:
                registered.check(self, self.model.settings_of(kind))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"model": self.model.to_dict(), "search": self.search.to_dict()}


def generation_memory(model: ModelConfig, seg_len: int) -> int:
    """States the memory keeps while ``parnas generate`` decodes: ``model.eval_mem_len``, else ``mem_len + seg_len``,
    the longest context a training step showed the model."""
    return model.mem_len + seg_len if model.eval_mem_len is None else model.eval_mem_len


def transformer_xl_layout(n_blocks: int) -> tuple[str, ...]:
    """The standard Transformer-XL at ``n_blocks``: attention, dense, attention, dense, ..."""
    return tuple(("attention", "dense")[i % 2] for i in range(n_blocks))


def load_config(source: str | Path | None = None, overrides: Sequence[str] = (),
                extra: Mapping[str, Any] | None = None) -> Config:
    """File or preset, then ``extra`` (e.g. NNI trial parameters), then ``--set`` pairs.

    A strategy's settings given here (in the user's own file, ``extra`` or ``--set``) for a strategy other than the
    one that runs are refused: nothing would read them, and the user would believe them in force. A preset's
    sections are its defaults for whichever strategy runs, and stay silent."""
    values = read_yaml(source) if source is not None else {}
    given = merge(unflatten(extra or {}), parse_overrides(overrides))
    cfg = from_dict(Config, merge(values, given))
    user = given if source is None or is_preset(source) else merge(values, given)
    search = user.get("search") if isinstance(user.get("search"), Mapping) else {}
    own = {f.name for f in dataclasses.fields(SearchConfig)}
    for name in search:
        require(name in own or name == cfg.search.strategy or not strategy_registry.is_known(name),
                 f"search.{name} holds the {name} strategy's settings, but this search runs "
                 f"{cfg.search.strategy}: drop them, or set search.strategy={name}")
    return cfg
