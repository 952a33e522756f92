"""PAR's Gumbel-DARTS's own settings, ``search.par-gumbel-darts.<setting>`` in a config, checked before torch loads.

The strategy registry names :class:`PARSettings` as ``par-gumbel-darts``'s settings; the search
(:mod:`parnas.strategies.search`, :mod:`parnas.strategies.gumbel_darts`) reads them as ``cfg.search.settings``.
What the settings mean: the strategy's module docstring. This module imports no torch, so a config is checked
without loading it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from parnas import kinds
from parnas.config_upgrade import upgrade_config
from parnas.errors import ConfigError
from parnas.strategy_registry import PAR_GUMBEL_DARTS

MODES = ("joint", "bilevel")  # logits and weights from one batch, or first-order DARTS on the validation stream
TAU_SCHEDULES = ("exponential", "linear", "cosine")  # how tau moves from tau_start to tau_end, every step
SEARCH_FORWARDS = ("auto", "mixed", "sampled", "fair")  # what a step runs in each block (strategies.sampled, .fair)
BUDGET_HINGES = ("exported", "expected")  # which cost a latency budget's hinge is on (parnas.strategies.gumbel_darts)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(value: str, allowed: tuple[str, ...], key: str) -> None:
    _require(value in allowed, f"{key} must be one of {', '.join(allowed)}, not {value!r}")


@dataclass(frozen=True)
class PARSettings:
    """``mode``: ``joint`` updates logits and weights from the same training batch (the original TensorFlow PAR
    Transformer-XL's procedure); ``bilevel`` is first-order DARTS, the logits stepping on the validation stream
    with its own memory. tau anneals from ``tau_start`` to ``tau_end`` by ``tau_schedule`` every step; ``hard``:
    straight-through samples. ``forward``: what a step runs in each block, ``mixed`` (every candidate, weighted by
    the Gumbel sample), ``sampled`` (one candidate drawn from softmax(alpha), the logits learning by REINFORCE;
    one process), ``fair`` (every candidate of every block once a step, on the same batch: strict-fair training,
    :mod:`parnas.strategies.fair`; one process) or ``auto`` (:meth:`resolved`: fair in one process, mixed in several).
    The logits' optimiser has ``arch_weight_decay`` and stays still
    for ``arch_warmup_steps``.
    ``budget_hinge``: the cost a ``search.latency_budget``'s hinge is on, ``exported`` (the argmax layout's) or
    ``expected`` (under softmax(alpha), as PLANER does); its multiplier steps by dual ascent at rate ``dual_lr``
    unless ``search.penalty_weight`` fixes it. ``export_samples``: at the end, also draw this many layouts from
    softmax(alpha) and export the best by validation perplexity with the supernet's weights (0: the argmax)."""

    mode: str = "joint"
    tau_start: float = 1.0
    tau_end: float = 0.1
    tau_schedule: str = "exponential"
    hard: bool = False
    forward: str = "auto"
    arch_weight_decay: float = 0.0
    arch_warmup_steps: int = 0
    budget_hinge: str = "exported"
    export_samples: int = 0
    dual_lr: float = 0.05

    def __post_init__(self) -> None:
        _one_of(self.mode, MODES, "mode")
        _one_of(self.tau_schedule, TAU_SCHEDULES, "tau_schedule")
        _one_of(self.forward, SEARCH_FORWARDS, "forward")
        _one_of(self.budget_hinge, BUDGET_HINGES, "budget_hinge")
        _require(self.tau_end > 0, f"tau_end must be > 0, got {self.tau_end}")
        _require(self.tau_end <= self.tau_start,
                 f"tau_end ({self.tau_end}) must not exceed tau_start ({self.tau_start})")
        _require(self.arch_weight_decay >= 0, f"arch_weight_decay must be >= 0, got {self.arch_weight_decay}")
        _require(self.arch_warmup_steps >= 0, f"arch_warmup_steps must be >= 0, got {self.arch_warmup_steps}")
        _require(self.export_samples >= 0, f"export_samples must be >= 0, got {self.export_samples}")
        _require(self.dual_lr > 0, f"dual_lr must be > 0, got {self.dual_lr}")

    def check(self, cfg: Any) -> None:
        """What the settings need of the rest of the config ``cfg`` (a :class:`parnas.config.Config` whose
        ``search.strategy`` they belong to)."""
        section, processes = f"search.{cfg.search.strategy}", cfg.train.devices * cfg.train.num_nodes
        _require(self.budget_hinge == "exported" or cfg.search.latency_budget is not None,
                 f"{section}.budget_hinge={self.budget_hinge} hinges the cost at search.latency_budget: set one")
        _require(self.forward in ("auto", "mixed") or processes == 1,
                 f"{section}.forward={self.forward} runs in one process, not {processes} (train.devices x "
                 "train.num_nodes): "
                 "DDP would wait for the gradients of candidates a rank did not run")


    def resolved(self, processes: int, trained: str | None = None) -> PARSettings:
        """These settings with ``forward: auto`` made concrete for a search in ``processes`` processes: ``fair``
        in one, ``mixed`` in several (DDP would wait for the gradients of candidates a rank did not run); any
        other forward as given. Why fair: on both ranking tables (``benchmarks/spaces``) a strictly fair
        supernet ordered the layouts best at equal training compute, Kendall tau 0.62-0.67 in PLANER's eight
        kinds (mixed 0.37-0.42, sampled 0.29-0.40) and 0.53-0.66 in PAR's three (mixed 0.35-0.41); its logits
        alone can export a poor layout (the all-dense network at 4 blocks), which the final pick's retrains
        and its guard catch. ``trained``: the forward a resumed search's checkpoint trained with
        (:func:`trained_forward`), which ``auto`` keeps: a search continues as it started."""
        if self.forward != "auto":
            return self
        return replace(self, forward=trained or ("fair" if processes == 1 else "mixed"))

    def unread(self) -> list[str]:
        """The Gumbel sample's settings given away from their defaults that these (resolved) settings never
        read: ``tau_*`` and ``hard`` shape the sample that mixes the candidates, which a ``fair`` or ``sampled``
        step does not draw (its picks are permutations, or drawn from softmax(alpha)); in ``bilevel`` mode the
        logits' stream still mixes, and reads them."""
        if self.forward == "mixed" or self.mode == "bilevel":
            return []
        return [key for key in ("tau_start", "tau_end", "tau_schedule", "hard")
                if getattr(self, key) != getattr(PARSettings, key)]


def written_forward(checkpoint: Mapping[str, Any]) -> str:
    """The ``forward`` setting of the config a PAR search's ``checkpoint`` was started with (as
    :func:`parnas.training.checkpoint.load` reads it): ``mixed`` where it has none (the default before ``auto``)."""
    search = upgrade_config(checkpoint["parnas"]["config"], note=False).get("search") or {}
    return (search.get(PAR_GUMBEL_DARTS) or {}).get("forward", "mixed")


def trained_forward(checkpoint: Mapping[str, Any]) -> str:
    """The forward a PAR search's ``checkpoint`` trained with. Recorded in it since ``auto`` trains fair in every
    one-process search; an older checkpoint says it by its config (:func:`written_forward`): a concrete one, or
    ``auto``, which then trained fair above three kinds a block in one process and mixed otherwise."""
    meta = checkpoint["parnas"]
    forward = (meta.get("search") or {}).get("forward") or written_forward(checkpoint)
    if forward != "auto":
        return forward
    search, train = meta["config"].get("search") or {}, meta["config"].get("train") or {}
    processes = train.get("devices", 1) * train.get("num_nodes", 1)
    return "fair" if len(search.get("candidates") or ()) > 3 and processes == 1 else "mixed"


def par_settings(search: Any) -> PARSettings:
    """The settings of PAR's search in ``search`` (a :class:`parnas.config.SearchConfig`): its strategy's, which
    must be PAR's (ConfigError for a search config of another strategy)."""
    settings = search.settings
    if not isinstance(settings, PARSettings):
        raise ConfigError(f"PAR's Gumbel-DARTS search runs with its own settings; search.strategy={search.strategy} "
                          "is another strategy (parnas search runs each with its own code)")
    return settings


def resolved_par(search: Any) -> PARSettings:
    """The PAR settings of ``search``, ``forward: auto`` made concrete for one process (:meth:`PARSettings.resolved`);
    a search in several processes is handed its settings resolved already (fair runs in one)."""
    return par_settings(search).resolved(processes=1)


def check_par_search(cfg: Any, resume: bool) -> None:
    """The strategy registry's check for PAR's search (a :class:`parnas.config.Config`): what its supernet
    cannot run, refused in one line before anything is read, by the search and by its ``--dry-run`` alike."""
    par = par_settings(cfg.search)  # a config of another strategy: parnas search runs that one's own code
    _require(not cfg.model.reversible, "model.reversible runs a fixed model's blocks in pairs, a search's supernet "
             "runs each block alone: leave model.reversible=false for search and set it for retrain")
    if cfg.train.compile != "none":  # one static step: every candidate mixed, or the fair sub-steps stacked
        forward = par.resolved(cfg.train.devices * cfg.train.num_nodes).forward
        _require(forward != "sampled", f"train.compile={cfg.train.compile} compiles one static step, and a sampled "
                 "supernet runs other candidates from step to step: set search."
                 f"{cfg.search.strategy}.forward to fair or mixed to compile the supernet, or leave train.compile=none")
        syncing = kinds.syncing(cfg.search.candidates)
        _require(cfg.train.compile != "reduce-overhead" or not syncing, "train.compile=reduce-overhead replays the "
                 f"supernet's step as CUDA graphs, and {', '.join(syncing)} blocks read values back to the host in "
                 "their forward, which a graph cannot hold: use train.compile=default (or none) for these candidates")
    _require(cfg.train.accumulate == 1, "search does not support train.accumulate > 1 (one-shot search optimises "
             "manually)")
