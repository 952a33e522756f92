"""Cost of a search step against a step of the fixed standard Transformer-XL it prices layouts against.

The supernet's step is the search's, joint mode: every block (attention, dense, identity by default) mixes its
candidates by Gumbel-softmax weights (``search.par-gumbel-darts.forward: mixed``), or runs only a candidate drawn from
softmax(alpha) (``sampled``; its REINFORCE term, a few scalar products, is left out), and both the weights and
the logits step. The baseline is the standard
Transformer-XL at the same ``n_blocks`` (attention, dense, ...: what the search's cost ratios divide by). All
carry their memory, on Zipf token ids; the logits stay as initialised (uniform), so a sampled step costs the
mean of the candidates, as at the start of a search (it moves towards the found layout's cost as the logits do).
The three take ``--steps`` steps each per round, in rotating order, over ``--rounds`` rounds after a warm-up;
figures are medians over rounds, and ratios medians of same-round ratios.

    python benchmarks/search_step.py                        # the wt2-seed configuration
    python benchmarks/search_step.py --config wt2-cpu --rounds 7
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from model_args import model_parser
from torch import Tensor
from train_step import alternating_rounds, ratio_line, segment_runner, training_step, zipf_ids

from parnas.config import load_config, transformer_xl_layout
from parnas.nn.model import build_fixed_model
from parnas.search_spaces import PARTransformerXLSpace
from parnas.strategies.gumbel_darts import PARGumbelDARTS
from parnas.strategies.sampled import SampledMixedLayer, draw_picks
from parnas.training.latency import full_memory_steps
from parnas.training.task import adam


class Sampling(torch.nn.Module):
    """The supernet with a fresh pick in every block before each forward (a sampled step)."""

    def __init__(self, supernet: torch.nn.Module) -> None:
        super().__init__()
        self.supernet, self.draws = supernet, 0
        self.layers = [m for m in supernet.modules() if isinstance(m, SampledMixedLayer)]

    def forward(self, x: Tensor, mems: Any = None) -> Any:
        draw_picks(self.layers, seed=self.draws)
        self.draws += 1
        return self.supernet(x, mems)

    def nll(self, *args: Any) -> Tensor:
        return self.supernet.nll(*args)


def main() -> None:
    parser = model_parser(__doc__, "wt2-seed")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model per round (default 5)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    cfg = load_config(args.config, args.set)
    torch.manual_seed(0)

    def supernet() -> torch.nn.Module:
        space = PARTransformerXLSpace(cfg.model, args.vocab_size, cfg.search.candidates)
        return PARGumbelDARTS(cfg.search, max_steps=1).mutate_model(space).train()

    fixed = build_fixed_model(cfg.model, args.vocab_size, transformer_xl_layout(cfg.model.n_blocks)).train()
    models = {"transformer-xl": fixed, "supernet, mixed": supernet(),
              "supernet, sampled": Sampling(supernet())}
    steps = {}
    for name, model in models.items():
        groups = [[p for n, p in model.named_parameters() if not n.endswith("_arch_alpha")],
                  [p for n, p in model.named_parameters() if n.endswith("_arch_alpha")]]
        optimizers = [adam(groups[0], lr=cfg.train.lr)] + ([torch.optim.Adam(groups[1], lr=cfg.search.arch_lr,
                                                                              betas=(0.5, 0.999))] if groups[1] else [])
        steps[name] = training_step(model, optimizers, groups[0], cfg.train.clip)
    B, L = cfg.data.batch_size, cfg.data.seg_len
    warmup = max(args.warmup, full_memory_steps(cfg))
    stream = zipf_ids(B * (L * (warmup + args.rounds * args.steps) + 1), args.vocab_size).view(B, -1)
    tps = alternating_rounds(segment_runner(steps, stream, L), list(models), args.rounds, args.steps, warmup)
    figures = {name: [1e3 * B * L / t for t in rounds] for name, rounds in tps.items()}  # ms/step
    n = cfg.model.n_blocks
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {B} x {L}, memory "
          f"{cfg.model.mem_len}, d_model {cfg.model.d_model}, vocab {args.vocab_size}, {n} blocks of "
          f"{list(cfg.search.candidates)}; median of {args.rounds} rounds of {args.steps} steps")
    for name, ms in figures.items():
        print(f"{name:20s} {statistics.median(ms):8.1f} ms/step")
    for name in ("supernet, mixed", "supernet, sampled"):
        print(ratio_line(name, "transformer-xl", figures, f"step {name} / transformer-xl"))
    print(ratio_line("supernet, sampled", "supernet, mixed", figures, "step sampled / mixed"))


if __name__ == "__main__":
    main()
