"""The shapes ``benchmarks/gpu_step.py`` times a training step at, the matrix-product FLOPs of that step per
trained token, and GPUs' dense peaks: what its MFU is made of (``gpu_step.py --help`` prints this too).

FLOPs (MFU = FLOPs per trained token x tokens/s / the GPU's dense peak). Matrix products only, a
multiply-add = 2 FLOPs, training = forward + backward; a product whose operands both need gradients costs
3x its forward (6 x multiply-adds). Per trained token, with D = d_model, F = d_ff, L = seg_len,
M = mem_len, K = M + L keys, B = batch, n_A attention and n_D dense blocks:

    attention block    6 D^2 (1 + 3K/L)    out on the L new positions; q, k, v in one product on all K (the
                                           memory is projected again every step, its queries made and dropped)
                    +  4 D^2 K / (B L)     W_r on the K distances, once per segment for the whole batch; the
                                           sinusoid table needs no gradient, so forward + weight gradient
                    +  6 D (3K + 1)        content scores q.k (K keys), position scores (q+v).r (K+1 columns:
                                           the rel-shift's zero column) and weights.v, all of L x K computed
    dense block       12 D F
    output            6 D V                full softmax; adaptive: 6 [D (c_1 + n) + sum_i p_i (D d_i + d_i s_i)]
                                           with n tail clusters, cluster i of s_i ids and projection
                                           d_i = floor(D / div^i), taken by the fraction p_i of targets in it

    FLOPs/token = n_A x attention + n_D x dense + output

(Dai et al.'s 6 x parameters + 12 n_layers (L+M) D undercounts this model by the memory's k, v projections
and the position scores.) The supernet runs attention and dense in every block (identity costs nothing):
n_A = n_D = n_blocks. Embedding lookups, norms, softmaxes, dropout and the optimiser are not counted.
Peaks are dense (no sparsity) figures from NVIDIA's data sheets, for the arithmetic the precision uses:
bf16 tensor cores, TF32 tensor cores, or plain fp32 for ``32-true``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from parnas.config import Config, DataConfig, ModelConfig, TrainConfig

PRECISIONS = ("bf16-mixed", "32-true", "tf32")


@dataclass(frozen=True)
class Shape:
    """A benchmark shape: a Transformer-XL of ``n_layers`` layers (an attention and a dense block each)."""

    what: str
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    batch: int
    seg_len: int
    mem_len: int
    vocab: int
    cutoffs: tuple[int, ...]
    div_value: float = 1.0
    dropout: float = 0.1

    def config(self, precision: str = "bf16-mixed") -> Config:
        model = ModelConfig(n_blocks=2 * self.n_layers, d_model=self.d_model, n_heads=self.n_heads, d_ff=self.d_ff,
                            mem_len=self.mem_len, dropout=self.dropout, cutoffs=self.cutoffs,
                            div_value=self.div_value, tie_weights=False)
        data = DataConfig(vocab_size=self.vocab, batch_size=self.batch, eval_batch_size=self.batch,
                          seg_len=self.seg_len)
        train = TrainConfig(precision="32-true" if precision == "tf32" else precision, clip=0.25, lr=2.5e-4)
        model.check_vocab(self.vocab)
        return Config(model=model, data=data, train=train)


SHAPES: dict[str, Shape] = {
    "wt2-par": Shape("the wt2-par preset at its GPU length", 6, 128, 4, 512, 32, 128, 128, 12000, (250, 2500), 4.0),
    "wt103-base": Shape("Dai et al.'s WikiText-103 base", 16, 410, 10, 2100, 60, 150, 150, 267735,
                        (20000, 40000, 200000)),
    "nvidia-base": Shape("NVIDIA's Transformer-XL base (WikiText-103, one GPU's batch)", 16, 512, 8, 2048, 32, 192,
                         192, 267735, (20000, 40000, 200000)),
    "long": Shape("a long context, 32k vocabulary, full softmax", 16, 512, 8, 2048, 8, 512, 512, 32000, ()),
}

# Dense peak TFLOP/s (bf16, TF32, fp32), NVIDIA data sheets; the first name found in the device's name wins.
PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16-mixed": 756.5, "tf32": 378.0, "32-true": 51.2}),
    ("H100 NVL", {"bf16-mixed": 835.5, "tf32": 417.5, "32-true": 60.0}),
    ("GH200", {"bf16-mixed": 989.4, "tf32": 494.7, "32-true": 66.9}),
    ("H200", {"bf16-mixed": 989.4, "tf32": 494.7, "32-true": 66.9}),
    ("H100", {"bf16-mixed": 989.4, "tf32": 494.7, "32-true": 66.9}),  # SXM ("H100 80GB HBM3")
    ("A100", {"bf16-mixed": 312.0, "tf32": 156.0, "32-true": 19.5}),
    ("L40S", {"bf16-mixed": 362.1, "tf32": 183.0, "32-true": 91.6}),
    ("L4", {"bf16-mixed": 121.0, "tf32": 60.0, "32-true": 30.3}),
    ("A10", {"bf16-mixed": 125.0, "tf32": 62.5, "32-true": 31.2}),
    ("RTX 4090", {"bf16-mixed": 165.2, "tf32": 82.6, "32-true": 82.6}),
    ("RTX 3090", {"bf16-mixed": 71.0, "tf32": 35.6, "32-true": 35.6}),
)


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense peak of ``device_name`` for ``precision``'s arithmetic, None for a GPU not in the table."""
    for key, peaks in PEAKS:
        if key.lower() in device_name.lower():
            return peaks[precision]
    return None


def cluster_fractions(targets: Tensor, vocab: int, cutoffs: Sequence[int]) -> list[float]:
    """The fraction of ``targets`` in each tail cluster (ids in [c_i, c_i+1), the last up to ``vocab``)."""
    edges = [*cutoffs, vocab]
    return [((targets >= a) & (targets < b)).double().mean().item() for a, b in zip(edges, edges[1:])]


def train_flops_per_token(model: ModelConfig, kinds: Sequence[str], batch: int, seg_len: int, vocab: int,
                          fractions: Sequence[float] = ()) -> float:
    """Matrix-product FLOPs of one training step per token (module docstring); ``kinds``: the blocks
    (``choice`` for a supernet block, which runs attention and dense; ``sampled`` for one that runs one of
    attention, dense and identity at even odds, a third of each on average; ``fair`` for a block of a fair step,
    which runs each of the three once, in a step of three forwards that each compute the output layer);
    ``fractions``: targets per tail cluster."""
    D, F, L, K = model.d_model, model.d_ff, seg_len, model.mem_len + seg_len
    attention = 6 * D * D * (1 + 3 * K / L) + 4 * D * D * K / (batch * L) + 6 * D * (3 * K + 1)
    dense = 12 * D * F
    n_attention = sum(k in ("attention", "choice", "fair") for k in kinds) + sum(k == "sampled" for k in kinds) / 3
    n_dense = sum(k in ("dense", "choice", "fair") for k in kinds) + sum(k == "sampled" for k in kinds) / 3
    passes = 3 if "fair" in kinds else 1  # the output layer's forwards a step
    if not model.cutoffs:
        output = 6 * D * vocab
    else:
        sizes = [b - a for a, b in zip(model.cutoffs, [*model.cutoffs[1:], vocab])]
        tails = 0.0
        for i, (size, p) in enumerate(zip(sizes, fractions, strict=True), start=1):
            d_i = int(D // model.div_value ** i)  # as torch's AdaptiveLogSoftmaxWithLoss sizes it
            tails += p * (D * d_i + d_i * size)
        output = 6 * (D * (model.cutoffs[0] + len(sizes)) + tails)
    return n_attention * attention + n_dense * dense + passes * output
