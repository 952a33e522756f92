"""The cache of latency tables: a table is kept only if it was timed on a machine that left the timing its cores.

A table timed while other processes take the cores prices the kinds as that moment did, and every later search
would reuse it. So a table is cached (under ``<cache>/latency/``, keyed by device, torch version, threads and every
shape that changes the cost) only when the other processes' runnable threads, sampled between rounds, averaged at
most ``cores - threads``; otherwise it is timed again (up to ``TRIES`` times) and the steadiest used uncached, with
one warning. A table that still spreads by over ``SPREAD_LIMIT`` on a machine left to it spreads by the device's own
jitter, which another try repeats: it is cached with one warning.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from parnas.config import Config, transformer_xl_layout
from parnas.errors import ParnasError
from parnas.files import write_json_atomic
from parnas.owned_folders import hold_run_dir
from parnas.training.latency_table import MODES, LatencyTable, check_targets, cost_problem, read_table, table_key
from parnas.training.timing import stderr_line

SPREAD_LIMIT = 0.10  # the most a cost's rounds may spread, as a fraction of the step it was read from
TRIES = 3  # timings of a table before a run goes on with the steadiest, uncached


def largest_spread(table: LatencyTable) -> tuple[float, str] | None:
    """The table's largest spread and where (``"dense, train"``); None for a table that records none."""
    spreads = [(value, f"{entry}, {mode}") for mode, entries in ((table.timing or {}).get("spread") or {}).items()
               for entry, value in entries.items() if value is not None]
    return max(spreads) if spreads else None


def crowded(table: LatencyTable) -> bool:
    """Whether other processes kept more threads runnable, on average, than the cores the timing left free: the
    one unsteadiness that another try can cure."""
    timing = table.timing or {}
    return bool(timing) and timing["load"] > timing["cores"] - timing["threads"]


def unsteady(table: LatencyTable) -> str | None:
    """Why ``table`` may not be cached (no record of its timing, or the load it was timed under), or None if it
    may. A spread over ``SPREAD_LIMIT`` on a machine left to the timing does not keep it out (:func:`jitter`)."""
    timing = table.timing
    if not timing or largest_spread(table) is None:
        return "no record of its spread (an older table, or a single round)"
    if crowded(table):
        spread, where = largest_spread(table)
        return (f"spread {spread:.0%} ({where}) while other processes kept {timing['load']:.1f} threads runnable "
                f"beside its {timing['threads']} on {timing['cores']} cores")
    return None


def jitter(table: LatencyTable) -> str | None:
    """The table's largest spread, said, where it is over ``SPREAD_LIMIT``; else None."""
    spread = largest_spread(table)
    return f"spread {spread[0]:.0%} ({spread[1]}) is over {SPREAD_LIMIT:.0%}" if spread and spread[0] > SPREAD_LIMIT \
        else None


def describe(table: LatencyTable) -> str:
    """When, where and how steadily ``table`` was timed, in a few words."""
    timing = table.timing
    if not timing:
        return f"timed on {table.key.get('device', 'an unnamed device')} (no record of when, its spread or load)"
    spread = largest_spread(table)
    steadiness = f"spread {spread[0]:.1%} ({spread[1]})" if spread else "spread unknown"
    threads = f"{timing['threads']} thread{'s' * (timing['threads'] != 1)}"
    return (f"timed {timing['timed_at']} on {timing['host']} ({timing['device']}, {threads}, load "
            f"{timing['load']:.1f} beside it on {timing['cores']} cores), {steadiness}")


def cache_path(key: dict[str, Any], cache_dir: Path | None = None) -> Path:
    from parnas.data.corpora import default_cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir or default_cache_dir()) / "latency" / f"{digest}.json"


def _warn(line: str) -> None:
    print(f"parnas: warning: {line}", file=sys.stderr, flush=True)


def latency_table(cfg: Config, vocab_size: int, kinds: Sequence[str], device: torch.device | str = "cpu", *,
                  cache_dir: Path | None = None, refresh: bool = False,
                  warn: Callable[[str], None] = _warn, targets: Sequence[str] = MODES,
                  progress: Callable[[str], None] | None = stderr_line) -> tuple[LatencyTable, bool]:
    """The cached table for these shapes on this device, timed now if absent (or ``refresh``); returns
    (table, was_cached). A table timed now is cached as the module docstring says. The newest cached table timed
    for at least these kinds and ``targets`` serves, restricted to them: searches of different candidate sets
    then price the kinds they share alike."""
    device = torch.device(device)
    kinds = sorted(set(kinds) | {"identity"})
    key = table_key(cfg, vocab_size, kinds, device)
    targets = check_targets(targets)
    path = cache_path(key, cache_dir)
    if targets != MODES:  # a partial table beside the whole one, not over it
        path = path.with_name(f"{path.stem}-{'-'.join(targets)}.json")
    if not refresh:
        table = newest_covering(key, path.parent, targets, warn)
        if table is not None:
            return table, True
    from parnas.training.latency import measure_table  # timing trains models: Lightning and NNI load only then

    timed: list[LatencyTable] = []
    while len(timed) < TRIES:
        table = measure_table(cfg, vocab_size, kinds, device, targets=targets, progress=progress)
        why = unsteady(table)
        if why is None:  # the machine left it its cores: as steady as this device times
            write_json_atomic(path, table.to_dict())
            wide = jitter(table)
            if wide:
                warn(f"the latency table's rounds spread widely ({wide}) on a machine that left the timing "
                     "its cores: the device's own jitter, which another try repeats; cached and used: "
                     f"{describe(table)}; `parnas latency --refresh` times it again")
            return table, False
        timed.append(table)
        if not crowded(table) or len(timed) == TRIES:
            break
        if progress is not None:
            progress(f"latency table: {why}; timing it again ({len(timed) + 1} of at most {TRIES})")
    steadiest = min(timed, key=lambda t: (largest_spread(t) or (float("inf"), ""))[0])
    times = f"timed {len(timed)} times and never steadily" if len(timed) > 1 else "not timed steadily"
    warn(f"the latency table was {times} ({unsteady(steadiest)}); this run uses "
         f"{'the steadiest' if len(timed) > 1 else 'it'}, not cached: {describe(steadiest)}")
    return steadiest, False


def newest_covering(key: dict[str, Any], folder: Path, targets: Sequence[str] = MODES,
                    warn: Callable[[str], None] = _warn) -> LatencyTable | None:
    """The newest readable, steady table in ``folder`` with ``key``'s shapes and device, at least its kinds and the
    ``targets``, restricted to those kinds; None if there is none. One whose costs fail :func:`cached_problem` is
    removed with one ``warn`` line, never used."""
    def shapes(of: dict[str, Any]) -> dict[str, Any]:  # the model's and the requested kinds' settings
        model = {k: v for k, v in of["model"].items() if not isinstance(v, dict) or k in key["kinds"]}
        return {k: v for k, v in of.items() if k != "kinds"} | {"model": model}

    dated = []
    for file in folder.glob("*.json"):
        try:
            dated.append((file.stat().st_mtime_ns, file))
        except OSError:
            continue  # removed meanwhile
    for _, file in sorted(dated, reverse=True):
        try:
            table = read_table(file)
            covers = shapes(table.key) == shapes(key) and set(key["kinds"]) <= set(table.key["kinds"])
            # a table cached before generation was timed, or before tables recorded their spread, is timed again
            usable = covers and set(targets) <= set(table.modes) and unsteady(table) is None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, ParnasError):  # ParnasError: too large
            continue
        problem = cached_problem(table) if usable else None
        if problem:
            try:
                file.unlink(missing_ok=True)
                removed = "removed"
            except OSError:  # a cache this user may read but not change
                removed = "left in place"
            warn(f"the cached latency table {file} gives {problem}: {removed}, not used; timing the table again")
        elif usable:
            return table.for_run(key)
    return None


def cached_problem(table: LatencyTable) -> str | None:
    """What keeps a cached table from serving: the costs :func:`parnas.training.latency_table.cost_problem` refuses in
    a given table (each finite, none negative, only identity free, a positive constant), or a cost that is not
    a number at all. ``measure_table`` writes neither: such a file was damaged or written by hand."""
    try:
        return cost_problem(table)
    except (TypeError, KeyError, AttributeError):
        return "costs that are not numbers"


def check_cache(cfg: Config, vocab_size: int, kinds: Sequence[str], device: torch.device | str = "cpu", *,
                cache_dir: Path | None = None) -> list[str]:
    """``parnas latency --check``: the table a run would take from the cache, against one timed now (written
    nowhere): when each was timed and how steadily, and how far the cached costs are off (:func:`drift`)."""
    device = torch.device(device)
    kinds = sorted(set(kinds) | {"identity"})
    key = table_key(cfg, vocab_size, kinds, device)
    cached = newest_covering(key, cache_path(key, cache_dir).parent)
    if cached is None:
        return [f"no steady table for these shapes in this machine's cache ({key['device']}, {key['threads']} "
                "thread(s)): a search would time one; `parnas latency --out FILE` times and caches one now"]
    from parnas.training.latency import measure_table  # as in latency_table: loaded only to time

    now = measure_table(cfg, vocab_size, kinds, device)
    problem = unsteady(now)
    return [f"cached: {describe(cached)}", f"now:    {describe(now)}", *drift(cached, now, cfg.model.n_blocks),
            f"(the timing now is not steady either: {problem})" if problem else
            "`parnas latency --refresh --out FILE` replaces the cached table with a new timing"]


def drift(cached: LatencyTable, now: LatencyTable, n_blocks: int) -> list[str]:
    """How far ``cached``'s costs are from ``now``'s (the same shapes, timed again): per target, the constant and
    each kind's cost, then the furthest a whole step's prediction moves (uniform models and Transformer-XL)."""
    def change(cached: float, now: float) -> str:  # how far the cached figure is off the one timed now
        return f"{cached:.3f} ms cached, {now:.3f} now" + (f" ({cached / now - 1:+.0%})" if now > 0 else "")

    lines, furthest = [], (0.0, "")
    kinds = [k for k in now.key["kinds"] if k != "identity" and k in cached.kinds_ms]
    for mode in (m for m in MODES if m in cached.modes and m in now.modes):
        costs = [f"constant {change(cached.constant_ms[mode], now.constant_ms[mode])}"]
        costs += [f"{k} {change(cached.block_ms(k, mode), now.block_ms(k, mode))}" for k in kinds]
        lines.append(f"  {mode}: " + "; ".join(costs))
        layouts = {"all identity": ["identity"] * n_blocks, "Transformer-XL": transformer_xl_layout(n_blocks),
                   **{f"all {k}": [k] * n_blocks for k in kinds}}
        for name, layout in layouts.items():
            off = cached.predict(layout, mode) / now.predict(layout, mode) - 1
            furthest = max(furthest, (abs(off), f"{off:+.0%} on a {mode} step of {name}"))
    verdict = f"the cached table is off by at most {furthest[1]}" if furthest[1] else "no target to compare"
    return [*lines, verdict]


def experiment_table(folder: Path, key: dict[str, Any], obtain: Callable[[], LatencyTable],
                     progress: Callable[[str], None] | None = stderr_line) -> tuple[LatencyTable, Path, bool]:
    """The one table every trial of an experiment prices with, kept in the experiment's ``folder``: returns (table,
    its file, whether another trial had made it). The first trial to need it holds ``folder`` while ``obtain``
    gives it; the others wait and read it, so no two trials optimise against different prices. A file that does
    not read back as a table of ``key`` is replaced."""
    path = folder / f"{cache_path(key).stem}.json"
    with _held_when_free(folder, progress):
        try:
            table = read_table(path) if path.is_file() else None
        except (OSError, ValueError, KeyError, TypeError, ParnasError):
            table = None
        if table is not None and table.key == key and cached_problem(table) is None:
            return table, path, True
        table = obtain()
        write_json_atomic(path, table.to_dict())
        return table, path, False


@contextmanager
def _held_when_free(folder: Path, progress: Callable[[str], None] | None, every_s: float = 1.0) -> Iterator[None]:
    """Hold ``folder``, waiting (one ``progress`` line) while another process holds it."""
    said = False
    while True:
        try:
            holding = hold_run_dir(folder)
            holding.__enter__()
        except ParnasError as e:
            if "in use by another parnas run" not in str(e):
                raise
            if not said and progress is not None:
                progress("latency table: waiting for the trial that is timing the experiment's table")
                said = True
            time.sleep(every_s)
            continue
        try:
            yield
        finally:
            holding.__exit__(None, None, None)
        return
