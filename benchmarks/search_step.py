"""Cost of a search step against a step of the fixed standard Transformer-XL it prices layouts against.

The supernet's step is the search's, joint mode: every block (attention, dense, identity by default) mixes its
candidates by Gumbel-softmax weights (``search.par-gumbel-darts.forward: gumbel``); or runs only a candidate drawn
from softmax(alpha) (``sampled``; its REINFORCE term, a few scalar products, is left out); or, as a one-process
search does by default (``fair``), runs every candidate of every block once on the same segment from the same
memory, in as many forwards as a block has candidates, with one backward. Both the weights and the logits step.
The baseline is the standard Transformer-XL at the same ``n_blocks`` (attention, dense, ...: what the search's
cost ratios divide by). All carry their memory, on Zipf token ids grouped on the host each step as the data
module groups a training batch; the logits stay as initialised (uniform), so a sampled step costs the mean of the
candidates, as at the start of a search (it moves towards the found layout's cost as the logits do). The four
take ``--steps`` steps each per round, in rotating order, over ``--rounds`` rounds after a warm-up; figures are
medians over rounds, and ratios medians of same-round ratios.

    python benchmarks/search_step.py                        # the wt2-seed configuration
    python benchmarks/search_step.py --config wt2-cpu --rounds 7
    python benchmarks/search_step.py --config wt2-cpu --compile default  # + the Transformer-XL and supernets compiled

``--compile MODE`` adds the Transformer-XL, the gumbel supernet and the fair one compiled as ``train.compile=MODE``
compiles them in a search (the fair step's sub-steps stacked into one forward: ``parnas.strategies.fair``; a
sampled step is not one static graph); their first steps, which compile, are among the warm-up's.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from model_args import model_parser
from step_profile import phase
from torch import Tensor
from train_step import (
    alternating_rounds,
    descend,
    fit_capacity,
    host_grouping,
    ratio_line,
    segment_runner,
    training_step,
    zipf_ids,
)

from parnas.config import COMPILE_MODES, load_config, transformer_xl_layout
from parnas.nn.model import build_fixed_model, full_memory_steps
from parnas.search_spaces import PARTransformerXLSpace
from parnas.strategies.fair import fair_loss
from parnas.strategies.gumbel_darts import PARGumbelDARTS
from parnas.strategies.sampled import RoutedMixedLayer, draw_picks
from parnas.training.compiling import compile_model
from parnas.training.task import adam, segment_nll


class Sampling(torch.nn.Module):
    """The supernet with a fresh pick in every block before each forward (a sampled step)."""

    def __init__(self, supernet: torch.nn.Module) -> None:
        super().__init__()
        self.supernet, self.draws = supernet, 0
        self.layers = [m for m in supernet.modules() if isinstance(m, RoutedMixedLayer)]

    def forward(self, x: Tensor, mems: Any = None) -> Any:
        draw_picks(self.layers, seed=self.draws)
        self.draws += 1
        return self.supernet(x, mems)

    def nll(self, *args: Any) -> Tensor:
        return self.supernet.nll(*args)


class FairTask:
    """The part of the training task that the search's fair step (:func:`fair_loss`) calls, around a bare supernet:
    the training stream's memory, its per-step seeds, and the side streams' forwards. So the benchmark times the
    search's own fair step without a Lightning trainer."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.mems, self.steps = model, None, 0

    def seed_for_step(self, offset: int = 0) -> int:
        return offset + self.steps

    def train_memory(self, x: Tensor) -> Any:
        return self.mems

    def side_stream_nll(self, batch: Any, memory: Any, seed_offset: int) -> tuple[Tensor, Any]:
        x, y, groups = batch
        torch.manual_seed(self.seed_for_step(seed_offset))
        return segment_nll(self.model, x, y, memory, groups)

    def train_nll(self, batch: Any, forward: Callable[..., Any] = segment_nll) -> Tensor:
        x, y, groups = batch
        torch.manual_seed(self.seed_for_step())
        nll, self.mems = forward(self.model, x, y, self.mems, groups)
        self.steps += 1
        return nll

    def aux_loss(self) -> Tensor | float:
        return getattr(self.model, "aux_loss", 0.0)


def fair_step(supernet: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer],
              clipped: list[torch.nn.Parameter], clip: float,
              context: Callable[[], Any] = contextlib.nullcontext, stacked: bool = False) -> Callable[..., None]:
    """``step(tokens, groups=None)``: one fair step of the search's joint mode on a (B, L+1) segment, as
    :func:`training_step` takes one of a model: the mean of the sub-steps' losses plus the logits' surrogate inside
    ``context()``, one backward, clipping of ``clipped``, every optimiser. ``stacked``: the sub-steps as one
    forward, as a compiled search runs them."""
    task = FairTask(supernet)
    layers = [m for m in supernet.modules() if isinstance(m, RoutedMixedLayer)]

    def step(tokens: Tensor, groups: Any = None) -> None:
        with context(), phase("forward and loss"):
            loss, surrogate = fair_loss(layers, task, (tokens[:, :-1], tokens[:, 1:], groups), True, stacked)
            loss = loss.float() + surrogate
        descend(loss, optimizers, clipped, clip)
    return step


def main() -> None:
    parser = model_parser(__doc__, "wt2-seed")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model per round (default 5)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", default="none", choices=COMPILE_MODES,
                        help="also time the Transformer-XL and the gumbel and fair supernets compiled in this mode")
    args = parser.parse_args()
    cfg = load_config(args.config, args.set)
    torch.manual_seed(0)

    def supernet() -> torch.nn.Module:
        space = PARTransformerXLSpace(cfg.model, args.vocab_size, cfg.search.candidates)
        return PARGumbelDARTS(cfg.search, cfg.search.settings, max_steps=1).mutate_model(space).train()

    def fixed() -> torch.nn.Module:
        return build_fixed_model(cfg.model, args.vocab_size, transformer_xl_layout(cfg.model.n_blocks)).train()

    models = {"transformer-xl": fixed(), "supernet, gumbel": supernet(),
              "supernet, sampled": Sampling(supernet()), "supernet, fair": supernet()}
    compiled = [f"{name}, {args.compile}" for name in ("transformer-xl", "supernet, gumbel", "supernet, fair")]
    if args.compile != "none":
        models |= dict(zip(compiled, (fixed(), supernet(), supernet())))
        for name in compiled:
            compile_model(models[name], args.compile)
    steps = {}
    for name, model in models.items():
        groups = [[p for n, p in model.named_parameters() if not n.endswith("_arch_alpha")],
                  [p for n, p in model.named_parameters() if n.endswith("_arch_alpha")]]
        optimizers = [adam(groups[0], lr=cfg.train.lr)] + ([torch.optim.Adam(groups[1], lr=cfg.search.arch_lr,
                                                                              betas=(0.5, 0.999))] if groups[1] else [])
        if name.startswith("supernet, fair"):  # compiled: its sub-steps stacked, as a compiled search runs them
            steps[name] = fair_step(model, optimizers, groups[0], cfg.train.clip, stacked=name != "supernet, fair")
        else:
            steps[name] = training_step(model, optimizers, groups[0], cfg.train.clip)
    B, L = cfg.data.batch_size, cfg.data.seg_len
    warmup = max(args.warmup, full_memory_steps(cfg.model, cfg.data.seg_len))
    stream = zipf_ids(B * (L * (warmup + args.rounds * args.steps) + 1), args.vocab_size).view(B, -1)
    grouping = {name: host_grouping(model) for name, model in models.items()}
    for model in models.values():
        fit_capacity(getattr(model, "supernet", model), stream, L)
    tps = alternating_rounds(segment_runner(steps, stream, L, grouping), list(models), args.rounds, args.steps,
                             warmup)
    figures = {name: [1e3 * B * L / t for t in rounds] for name, rounds in tps.items()}  # ms/step
    n = cfg.model.n_blocks
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {B} x {L}, memory "
          f"{cfg.model.mem_len}, d_model {cfg.model.d_model}, vocab {args.vocab_size}, {n} blocks of "
          f"{list(cfg.search.candidates)}; median of {args.rounds} rounds of {args.steps} steps")
    for name, ms in figures.items():
        print(f"{name:20s} {statistics.median(ms):8.1f} ms/step")
    for name in ("supernet, gumbel", "supernet, sampled", "supernet, fair"):
        print(ratio_line(name, "transformer-xl", figures, f"step {name} / transformer-xl"))
    print(ratio_line("supernet, sampled", "supernet, gumbel", figures, "step sampled / gumbel"))
    print(ratio_line("supernet, fair", "supernet, gumbel", figures, "step fair / gumbel"))
    if args.compile != "none":
        fixed_c, *supernets = compiled
        for name, eager in zip(supernets, ("supernet, gumbel", "supernet, fair")):
            print(ratio_line(name, "transformer-xl", figures, f"step {name} / transformer-xl"))
            print(ratio_line(name, fixed_c, figures, f"step {name} / {fixed_c}"))
            print(ratio_line(name, eager, figures, f"step {name} / {eager}"))
        print(ratio_line(fixed_c, "transformer-xl", figures, f"step {fixed_c} / transformer-xl"))


if __name__ == "__main__":
    main()
