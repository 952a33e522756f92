"""Latency measured on the device: what a block costs where the model will run.

PAR's premise is that attention is the slow block; FLOPs say otherwise at short
contexts (projections dominate), and neither counts softmax, masks, rel-shift or
the optimiser. So the cost the search pays is timed, at the run's shapes:

- a whole-model step of a model whose blocks are all ``identity`` gives the
  constant part (embedding, head, optimiser of those). A step is one of three
  *targets*: ``train`` (forward, backward, clipping, Adam on a batch of
  segments), ``inference`` (forward alone, in evaluation, on the same batch) and
  ``generate`` (batch 1, one token sampled from the whole vocabulary and fed back,
  as ``parnas generate`` decodes, with its memory: ``model.eval_mem_len`` states, by default
  ``mem_len + seg_len``); inference keeps the evaluation memory too (``model.eval_mem_len``, by default
  ``mem_len``);
- the same model with every block of kind k gives, minus the constant, k's cost
  per block. The prediction for a layout is ``constant + sum of its blocks' costs``.

Models are timed in interleaved rounds (every layout once per round, the order
rotating), after warm-up, with the memory carried as in training, and the median
round kept, so a shared or throttling machine biases no kind against another.
A table records how far its rounds spread, the load they competed with, and when
and where they were timed; :mod:`parnas.training.latency_cache` caches only the
steady ones. ``benchmarks/latency_model.py`` checks predictions against measured
whole-model steps of random layouts.
"""

from __future__ import annotations

import json
import math
import socket
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parnas import reading
from parnas.config import (
    LATENCY_TARGETS,
    Config,
    ModelConfig,
    generation_memory,
    transformer_xl_layout,
    upgrade_flat_settings,
)
from parnas.errors import ConfigError
from parnas.nn.model import build_fixed_model
from parnas.threads import machine_load, runnable_elsewhere, usable_cores
from parnas.training.task import adam

MODES = LATENCY_TARGETS  # the latency targets a table prices
FORMAT, VERSION = "parnas.latency", 2
MIN_BLOCK_MS = 1e-3  # what a kind costs that timed no slower than identity (identity alone costs 0)
VERSION_MODES = {1: ("train", "inference"), 2: MODES}  # what each format version holds (version 1 stays readable)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu:{platform.processor() or platform.machine()}"


def zipf_ids(n: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Token ids with a Zipf (1/rank) law: how often the adaptive softmax's tail is hit decides its cost."""
    p = 1.0 / np.arange(1, vocab_size + 1)
    return torch.from_numpy(np.random.default_rng(seed).choice(vocab_size, size=n, p=p / p.sum()))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _autocast(device: torch.device, precision: str) -> Any:
    if device.type == "cuda" and precision.startswith("bf16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if device.type == "cuda" and precision.startswith("16"):
        return torch.autocast("cuda", dtype=torch.float16)
    return nullcontext()


class _Stepper:
    """One model taking training, inference or generation steps on a token stream, memory carried."""

    def __init__(self, layout: Sequence[str], cfg: Config, vocab_size: int, mode: str, device: torch.device,
                 model: ModelConfig | None = None) -> None:
        torch.manual_seed(0)
        model_cfg = replace(model or cfg.model, n_blocks=len(layout), blocks=tuple(layout))
        self.model = build_fixed_model(model_cfg, vocab_size).to(device).train(mode == "train")
        self.mode, self.device, self.cfg = mode, device, cfg
        if mode == "generate":  # parnas generate's memory (in evaluation, inference keeps model.eval_mem_len)
            self.model.evaluate_with(generation_memory(cfg.model, cfg.data.seg_len))
        self.memory = self.model.memory_len  # the states this target's memory keeps
        # the optimiser training builds (fused where it may run), so the constant part is what a step pays
        self.optimizer = adam(self.model.parameters(), lr=cfg.train.lr,
                              precision=cfg.train.precision) if mode == "train" else None
        B, L = cfg.data.batch_size, cfg.data.seg_len
        stream = zipf_ids(B * L * 8 + 1, vocab_size)
        self.stream = stream.to(device)
        # each segment's targets grouped on the host, as the training loop groups them: the step reads nothing back
        self.groups = [None if g is None else g.to(device) for g in
                       (self.model.group_targets(stream[t * B * L + 1:(t + 1) * B * L + 1]) for t in range(8))]
        self.mems, self.t, self.h = None, 0, None

    def steps(self, n: int) -> None:
        if self.mode == "generate":
            return self._generate(n)
        B, L = self.cfg.data.batch_size, self.cfg.data.seg_len
        for _ in range(n):
            t, groups = self.t % 8 * B * L, self.groups[self.t % 8]
            x, y = self.stream[t:t + B * L].view(B, L), self.stream[t + 1:t + B * L + 1].view(B, L)
            self.t += 1
            with _autocast(self.device, self.cfg.train.precision):
                if self.optimizer is None:
                    with torch.no_grad():
                        h, self.mems = self.model(x, self.mems)
                        self.model.nll(h, y, groups)
                    continue
                h, self.mems = self.model(x, self.mems)
                loss = self.model.nll(h, y, groups).float().mean() + self.model.aux_loss  # aux: compressive memory
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.cfg.train.clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip)
            self.optimizer.step()

    @torch.no_grad()
    def _generate(self, n: int) -> None:
        """``n`` tokens decoded one at a time (batch 1), each sampled from the whole vocabulary and read back to
        the host as ``parnas generate`` reads it; the first call fills the memory from the stream."""
        L = self.cfg.data.seg_len
        with _autocast(self.device, self.cfg.train.precision):
            if self.mems is None:
                for t in range(full_memory_steps(self.cfg, self.memory)):  # (1, L) segments until the memory is full
                    self.h, self.mems = self.model(self.stream[t % 8 * L:(t % 8 + 1) * L][None], self.mems)
            for _ in range(n):
                logp = self.model.log_probs(self.h[:, -1]).float()  # (1, V)
                token = torch.multinomial(logp.softmax(-1), 1)  # (1, 1)
                int(token)  # the host reads every token it decodes
                self.h, self.mems = self.model(token, self.mems)  # (1, 1, D)


def time_layouts(layouts: Sequence[Sequence[str]], cfg: Config, vocab_size: int, *, mode: str = "train",
                 rounds: int = 5, steps: int = 3, warmup: int = 3, device: torch.device | str = "cpu",
                 models: Sequence[ModelConfig | None] | None = None) -> list[float]:
    """Median milliseconds per step of each layout, timed in interleaved rounds at ``cfg``'s shapes (or at
    ``models[i]``'s model settings where given: a study's width-scaled Transformer-XL).

    Every round times ``steps`` steps of each model, the order rotating by one each round; for ``generate``
    a step is one token and a round decodes :func:`tokens_per_round` of them.
    """
    return [statistics.median(t) for t in _round_times(layouts, cfg, vocab_size, mode, rounds, steps, warmup,
                                                        torch.device(device), models)]


def _round_times(layouts: Sequence[Sequence[str]], cfg: Config, vocab_size: int, mode: str, rounds: int,
                 steps: int, warmup: int, device: torch.device, models: Sequence[ModelConfig | None] | None = None,
                 after_round: Callable[[], None] | None = None) -> list[list[float]]:
    """ms per step of each layout in each round: ``times[layout][round]``; ``after_round`` is called between
    rounds (untimed)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    # the caller's random state is left as it was: a search seeds its logits after timing (or not, when cached)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return _timed_rounds(layouts, cfg, vocab_size, mode, rounds, steps, warmup, device, models, after_round)


def _timed_rounds(layouts: Sequence[Sequence[str]], cfg: Config, vocab_size: int, mode: str, rounds: int,
                  steps: int, warmup: int, device: torch.device, models: Sequence[ModelConfig | None] | None = None,
                  after_round: Callable[[], None] | None = None) -> list[list[float]]:
    steppers = [_Stepper(layout, cfg, vocab_size, mode, device, model)
                for layout, model in zip(layouts, models or [None] * len(layouts))]
    for s in steppers:
        s.steps(max(warmup, full_memory_steps(cfg, s.memory)))
    times: list[list[float]] = [[] for _ in steppers]
    n = tokens_per_round(cfg, steps) if mode == "generate" else steps
    for r in range(rounds):
        for i in _rotated(len(steppers), r):
            _sync(device)
            start = time.perf_counter()
            steppers[i].steps(n)
            _sync(device)
            times[i].append((time.perf_counter() - start) * 1e3 / n)
        if after_round is not None:
            after_round()
    return times


def target_memories(cfg: Config) -> dict[str, int]:
    """States the memory keeps while each target is timed: ``mem_len`` in a train step, the evaluation memory
    (``model.eval_mem_len``) in an inference segment, :func:`parnas.config.generation_memory` generating."""
    return {"train": cfg.model.mem_len, "inference": cfg.model.evaluation_memory,
            "generate": generation_memory(cfg.model, cfg.data.seg_len)}


def tokens_per_round(cfg: Config, steps: int) -> int:
    """Tokens a generation round decodes per layout: a segment's worth (``seg_len``) for each of ``steps``.
    A generated token costs about what one position of a batch costs, so ``steps`` tokens would make a round of
    a few milliseconds, which a timer tick or a page fault can double; ``steps`` segments last as long as the
    other targets' rounds and are timed as steadily."""
    return steps * cfg.data.seg_len


def full_memory_steps(cfg: Config, memory: int | None = None) -> int:
    """Steps after which every memory is full: the memory's ``memory`` states (default ``mem_len``), and a
    compressive block's ``length`` compressed ones (``rate`` evicted states each), so steps are timed at steady
    state."""
    s = cfg.model.settings_of("compressive")
    memory = cfg.model.mem_len if memory is None else memory
    return math.ceil((memory + s.rate * s.length) / cfg.data.seg_len) + 1


def _rotated(n: int, r: int) -> Iterator[int]:
    return ((i + r) % n for i in range(n))


@dataclass(frozen=True)
class LatencyTable:
    """Per-kind block costs and the constant part, in milliseconds per step, for one device and shape set.

    ``predict(kinds)`` is the table's model of a whole step: ``constant + sum(kind costs)``.
    """

    key: dict[str, Any]
    constant_ms: dict[str, float]  # mode -> ms
    kinds_ms: dict[str, dict[str, float]]  # kind -> mode -> ms per block
    n_reference: int  # blocks in the uniform models that were timed
    timing: dict[str, Any] | None = None  # how steady, under what load, when and where (None: an older table)

    @property
    def modes(self) -> tuple[str, ...]:
        """The targets this table prices (a version-1 table has no ``generate``)."""
        return tuple(m for m in MODES if m in self.constant_ms)

    def block_ms(self, kind: str, mode: str = "train") -> float:
        if kind not in self.kinds_ms:
            raise KeyError(f"no latency for block kind {kind!r} in this table ({sorted(self.kinds_ms)})")
        return self.kinds_ms[kind][mode]

    def predict(self, kinds: Sequence[str], mode: str = "train") -> float:
        """Predicted milliseconds of one step of a model with these blocks."""
        return self.constant_ms[mode] + sum(self.block_ms(k, mode) for k in kinds)

    def transformer_xl_ms(self, n_blocks: int, mode: str = "train") -> float:
        return self.predict(transformer_xl_layout(n_blocks), mode)

    def costs(self, mode: str = "train") -> dict[str, float]:
        return {k: v[mode] for k, v in self.kinds_ms.items()}

    def for_run(self, key: dict[str, Any]) -> LatencyTable:
        """This table's costs under a run's ``key``, restricted to the kinds that key lists."""
        return LatencyTable(key, self.constant_ms, {k: self.kinds_ms[k] for k in key["kinds"]}, self.n_reference,
                            self.timing)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LatencyTable:
        if d.get("format") != FORMAT or d.get("version") not in VERSION_MODES:
            raise ValueError("not a parnas latency table")
        return cls(d["key"], d["constant_ms"], d["kinds_ms"], int(d["n_reference"]), d.get("timing"))


def table_key(cfg: Config, vocab_size: int, kinds: Sequence[str], device: torch.device) -> dict[str, Any]:
    """Everything a block's measured cost depends on (the memories ``model.mem_len`` and ``model.eval_mem_len``
    among the model's settings; the position clamp changes no cost)."""
    key = {"device": device_name(device), "device_type": device.type, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "precision": cfg.train.precision,
           "batch_size": cfg.data.batch_size, "seg_len": cfg.data.seg_len, "vocab_size": vocab_size,
           "clip": bool(cfg.train.clip), "model": model_key(cfg.model, kinds), "kinds": sorted(kinds)}
    return json.loads(json.dumps(key))  # as it reads back from the cache (tuples become lists)


def model_key(model: ModelConfig, kinds: Sequence[str]) -> dict[str, Any]:
    """The model settings a table's costs depend on: the body's, and the timed kinds' own (a ``<kind>`` section
    each; another kind's settings change no cost here)."""
    timed = set(kinds)
    return {k: v for k, v in model.to_dict().items()
            if k not in ("n_blocks", "blocks", "clamp_len") and (not isinstance(v, dict) or k in timed)}


def measure_table(cfg: Config, vocab_size: int, kinds: Sequence[str], device: torch.device | str = "cpu", *,
                  rounds: int = 7, steps: int = 3, n_reference: int | None = None) -> LatencyTable:
    """Time uniform models (all identity, then all of each kind) and derive per-block costs, recording each
    cost's spread over the rounds and the load the rounds competed with (:func:`timing_record`)."""
    device = torch.device(device)
    n = n_reference or cfg.model.n_blocks
    kinds = [k for k in dict.fromkeys(kinds) if k != "identity"]
    layouts = [["identity"] * n] + [[k] * n for k in kinds]
    constant: dict[str, float] = {}
    per_kind: dict[str, dict[str, float]] = {k: {} for k in kinds}
    spread: dict[str, dict[str, float | None]] = {}
    load: list[float] = []  # other processes' runnable threads, after every round

    def sample() -> None:
        others = runnable_elsewhere()
        if others is not None:
            load.append(others)

    for mode in MODES:
        times = _round_times(layouts, cfg, vocab_size, mode, rounds, steps, 3, device, after_round=sample)
        constant[mode] = statistics.median(times[0])
        spread[mode] = {"constant": relative_spread(times[0], times[0])}
        for k, t in zip(kinds, times[1:]):  # differences within a round: a load that drifts cancels out
            differences = [a - b for a, b in zip(t, times[0])]
            per_kind[k][mode] = max(MIN_BLOCK_MS, statistics.median(differences) / n)
            spread[mode][k] = relative_spread(differences, t)
    per_kind["identity"] = {mode: 0.0 for mode in MODES}  # what the constant model already is
    return LatencyTable(table_key(cfg, vocab_size, [*kinds, "identity"], device), constant, per_kind, n,
                        timing_record(rounds, spread, load, device))


def relative_spread(values: Sequence[float], steps_ms: Sequence[float]) -> float | None:
    """How far a cost's rounds spread: the interquartile range of its per-round ``values`` over the median step
    of the model they were read from (a block's cost is a difference of two models' steps: its spread is
    judged against the step it is part of). None for fewer than two rounds."""
    if len(values) < 2:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return round((q3 - q1) / statistics.median(steps_ms), 4)


def timing_record(rounds: int, spread: dict[str, dict[str, float | None]], load: Sequence[float],
                  device: torch.device) -> dict[str, Any]:
    """When, where and how steadily a table was timed: ``load`` is the mean of the other processes' runnable
    threads sampled between rounds (else the 1-minute load average), against the ``cores`` this process may
    use and the ``threads`` it timed with."""
    return {"timed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": socket.gethostname(),
            "device": device_name(device), "threads": torch.get_num_threads(), "cores": usable_cores(),
            "load": round(statistics.mean(load) if load else machine_load(), 2), "rounds": rounds, "spread": spread}


def read_table(path: Path) -> LatencyTable:
    """A table written by :meth:`LatencyTable.to_dict` (a search pins its own in its run directory)."""
    return LatencyTable.from_dict(reading.read_json(path))


# Where and how a table was timed rather than what was timed: a table from another machine may differ in these.
DEVICE_FIELDS = ("device", "device_type", "torch", "threads", "precision")


def shape_differences(table_key: dict[str, Any], run_key: dict[str, Any]) -> list[str]:
    """``name table-value vs run-value`` for each shape (``model.<setting>`` for the model's) that differs.
    A model setting newer than the table counts as its default there (what the code that timed it built)."""
    def flat(key: dict[str, Any], model_defaults: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in key.items() if k not in (*DEVICE_FIELDS, "kinds", "model")}
        model = {**model_defaults, **upgrade_flat_settings(key.get("model") or {}, note=False)}  # earlier versions
        for name, value in model.items():
            if isinstance(value, dict):  # a kind's settings: only the run's kinds' count
                out.update({f"model.{name}.{k}": v for k, v in value.items()} if name in run_key["kinds"] else {})
            else:
                out[f"model.{name}"] = value
        return out

    # as a key reads back (tuples become lists)
    defaults = json.loads(json.dumps(model_key(ModelConfig(), run_key.get("kinds", ()))))
    table, run = flat(table_key, {k: defaults[k] for k in defaults if k in run_key.get("model", {})}), flat(run_key, {})
    return [f"{k} {json.dumps(table.get(k, 'absent'))} (table) vs {json.dumps(run.get(k, 'absent'))} (run)"
            for k in sorted(set(table) | set(run)) if table.get(k, "absent") != run.get(k, "absent")]


def load_table_for(path: str | Path, run_key: dict[str, Any], setting: str = "search.latency_table",
                   target: str = "train") -> LatencyTable:
    """The table at ``path`` (timed anywhere, e.g. by ``parnas latency`` on the target GPU) for a run whose own
    key is ``run_key``, restricted to its kinds: its shapes must be the run's, its device may differ.

    Raises :class:`ConfigError` (one line naming ``setting``) for a file that is not a parnas latency table,
    one timed at other shapes (each differing key with both values), one without a cost for a kind the run
    needs, or one without the run's latency ``target`` (a version-1 table has no ``generate``)."""
    path = Path(path)
    try:
        data = reading.read_json(path, f"{setting}: {path}")
    except OSError as e:
        raise ConfigError(f"{setting}: cannot read {path}: {e.strerror}") from None
    except ValueError:  # not UTF-8 or not JSON: a log, a binary file
        raise ConfigError(f"{setting}: {path} is not a parnas latency table (not JSON)") from None
    table = _valid_table(data)
    if table is None:
        raise ConfigError(f"{setting}: {path} is not a parnas latency table (format {FORMAT!r} version "
                          f"{' or '.join(map(str, VERSION_MODES))}, as `parnas latency` writes)")
    problem = cost_problem(table)
    if problem:
        raise ConfigError(f"{setting}: {path} gives {problem}; time the table again with `parnas latency`")
    if target not in table.modes:
        raise ConfigError(f"{setting}: {path} has no {target} costs (it prices {', '.join(table.modes)}: format "
                          f"version {data.get('version')}); time it again with `parnas latency` on its device")
    differences = shape_differences(table.key, run_key)
    if differences:
        raise ConfigError(f"{setting}: {path} was timed at other shapes than this run's: {'; '.join(differences)}")
    missing = [k for k in run_key["kinds"] if k not in table.kinds_ms]
    if missing:
        raise ConfigError(f"{setting}: {path} has no cost for block kind(s) {', '.join(missing)} "
                          f"(it has {', '.join(sorted(table.kinds_ms))}); time one with `parnas latency` "
                          "for this run's candidates")
    return table.for_run({**run_key, **{k: table.key[k] for k in DEVICE_FIELDS if k in table.key}})


def cost_problem(table: LatencyTable) -> str | None:
    """What makes the table's costs unusable, or None: a constant that is not finite and positive, or a block
    cost that is not finite, negative, or zero for a kind other than ``identity`` (a search would take that kind
    for free). ``measure_table`` never writes one."""
    for mode in table.modes:
        a = "an" if mode[0] in "aeiou" else "a"  # an inference cost
        if not (math.isfinite(table.constant_ms[mode]) and table.constant_ms[mode] > 0):
            return f"{a} {mode} constant of {table.constant_ms[mode]} ms (it must be finite and positive)"
        for kind, costs in table.kinds_ms.items():
            cost = costs[mode]
            if not math.isfinite(cost) or cost < 0 or (cost == 0 and kind != "identity"):
                return (f"block kind {kind!r} {a} {mode} cost of {cost} ms (costs are finite and positive; only "
                        "identity may cost 0)")
    return None


def _valid_table(data: Any) -> LatencyTable | None:
    """``data`` as a table if it is a whole, well-typed table of a version this parnas reads, else None."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)  # finite and positive: cost_problem

    try:
        table = LatencyTable.from_dict(data)
        modes = VERSION_MODES[data["version"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    ok = (isinstance(table.key, dict) and isinstance(table.key.get("device"), str)
          and isinstance(table.key.get("model"), dict) and isinstance(table.constant_ms, dict)
          and all(number(table.constant_ms.get(mode)) for mode in modes) and isinstance(table.kinds_ms, dict)
          and all(isinstance(v, dict) and all(number(v.get(mode)) for mode in modes)
                  for v in table.kinds_ms.values()))
    return table if ok else None
