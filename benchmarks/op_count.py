"""Non-view aten ops one training step dispatches: the fixed Transformer-XL, the supernet, Dai et al.'s model.

On a GPU a small model's step is bound by the host: each aten op is a dispatch and a kernel launch whatever its
size (docs/benchmarks.md). The count of ops per step is what the host pays
for, and it does not depend on the machine: it is counted here on the CPU with torch's dispatch mode, over one
forward, loss and backward (the optimiser, one fused call, apart), after warm-up steps fill the memory. View ops
(reshapes, transposes, slices) launch no kernel and are left out. The supernet is the search's (every candidate
mixed, ``search.par-gumbel-darts.forward: gumbel``). Dai et al.'s MemTransformerLM is imported from a local checkout
of the pytorch/ folder of github.com/kimiyoung/transformer-xl, at the same configuration (as ``train_step.py``).

    python benchmarks/op_count.py                                  # wt2-seed, 12 blocks: Dai et al.'s wt2 shape
    python benchmarks/op_count.py --peer-dir /tmp/txl-ref/pytorch  # + Dai et al.'s model
    python benchmarks/op_count.py --top 15                         # + the most frequent ops of each

``tests/test_op_count.py`` keeps the counts of a tiny fixed model and supernet under a recorded budget.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from model_args import model_parser
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from parnas.config import Config, load_config, transformer_xl_layout
from parnas.nn.model import build_fixed_model


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside it that is not a view, by name (``mm``, ``add_`` ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not func.is_view:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_ops(work: Callable[[], None]) -> Counter[str]:
    """The non-view aten ops ``work()`` dispatches, by name."""
    with OpCounter() as counter:
        work()
    return counter.counts


def forward_backward(model: torch.nn.Module, tokens: Tensor, warmup: int = 2) -> Callable[[], None]:
    """``step()``: forward, loss and backward of ``model`` on (B, L+1) ``tokens``, the memory carried, after
    ``warmup`` steps (the memory then full, as in training)."""
    mems = None
    x, y = tokens[:, :-1], tokens[:, 1:]
    groups = model.group_targets(y)

    def step() -> None:
        nonlocal mems
        h, mems = model(x, mems)
        loss = model.nll(h, y, groups).float().mean() + model.aux_loss
        loss.backward()

    for _ in range(warmup):
        step()
    return step


def fixed_model(cfg: Config, vocab_size: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_fixed_model(cfg.model, vocab_size, transformer_xl_layout(cfg.model.n_blocks)).train()


def supernet(cfg: Config, vocab_size: int) -> torch.nn.Module:
    """The search's supernet over ``search.candidates``, every candidate of each block mixed."""
    from parnas.search_spaces import PARTransformerXLSpace
    from parnas.strategies.gumbel_darts import PARGumbelDARTS

    torch.manual_seed(0)
    space = PARTransformerXLSpace(cfg.model, vocab_size, cfg.search.candidates)
    return PARGumbelDARTS(cfg.search, cfg.search.settings, max_steps=1).mutate_model(space).train()


def tokens(cfg: Config, vocab_size: int) -> Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(vocab_size, (cfg.data.batch_size, cfg.data.seg_len + 1), generator=generator)


def reference_forward_backward(peer_dir: Path, cfg: Config, vocab_size: int, warmup: int = 2) -> Callable[[], None]:
    """Dai et al.'s forward, loss and backward (its train.py's), time-major (L, B), at ``cfg``'s shape."""
    from train_step import reference_model

    model = reference_model(peer_dir, cfg, vocab_size, cfg.model.n_blocks // 2)
    batch = tokens(cfg, vocab_size)
    data, target = batch[:, :-1].t().contiguous(), batch[:, 1:].t().contiguous()
    mems: tuple = ()

    def step() -> None:
        nonlocal mems
        ret = model(data, target, *mems)
        mems = tuple(ret[1:])
        ret[0].float().mean().backward()

    for _ in range(warmup):
        step()
    return step


def counts(cfg: Config, vocab_size: int, peer_dir: Path | None = None) -> dict[str, Counter[str]]:
    """Each model's non-view ops in one training step's forward and backward."""
    batch = tokens(cfg, vocab_size)
    out = {"transformer-xl": count_ops(forward_backward(fixed_model(cfg, vocab_size), batch)),
           "supernet (mixed)": count_ops(forward_backward(supernet(cfg, vocab_size), batch))}
    if peer_dir is not None:
        out["Dai et al."] = count_ops(reference_forward_backward(peer_dir, cfg, vocab_size))
    return out


def main() -> None:
    parser = model_parser(__doc__, "wt2-seed")
    parser.add_argument("--n-blocks", type=int, default=12, help="blocks (default 12: Dai et al.'s 6 layers)")
    parser.add_argument("--peer-dir", type=Path, help="local checkout of transformer-xl's pytorch/ folder")
    parser.add_argument("--top", type=int, default=0, help="also list each model's N most frequent ops")
    args = parser.parse_args()
    cfg = load_config(args.config, [f"model.n_blocks={args.n_blocks}", *args.set])
    if args.peer_dir and cfg.model.n_blocks % 2:
        parser.error("--peer-dir compares the standard layout (attention, dense, ...): give an even model.n_blocks")
    torch.set_num_threads(1)  # the count does not depend on threads; fewer start faster
    m = cfg.model
    print(f"non-view aten ops in one training step's forward, loss and backward (CPU dispatch; the optimiser "
          f"apart): {m.n_blocks} blocks, d_model {m.d_model}, {m.n_heads} heads, d_ff {m.d_ff}, batch "
          f"{cfg.data.batch_size} x {cfg.data.seg_len}, memory {m.mem_len}, vocab {args.vocab_size}, cutoffs "
          f"{list(m.cutoffs)}; supernet of {list(cfg.search.candidates)}")
    found = counts(cfg, args.vocab_size, args.peer_dir)
    if args.peer_dir is None:
        print("(Dai et al.'s column: give --peer-dir, a checkout of kimiyoung/transformer-xl's pytorch/ folder)")
    print("| model | non-view aten ops |\n|---|---:|")
    for name, counted in found.items():
        print(f"| {name} | {sum(counted.values()):,} |")
    for name, counted in found.items() if args.top else ():
        print(f"{name}: " + ", ".join(f"{op} {n}" for op, n in counted.most_common(args.top)))


if __name__ == "__main__":
    main()
