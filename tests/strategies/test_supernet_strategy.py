"""A one-shot strategy that declares a supernet in its registry record (``supernet=``) is trained by parnas's
pipeline and gets the final pick and the export, as PAR's own does: nothing else is written for it."""

import json

import pytest

from parnas import strategy_registry
from parnas.cli import main
from parnas.strategies.builtin import run_par_search
from parnas.strategies.gumbel_darts import PARGumbelDARTS
from parnas.strategies.par_settings import PARSettings, check_par_search
from parnas.strategy_registry import ONE_SHOT, SearchStrategy

BUILT: list[str] = []


class ToySupernet(PARGumbelDARTS):
    """PAR's supernet, noting that it was the one built."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        BUILT.append(type(self).__name__)


@pytest.fixture
def toy():
    strategy = SearchStrategy("toy-supernet", ONE_SHOT, run_par_search, check=check_par_search,
                              settings=PARSettings, supernet=ToySupernet, what="a toy supernet")
    strategy_registry.register(strategy)
    yield strategy
    strategy_registry.unregister("toy-supernet")


@pytest.mark.slow  # a search and its final pick
def test_a_strategy_declaring_a_supernet_gets_the_final_pick_and_the_export(toy, micro, tmp_path):
    sets = [f"data.path={micro}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "train.max_steps=3",
            "search.penalty_cost=flops", "search.toy-supernet.select.k=1", "search.toy-supernet.select.steps=[2]",
            "search.toy-supernet.select.budget=0.8",
            "search.toy-supernet.select.confirm_seeds=0", f"search.out_dir={tmp_path}"]
    assert main(["search", "--config", "tiny", "--strategy", "toy-supernet",
                 *[a for s in sets for a in ("--set", s)]]) == 0
    assert BUILT == ["ToySupernet"]
    record = json.loads((tmp_path / "architecture.json").read_text())
    assert record["search"]["strategy"] == "toy-supernet"
    selection = record["search"]["selection"]  # the final pick ran: the guard among its entrants
    assert selection and selection["winner"] and any("guard" in e["role"] for e in selection["entrants"])
    assert (tmp_path / "history.jsonl").is_file()


def test_a_strategy_without_a_supernet_is_refused_by_the_supernet_pipeline():
    from parnas.config import load_config
    from parnas.errors import ParnasError
    from parnas.strategies.search import build_search

    with pytest.raises(ParnasError, match="search.strategy=darts has no supernet for parnas's one-shot search"):
        build_search(load_config("tiny", ["search.strategy=darts"]), {}, 32, None)
