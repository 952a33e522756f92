"""parnas's built-in search strategies: its own Gumbel-DARTS, and NNI 3.0's strategies run on the PAR space.

The registry (:mod:`parnas.strategy_registry`) sits below this package and names none of it: it finds
:data:`STRATEGIES` through an entry point of parnas's own distribution (group ``parnas.builtin``), as it finds a
plugin's. Every strategy's code is reached from here by a plain import, eager for what imports no torch (checks,
settings), inside a function for what does (each ``run``), so the layers hold and a config is checked before torch
loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from parnas.strategies.nni_specs import NNI_STRATEGIES, check_nni_strategy
from parnas.strategies.par_settings import PARSettings, check_par_search
from parnas.strategy_registry import MULTI_TRIAL, NNI, ONE_SHOT, PAR_GUMBEL_DARTS, SearchStrategy

if TYPE_CHECKING:
    from parnas.config import Config


# Each run imports its code (torch, Lightning, NNI) when it runs: a config is checked before any of it loads.
def run_par_search(cfg: Config, *, resume: bool = False) -> dict[str, Any]:
    from parnas.strategies.search import run_search

    return run_search(cfg, resume=resume)


def par_supernet(*args: Any, **kwargs: Any) -> Any:
    """PAR's Gumbel-DARTS strategy object (:class:`parnas.strategies.gumbel_darts.PARGumbelDARTS`), the
    supernet ``run_par_search`` trains."""
    from parnas.strategies.gumbel_darts import PARGumbelDARTS

    return PARGumbelDARTS(*args, **kwargs)


def run_nni_one_shot(cfg: Config, *, resume: bool = False) -> dict[str, Any]:
    from parnas.strategies.nni_strategies import run_nni_search

    return run_nni_search(cfg, resume=resume)


def run_nni_multi_trial(cfg: Config, *, resume: bool = False) -> dict[str, Any]:
    from parnas.strategies.multi_trial import run_multi_trial

    return run_multi_trial(cfg, resume=resume)


PAR = SearchStrategy(PAR_GUMBEL_DARTS, ONE_SHOT, run_par_search, check=check_par_search, settings=PARSettings,
                     supernet=par_supernet,
                     what="Gumbel-softmax DARTS with tau annealed every step, a latency penalty or budget, the final "
                          "pick, exact resume", source="Mandava et al. 2020 (PAR); parnas's own")
_NNI_RUN = {ONE_SHOT: run_nni_one_shot, MULTI_TRIAL: run_nni_multi_trial}
STRATEGIES = (PAR, *(SearchStrategy(s.name, s.family, _NNI_RUN[s.family], check=check_nni_strategy,
                                    what=s.what, source=NNI) for s in NNI_STRATEGIES))
