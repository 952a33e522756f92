"""A fixed model builds exactly its chosen blocks: its initial weights depend on the network and the seed, never
on the candidates a search offered or on where its identity blocks stand."""

from dataclasses import replace

import pytest
import torch
from nni.nas.nn.pytorch import LayerChoice
from nni.nas.space import model_context

from parnas import kinds
from parnas.config import ModelConfig
from parnas.search_spaces import PARTransformerXLSpace, fixed_model

VOCAB = 500
KINDS = {k.letter: k.name for k in map(kinds.get, ("attention", "dense", "identity", "conv", "glu"))}


def arch(layout: str) -> dict[str, str]:
    return {f"block_{i}": KINDS[letter] for i, letter in enumerate(layout)}


def build(layout: str, seed: int = 0, candidates=None) -> PARTransformerXLSpace:
    torch.manual_seed(seed)
    cfg = replace(ModelConfig(d_model=32, n_heads=2, d_ff=64, mem_len=8, cutoffs=(100,)), n_blocks=len(layout))
    return fixed_model(cfg, VOCAB, arch(layout), candidates)


def weights_of_blocks_run(model: PARTransformerXLSpace) -> list[torch.Tensor]:
    """Every tensor of the model in order, the skipped (identity) blocks left out."""
    skipped = {f"blocks.{i}." for i, kind in enumerate(model.block_kinds) if kind == "identity"}
    return [t for name, t in model.state_dict().items() if not any(name.startswith(s) for s in skipped)]


@pytest.mark.parametrize("twin", ["IIAAID", "AIADII", "IAIAID"])
def test_one_network_with_identity_blocks_anywhere_starts_from_the_same_weights(twin):
    same, other = weights_of_blocks_run(build("AAD")), weights_of_blocks_run(build(twin))
    assert len(same) == len(other) and all(torch.equal(a, b) for a, b in zip(same, other))
    x = torch.randint(VOCAB, (2, 5))
    assert torch.equal(build("AAD").eval()(x)[0], build(twin).eval()(x)[0])


def test_the_candidates_offered_change_no_weight_and_the_seed_does():
    par = weights_of_blocks_run(build("ADAD"))
    wider = weights_of_blocks_run(build("ADAD", candidates=("attention", "dense", "identity", "conv", "glu")))
    assert all(torch.equal(a, b) for a, b in zip(par, wider))
    assert not all(torch.equal(a, b) for a, b in zip(par, weights_of_blocks_run(build("ADAD", seed=1))))


def test_only_the_chosen_blocks_are_built(monkeypatch):
    built = []
    real = kinds.BlockKind.build
    monkeypatch.setattr(kinds.BlockKind, "build", lambda self, cfg: built.append(self.name) or real(self, cfg))
    model = build("ADIG", candidates=("attention", "dense", "identity", "glu", "conv"))
    assert built == ["attention", "dense", "identity", "glu"] == model.block_kinds


def test_a_choice_outside_the_candidates_is_refused_as_nni_refuses_it():
    with pytest.raises(Exception, match="conv"):
        build("AC", candidates=("attention", "dense", "identity"))


class _EveryCandidateBuilt(PARTransformerXLSpace):
    """The fixed model as it was first built: every candidate made, the chosen one kept by LayerChoice."""

    def build_block(self, index):
        return LayerChoice({kind: self.block_for(kind, index) for kind in self.candidates}, label=f"block_{index}")


def test_checkpoints_of_models_built_with_every_candidate_still_load():
    cfg = replace(ModelConfig(d_model=32, n_heads=2, d_ff=64, mem_len=8, cutoffs=(100,)), n_blocks=4)
    with model_context(arch("AIDA")):
        old = _EveryCandidateBuilt(cfg, VOCAB, ("attention", "dense", "identity"))
    new = build("AIDA", seed=1)
    new.load_state_dict(old.state_dict())  # strict: the same names and shapes
    assert all(torch.equal(a, b) for a, b in zip(new.state_dict().values(), old.state_dict().values()))
