"""PAR's Gumbel-DARTS's own settings, ``search.par-gumbel-darts.<setting>`` in a config (the search reads them as
``cfg.search.settings``). Every value is concrete as given: nothing here is resolved later or written back. Imports no
torch, so a config is checked without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from parnas import kinds
from parnas.errors import ConfigError
from parnas.pick_config import SelectConfig

# what a step runs in each block: every candidate weighted by a Gumbel-softmax sample (Gumbel-DARTS, the default),
# every candidate once on its own path (strict-fair, strategies.fair), or one sampled candidate (strategies.sampled)
SEARCH_FORWARDS = ("gumbel", "fair", "sampled")
GUMBEL = "gumbel"
SAMPLE_SETTINGS = ("tau_start", "tau_end")  # what shapes the Gumbel sample
ONE_PROCESS = ("fair", "sampled")  # forwards whose steps run a subset of candidates: DDP would wait on the rest
BUDGET = "search.par-gumbel-darts.latency_budget"  # the budget's key, as --set, --budgets and NNI draw it
PIPELINE = ("latency_budget", "penalty_weight", "select")  # the pipeline's settings, recorded apart from the forward's


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class PARSettings:
    """The settings docs/reference.md's table of ``search.par-gumbel-darts`` describes. ``forward``: what a training
    step runs in each block, ``gumbel`` (Gumbel-DARTS: every candidate, weighted by a Gumbel-softmax sample at tau,
    falling from ``tau_start`` to ``tau_end``), ``fair`` (:mod:`parnas.strategies.fair`) or ``sampled``
    (:mod:`parnas.strategies.sampled`), the last two drawing no sample, reading no tau, in one process. The pipeline's
    own, read by no other strategy: ``latency_budget`` (a fraction of Transformer-XL's cost that the exported
    architecture must meet, with a multiplier the search finds or ``penalty_weight`` fixes; without a budget
    ``penalty_weight`` weighs the expected cost itself) and ``select``, the final pick after the supernet."""

    forward: str = GUMBEL
    tau_start: float = 1.0
    tau_end: float = 0.1
    arch_warmup_steps: int = 0
    latency_budget: float | None = None
    penalty_weight: float = 0.0
    select: SelectConfig = field(default_factory=SelectConfig)  # the final pick after the supernet

    def __post_init__(self) -> None:
        _require(self.forward in SEARCH_FORWARDS, f"forward must be one of {', '.join(SEARCH_FORWARDS)}, not "
                 f"{self.forward!r}" + (" (mixed is now called gumbel)" if self.forward == "mixed" else ""))
        _require(self.tau_end > 0, f"tau_end must be > 0, got {self.tau_end}")
        _require(self.tau_end <= self.tau_start,
                 f"tau_end ({self.tau_end}) must not exceed tau_start ({self.tau_start})")
        _require(self.arch_warmup_steps >= 0, f"arch_warmup_steps must be >= 0, got {self.arch_warmup_steps}")
        _require(self.penalty_weight >= 0, f"penalty_weight must be >= 0, got {self.penalty_weight}")
        _require(self.latency_budget is None or 0.0 < self.latency_budget <= 1.0, "latency_budget must be in (0, 1] "
                 f"(a fraction of Transformer-XL's step time), got {self.latency_budget}")
        unread = [key for key in SAMPLE_SETTINGS if getattr(self, key) != getattr(PARSettings, key)]
        _require(self.samples or not unread, f"{', '.join(unread)} set, but forward={self.forward} draws no Gumbel "
                 "sample and reads no tau: drop them, or use forward=gumbel")

    @property
    def samples(self) -> bool:
        """Whether a step draws a Gumbel-softmax sample (and so reads tau)."""
        return self.forward == GUMBEL

    def read(self) -> dict[str, Any]:
        """The supernet's training settings, by name, as a record and the pictures show them: no tau where the
        forward draws no sample, and none of the pipeline's (the record gives the budget and the pick apart)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in PIPELINE and (self.samples or f.name not in SAMPLE_SETTINGS)}

    def check(self, cfg: Any) -> None:
        """What the settings need of the rest of the config ``cfg`` (a :class:`parnas.config.Config` whose
        ``search.strategy`` they belong to)."""
        processes = cfg.train.devices * cfg.train.num_nodes
        _require(self.forward not in ONE_PROCESS or processes == 1,
                 f"search.{cfg.search.strategy}.forward={self.forward} runs in one process, not {processes} "
                 "(train.devices x train.num_nodes): DDP would wait for the gradients of candidates a rank did not "
                 "run; use forward=gumbel")
        _require(self.latency_budget is None or cfg.search.penalty_cost == "latency",
                 f"search.{cfg.search.strategy}.latency_budget is a fraction of measured latency: set "
                 "search.penalty_cost=latency")


def par_settings(search: Any) -> PARSettings:
    """The settings of PAR's search in ``search`` (a :class:`parnas.config.SearchConfig`): its strategy's, which
    must be PAR's (ConfigError for a search config of another strategy)."""
    settings = search.settings
    if not isinstance(settings, PARSettings):
        raise ConfigError(f"PAR's Gumbel-DARTS search runs with its own settings; search.strategy={search.strategy} "
                          "is another strategy (parnas search runs each with its own code)")
    return settings


def latency_budget(search: Any) -> float | None:
    """The latency budget a search of ``search`` (a :class:`parnas.config.SearchConfig`) runs under: PAR's
    pipeline's setting, None for a strategy that has none."""
    settings = search.settings
    return settings.latency_budget if isinstance(settings, PARSettings) else None


def check_par_search(cfg: Any, resume: bool) -> None:
    """The strategy registry's check for PAR's search (a :class:`parnas.config.Config`): what its supernet
    cannot run, refused in one line before anything is read, by the search and by its ``--dry-run`` alike."""
    par = par_settings(cfg.search)  # a config of another strategy: parnas search runs that one's own code
    _require(not cfg.model.reversible, "model.reversible runs a fixed model's blocks in pairs, a search's supernet "
             "runs each block alone: leave model.reversible=false for search and set it for retrain")
    if cfg.train.compile != "none":  # one static step: every candidate mixed, or the fair sub-steps stacked
        _require(par.forward != "sampled", f"train.compile={cfg.train.compile} compiles one static step, and a "
                 f"sampled supernet runs other candidates from step to step: set search.{cfg.search.strategy}.forward"
                 " to gumbel or fair to compile the supernet, or leave train.compile=none")
        syncing = kinds.syncing(cfg.search.candidates)
        _require(cfg.train.compile != "reduce-overhead" or not syncing, "train.compile=reduce-overhead replays the "
                 f"supernet's step as CUDA graphs, and {', '.join(syncing)} blocks read values back to the host in "
                 "their forward, which a graph cannot hold: use train.compile=default (or none) for these candidates")
