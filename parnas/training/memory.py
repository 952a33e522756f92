"""How much memory a training run needs, from its config alone, and whether this machine has it.

:func:`estimate_memory` is a lower bound: parameters counted exactly on the ``meta`` device, with gradients and
Adam's moments, and only the activations the built-in blocks surely keep. :func:`check_memory` refuses a run
whose estimate exceeds what this machine offers (RAM, each GPU's free memory, a container's or ``ulimit``'s
limit) before anything is allocated, naming the settings to lower; :func:`out_of_memory` words a later failure
to allocate in one line too.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from parnas import kinds
from parnas.config import Config
from parnas.errors import ConfigError


@dataclass(frozen=True)
class Term:
    """One part of the estimate: its bytes and the settings it grows with."""

    what: str
    bytes: float  # inf: a tensor too large for torch to describe
    settings: tuple[str, ...]


@dataclass(frozen=True)
class MemoryEstimate:
    """At least this much memory per training process (see the module docstring)."""

    parameters: float  # count (inf: too many to count)
    terms: tuple[Term, ...]

    @property
    def parameter_bytes(self) -> float:
        return sum(t.bytes for t in self.terms if t.what in PARAMETER_TERMS)

    @property
    def activation_bytes(self) -> float:
        return sum(t.bytes for t in self.terms if t.what not in PARAMETER_TERMS)

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.terms)


PARAMETER_TERMS = ("embedding and output head", "blocks' weights")


def _numel(build: object) -> float:
    """Parameters of the module ``build()`` makes on the meta device; inf when a shape overflows."""
    import torch

    try:
        with torch.device("meta"):
            module = build()  # type: ignore[operator]
    except RuntimeError as e:
        if "overflow" in str(e):  # "Storage size calculation overflowed": over 2**63 bytes
            return math.inf
        raise
    return float(sum(p.numel() for p in module.parameters()))


def _width(precision: str) -> tuple[int, int]:
    """Bytes per parameter element and per activation element under ``train.precision``."""
    if precision.startswith("64"):
        return 8, 8
    if precision.startswith(("16", "bf16")):
        return (2, 2) if precision.endswith("true") else (4, 2)  # mixed keeps fp32 weights
    return 4, 4


def estimate_memory(cfg: Config, vocab_size: int, blocks: Sequence[Sequence[str]]) -> MemoryEstimate:
    """A lower bound of one training process's memory; ``blocks[i]`` lists the kinds at depth i (one for a
    fixed model, the candidates for a supernet, which runs them all)."""
    from parnas.kinds import make_block
    from parnas.nn.model import build_fixed_model

    m, d = cfg.model, cfg.data
    body_cfg = replace(m, blocks=(), reversible=False)  # one block: no pairs to make
    body = _numel(lambda: build_fixed_model(body_cfg, vocab_size, ["identity"]))
    per_kind = {kind: _numel(lambda kind=kind: make_block(kind, m)) for kind in {k for b in blocks for k in b}}
    seen: set[str] = set()
    weights = 0.0
    for kind in (k for b in blocks for k in b):
        if not (m.shares_weights(kind) and kind in seen):  # a shared module is stored once
            weights += per_kind[kind]
        seen.add(kind)
    processes = cfg.train.devices * cfg.train.num_nodes
    b, L, M, D, F, H = d.batch_size // processes, d.seg_len, m.mem_len, m.d_model, m.d_ff, m.n_heads
    hidden = scores = memory = 0.0
    for kind in (k for blk in blocks for k in blk):
        if kind == "identity":
            continue
        hidden += b * L * (2 * D + (0 if kinds.get(kind).uses_memory else F))
        memory += b * M * D if kinds.get(kind).uses_memory else 0
        scores += b * H * L * (L + M) if kind == "attention" else 0
    head = b * L * (D + (m.cutoffs[0] + len(m.cutoffs) if m.cutoffs else vocab_size))
    # validation keeps no activations for a backward pass, but its memories (model.eval_mem_len of them) and
    # one attention block's scores at that length; counted where they exceed the training step's activations
    be, Me = d.eval_batch_size // processes, m.evaluation_memory
    attending = [kind for blk in blocks for kind in blk if kind != "identity" and kinds.get(kind).uses_memory]
    evaluation = len(attending) * be * Me * D + (be * H * L * (L + Me) if attending else 0) + be * L * D
    weight_bytes, act_bytes = _width(cfg.train.precision)
    per_param = 4 * weight_bytes  # weights, gradients, Adam's two moments
    vocab = "data.vocab_size" if d.tokenizer == "sentencepiece" else "the vocabulary"
    return MemoryEstimate(body + weights, (
        Term("embedding and output head", body * per_param, (vocab, "model.d_model")),
        Term("blocks' weights", weights * per_param, ("model.n_blocks", "model.d_model", "model.d_ff")),
        Term("activations", (hidden + memory + head) * act_bytes,
             ("data.batch_size", "data.seg_len", "model.d_model", "model.d_ff", "model.mem_len")),
        Term("attention scores", scores * act_bytes, ("data.batch_size", "model.n_heads", "data.seg_len",
                                                      "model.mem_len")),
        Term("evaluation memories", max(0.0, evaluation - (hidden + memory + head + scores)) * act_bytes,
             ("model.eval_mem_len", "data.eval_batch_size", "model.n_heads", "model.d_model")),
    ))


def machine_memory(cfg: Config) -> tuple[float, str, int] | None:
    """(bytes one training process may use, what they are, processes sharing them), or None when unknown: the
    free memory of this process's own GPU (its local rank's), or the RAM shared by this machine's processes."""
    import torch

    if cfg.train.accelerator in ("gpu", "cuda") or (cfg.train.accelerator == "auto" and torch.cuda.is_available()):
        index = int(os.environ.get("LOCAL_RANK", 0))
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            return None  # Lightning says what is missing
        return float(torch.cuda.mem_get_info(index)[0]), "free on the GPU", 1
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX
        return None
    what = "of RAM"
    try:
        container = Path("/sys/fs/cgroup/memory.max").read_text().strip()  # cgroup v2; "max": no limit
        if container != "max" and int(container) < ram:
            ram, what = int(container), "under this container's memory limit"
    except (OSError, ValueError):
        pass
    limited = process_limit()
    if limited is not None and limited[0] < ram / cfg.train.devices:
        return limited[0], limited[1], 1
    return float(ram), what, cfg.train.devices


def process_limit() -> tuple[float, str] | None:
    """(bytes this process may still allocate, which limit) under ``ulimit -v`` or ``ulimit -d``, less what it
    maps already (torch alone maps hundreds of MB), or None when neither is set."""
    import resource

    found = []
    for which, name, field in ((resource.RLIMIT_AS, "ulimit -v", "VmSize"), (resource.RLIMIT_DATA, "ulimit -d",
                                                                               "VmData")):
        soft = resource.getrlimit(which)[0]
        if soft != resource.RLIM_INFINITY:
            found.append((max(0.0, soft - _status_bytes(field)), f"left under this process's {name}"))
    return min(found) if found else None


def _status_bytes(field: str) -> float:
    """A ``/proc/self/status`` size (``VmSize``: the address space mapped now), 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith(f"{field}:"))
        return float(line.split()[1]) * 1024  # kB
    except (OSError, StopIteration, ValueError, IndexError):
        return 0.0


# Address space a training process maps beyond what it had when checked, over the estimate: allocator arenas,
# optimiser temporaries, thread stacks, which map about as much again as the estimate by the second step. Only a
# limit on the process's own address space (ulimit -v, -d) is held to it; RAM is touched, not mapped.
MAPPED = 2
_checked: tuple[MemoryEstimate, str, int] | None = None  # the last check's estimate, advice and processes


def check_memory(cfg: Config, vocab_size: int, blocks: Sequence[Sequence[str]]) -> MemoryEstimate:
    """Raise ConfigError (one line, naming the settings) when training cannot fit this machine's memory.
    The estimate is kept for :func:`out_of_memory`, should an allocation fail later all the same."""
    global _checked
    estimate = estimate_memory(cfg, vocab_size, blocks)
    available = machine_memory(cfg)
    advice = _advice(cfg, vocab_size, estimate)
    _checked = estimate, advice, available[2] if available else 1
    if available is None:
        return estimate
    free, what, processes = available
    mapped = MAPPED if what.startswith("left under") else 1  # a process limit counts address space
    if estimate.total * processes * mapped <= free:
        return estimate
    maps = f", and a run maps about {mapped}x what it keeps" if mapped > 1 else ""
    raise ConfigError(f"training needs {_needs(estimate, processes)} but this machine has {size(free)} {what}{maps}; "
                      f"{advice}")


def out_of_memory(e: BaseException) -> ConfigError | None:
    """One line for an allocation that failed although :func:`check_memory` passed (its estimate is a lower bound),
    else None: the allocator's words, the estimate and the settings to lower. A library the loader could not map
    counts too: under ``ulimit -v`` a command imports some libraries only when it needs them."""
    text = str(e)
    unmapped = isinstance(e, (ImportError, OSError)) and any(
        words in text.lower() for words in ("failed to map segment", "cannot allocate memory"))
    if not (isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or unmapped
            or isinstance(e, RuntimeError) and ("can't allocate memory" in text or "not enough memory" in text)):
        return None
    asked = re.search(r"[Tt]ried to allocate (\d+) bytes|[Tt]ried to allocate ([\d.]+ \w+)", text)
    said = (f"an allocation of {size(float(asked[1])) if asked[1] else asked[2]} failed" if asked else
            " ".join(text.split())[:120] or type(e).__name__)
    if _checked is None:  # before the run was estimated: loading the libraries, reading the data
        limited = process_limit()
        fix = (f"this process has {size(limited[0])} {limited[1]}: raise it (torch and Lightning alone map about "
               "1 GiB)" if limited else "free some memory, or make the model or its batches smaller")
        return ConfigError(f"could not allocate memory before training began ({said}); {fix}")
    estimate, advice, processes = _checked
    return ConfigError(f"could not allocate memory while training ({said}); parnas estimated it needs "
                       f"{_needs(estimate, processes)}, a lower bound; {advice}")


def _needs(estimate: MemoryEstimate, processes: int) -> str:
    share = f" in each of {processes} processes" if processes > 1 else ""
    if not math.isfinite(estimate.total):
        return "more than 8 EiB of memory (more parameters than torch can count)"
    return (f"at least {size(estimate.total)} of memory{share} ({estimate.parameters:.3g} parameters: "
            f"{size(estimate.parameter_bytes)} with their gradients and Adam moments; activations: "
            f"{size(estimate.activation_bytes)})")


def _advice(cfg: Config, vocab_size: int, estimate: MemoryEstimate) -> str:
    """The largest part of the estimate and the settings it grows with, those raised above their defaults
    first: what to make smaller."""
    worst = max(estimate.terms, key=lambda t: t.bytes)
    memory = {"model.eval_mem_len": cfg.model.evaluation_memory}  # unset, it is the training memory
    defaults = _flat(Config()) | {"model.eval_mem_len": cfg.model.mem_len}
    values = _flat(cfg) | memory | {"the vocabulary": vocab_size, "data.vocab_size": vocab_size}
    grown = sorted((s for s in worst.settings if values[s] > defaults.get(s, values[s])),
                   key=lambda s: values[s] / (defaults[s] or 1), reverse=True)
    named = ", ".join(f"{s}={values[s]}" for s in (grown or worst.settings))
    return f"the {worst.what} grow with {named}: make {'it' if len(grown) == 1 else 'them'} smaller"


def _flat(cfg: Config) -> dict[str, float]:
    return {f"{section}.{key}": value for section, values in cfg.to_dict().items()
            for key, value in values.items() if isinstance(value, (int, float)) and not isinstance(value, bool)}


def size(n: float) -> str:
    """Bytes in binary units, e.g. ``15.6 GiB``; beyond what torch can describe, ``more than 8 EiB``."""
    if not math.isfinite(n):
        return "more than 8 EiB"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} EiB"
