"""Latency measured on the device: what a block costs where the model will run.

PAR's premise is that attention is the slow block; FLOPs say otherwise at short contexts (projections dominate),
and neither counts softmax, masks, rel-shift or the optimiser. So the cost is timed at the run's shapes, for each
latency target (``train``: a whole step with Adam; ``inference``: a forward in evaluation; ``generate``: one token
of batch 1 sampled and fed back, as ``parnas generate`` decodes), each with its own memory: a model of all
``identity`` blocks gives the constant, the same model with every block of kind k gives k's cost per block, and a
layout is predicted as ``constant + sum of its blocks' costs``.

Models are timed in interleaved rounds (the order rotating), after warm-up, the median round kept, so a load
that comes and goes biases no kind against another; on CUDA by CUDA events, stopping once the rounds are steady.
``benchmarks/latency_model.py`` checks predictions against measured whole-model steps.
"""

from __future__ import annotations

import math
import socket
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch

from parnas.config import TARGET_LABELS, Config, ModelConfig, generation_memory
from parnas.nn.model import build_fixed_model, full_memory_steps
from parnas.threads import machine_load, runnable_elsewhere, usable_cores
from parnas.training.latency_table import MODES, LatencyTable, check_targets, device_name, table_key
from parnas.training.task import adam
from parnas.training.timing import Phase, device_failures_said, stderr_line, time_ms

MIN_BLOCK_MS = 1e-3  # what a kind costs that timed no slower than identity (identity alone costs 0)
DECODE_TOKENS = 32  # tokens a generation round decodes per model: a short decode, not a segment per step
CUDA_ROUND_MS = 20.0  # on CUDA a round runs steps until it lasts about this long per model
CUDA_MAX_STEPS = 20  # ... but no more steps than this
STEADY_SPREAD = 0.02  # on CUDA the rounds stop once every timing spreads by at most this (of its step)
MIN_ROUNDS = 5  # ... after at least this many rounds


def zipf_ids(n: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Token ids with a Zipf (1/rank) law: how often the adaptive softmax's tail is hit decides its cost."""
    p = 1.0 / np.arange(1, vocab_size + 1)
    return torch.from_numpy(np.random.default_rng(seed).choice(vocab_size, size=n, p=p / p.sum()))


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
                for t in range(full_memory_steps(self.cfg.model, L, self.memory)):  # (1, L) segments until it is full
                    self.h, self.mems = self.model(self.stream[t % 8 * L:(t % 8 + 1) * L][None], self.mems)
            for _ in range(n):
                logp = self.model.log_probs(self.h[:, -1]).float()  # (1, V)
                token = torch.multinomial(logp.softmax(-1), 1)  # (1, 1)
                int(token)  # the host reads every token it decodes
                self.h, self.mems = self.model(token, self.mems)  # (1, 1, D)


def time_layouts(layouts: Sequence[Sequence[str]], cfg: Config, vocab_size: int, *, mode: str = "train",
                 rounds: int = 5, steps: int = 3, warmup: int = 3, device: torch.device | str = "cpu",
                 models: Sequence[ModelConfig | None] | None = None,
                 progress: Callable[[str], None] | None = None) -> list[float]:
    """Median milliseconds per step of each layout, timed in interleaved rounds at ``cfg``'s shapes (or at
    ``models[i]``'s model settings where given); for ``generate`` a step is one token. ``progress`` gets one line
    for a phase that runs long; a device that fails meanwhile is a one-line :class:`ParnasError`."""
    return [statistics.median(t) for t in time_layout_rounds(layouts, cfg, vocab_size, mode=mode, rounds=rounds,
                                                              steps=steps, warmup=warmup, device=device,
                                                              models=models, progress=progress)]


def time_layout_rounds(layouts: Sequence[Sequence[str]], cfg: Config, vocab_size: int, *, mode: str = "train",
                       rounds: int = 5, steps: int = 3, warmup: int = 3, device: torch.device | str = "cpu",
                       models: Sequence[ModelConfig | None] | None = None,
                       progress: Callable[[str], None] | None = None) -> list[list[float]]:
    """:func:`time_layouts`' rounds themselves, ms per step of each layout in each round (``times[layout][round]``):
    for a caller that reports their spread beside their median."""
    device = torch.device(device)
    steady = _each_steady if device.type == "cuda" else None
    with device_failures_said(f"timing {TARGET_LABELS.get(mode, mode)}s", device):
        return _round_times(layouts, cfg, vocab_size, mode, rounds, steps, warmup, device, models,
                            progress=progress, steady=steady)


def _round_times(layouts: Sequence[Sequence[str]], cfg: Config, vocab_size: int, mode: str, rounds: int,
                 steps: int, warmup: int, device: torch.device, models: Sequence[ModelConfig | None] | None = None,
                 after_round: Callable[[], None] | None = None, *, progress: Callable[[str], None] | None = None,
                 steady: Callable[[list[list[float]]], bool] | None = None) -> list[list[float]]:
    """ms per step of each layout in each round: ``times[layout][round]``; ``after_round`` is called between
    rounds (untimed); ``steady(times)`` True after ``MIN_ROUNDS`` rounds ends them early."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    # the caller's random state is left as it was: a search seeds its logits after timing (or not, when cached)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        what = f"{TARGET_LABELS[mode]}s of {len(layouts)} model{'s' * (len(layouts) != 1)}"
        warming = Phase(f"{what}, warm-up", len(layouts), "models", progress)
        steppers = []
        for layout, model in zip(layouts, models or [None] * len(layouts)):
            stepper = _Stepper(layout, cfg, vocab_size, mode, device, model)
            stepper.steps(max(warmup, full_memory_steps(cfg.model, cfg.data.seg_len, stepper.memory)))
            steppers.append(stepper)
            warming.done(len(steppers))
        n = tokens_per_round(cfg, steps) if mode == "generate" else steps
        if device.type == "cuda" and mode != "generate":  # enough steps that the fastest model's round lasts a while
            fastest = min(time_ms(lambda s=s: s.steps(n), device) for s in steppers) / n
            n = max(n, CUDA_MAX_STEPS if fastest <= 0 else min(CUDA_MAX_STEPS, math.ceil(CUDA_ROUND_MS / fastest)))
        times: list[list[float]] = [[] for _ in steppers]
        timing = Phase(what, rounds, "rounds", progress)
        for r in range(rounds):
            for i in _rotated(len(steppers), r):
                times[i].append(time_ms(lambda i=i: steppers[i].steps(n), device) / n)
            if after_round is not None:
                after_round()
            timing.done(r + 1)
            if steady is not None and r + 1 >= min(MIN_ROUNDS, rounds) and steady(times):
                break
        return times


def _each_steady(times: list[list[float]]) -> bool:
    """Every model's rounds spread by at most ``STEADY_SPREAD`` of its median step."""
    return all((relative_spread(t, t) or 0.0) <= STEADY_SPREAD for t in times)


def tokens_per_round(cfg: Config, steps: int) -> int:
    """Tokens a generation round decodes per model: ``DECODE_TOKENS`` (fewer only where ``steps`` segments hold
    fewer). Each is a forward of batch 1 read back to the host: a segment's worth would take long, and a few dozen
    tokens time steadily."""
    return max(1, min(DECODE_TOKENS, steps * cfg.data.seg_len))


def _rotated(n: int, r: int) -> Iterator[int]:
    return ((i + r) % n for i in range(n))


def measure_table(cfg: Config, vocab_size: int, kinds: Sequence[str], device: torch.device | str = "cpu", *,
                  rounds: int = 7, steps: int = 3, n_reference: int | None = None,
                  targets: Sequence[str] = MODES,
                  progress: Callable[[str], None] | None = stderr_line) -> LatencyTable:
    """Time uniform models (all identity, then all of each kind) for each of ``targets`` and derive per-block
    costs, recording each cost's spread over the rounds and the load they competed with (:func:`timing_record`).
    A device that fails meanwhile is a one-line :class:`ParnasError`: no table is returned, so none is written."""
    targets = check_targets(targets)
    device = torch.device(device)
    n = n_reference or cfg.model.n_blocks
    kinds = [k for k in dict.fromkeys(kinds) if k != "identity"]
    layouts = [["identity"] * n] + [[k] * n for k in kinds]
    constant: dict[str, float] = {}
    per_kind: dict[str, dict[str, float]] = {k: {} for k in kinds}
    spread: dict[str, dict[str, float | None]] = {}
    load: list[float] = []  # other processes' runnable threads, after every round
    ran: list[int] = []  # rounds timed of each target (on CUDA, fewer once steady)

    def sample() -> None:
        others = runnable_elsewhere()
        if others is not None:
            load.append(others)

    def steady(times: list[list[float]]) -> bool:
        return all((s or 0.0) <= STEADY_SPREAD for s in _spreads(times).values())

    def say(line: str) -> None:
        if progress is not None:
            progress(f"latency table ({', '.join(targets)}): {line}")

    table = Phase("latency table", len(targets), "targets", progress)
    with device_failures_said("timing the latency table", device):
        for done, mode in enumerate(targets, 1):
            times = _round_times(layouts, cfg, vocab_size, mode, rounds, steps, 3, device, after_round=sample,
                                 progress=say, steady=steady if device.type == "cuda" else None)
            constant[mode], ran = statistics.median(times[0]), [*ran, min(map(len, times))]
            spread[mode] = {("constant" if i == 0 else kinds[i - 1]): v for i, v in _spreads(times).items()}
            for k, t in zip(kinds, times[1:]):  # differences within a round: a load that drifts cancels out
                differences = [a - b for a, b in zip(t, times[0])]
                per_kind[k][mode] = max(MIN_BLOCK_MS, statistics.median(differences) / n)
            table.done(done)
    per_kind["identity"] = {mode: 0.0 for mode in targets}  # what the constant model already is
    return LatencyTable(table_key(cfg, vocab_size, [*kinds, "identity"], device), constant, per_kind, n,
                        timing_record(min(ran), spread, load, device))


def _spreads(times: list[list[float]]) -> dict[int, float | None]:
    """Each timed cost's spread (:func:`relative_spread`): 0 the constant (the all-identity model's rounds), i a
    kind's (its model's rounds minus the constant's, round by round, against its model's step)."""
    out = {0: relative_spread(times[0], times[0])}
    for i, t in enumerate(times[1:], 1):
        out[i] = relative_spread([a - b for a, b in zip(t, times[0])], t)
    return out


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
