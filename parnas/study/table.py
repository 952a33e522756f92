"""A ranking table: the retrained perplexities of a search space's layouts, shipped as data, against which a
search is scored without retraining anything (:mod:`parnas.study.score`).

A one-shot search is only as good as its supernet's ranking of layouts. Judging that ranking needs every layout
retrained over several seeds, hours of CPU each time; a table keeps those numbers once, versioned, so that any
later search of the same space (same candidates and depth, same model, vocabulary and memory) is scored in minutes.
Its JSON format (:data:`FORMAT`, :data:`VERSION`) is benchmarks/spaces/README.md's. The **noise ceiling** is the
Kendall tau between the mean perplexities of the even and of the odd retrain seeds: how well the table ranks its
own layouts, so the finest a supernet's ranking can be judged (conservative: each half has half the seeds). The
loader checks everything, and that the recorded spreads and ceiling are the seeds' own.
"""

from __future__ import annotations

import math
import shlex
import statistics
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parnas import kinds, reading
from parnas.config import Config, transformer_xl_layout
from parnas.errors import ConfigError

FORMAT, VERSION = "parnas.ranking-table", 1
# model settings that change no evaluation of a layout: a supernet searched with them may differ from the table's
EVALUATION_NEUTRAL = ("n_blocks", "blocks", "dropout", "dropatt", "reversible", "attention_kernel")


@dataclass(frozen=True)
class RankingTable:
    """A loaded, checked table (see the module docstring); ``latency`` is a ``LatencyTable``."""

    name: str
    candidates: tuple[str, ...]
    n_blocks: int
    config: dict[str, Any]
    commit: str
    memory: dict[str, Any]
    latency: Any
    seeds: dict[str, tuple[float | None, ...]]  # layout letters -> each retrain seed's val ppl
    roles: dict[str, tuple[str, ...]]
    noise_ceiling: float | None
    rebuild: str

    @property
    def layouts(self) -> list[str]:
        return list(self.seeds)

    def kinds(self, layout: str) -> tuple[str, ...]:
        by_letter = {kinds.letter(k): k for k in self.candidates}
        return tuple(by_letter[c] for c in layout)

    def val_ppl(self, layout: str) -> float:
        """The mean over the layout's seeds."""
        return statistics.fmean(v for v in self.seeds[layout] if v is not None)

    def spread(self, layout: str) -> float | None:
        """The standard deviation over the layout's seeds (None for one seed)."""
        return seed_spread(self.seeds[layout])

    def targets(self) -> tuple[str, ...]:
        return tuple(self.latency.modes)

    def cost_ratio(self, layout: str, target: str) -> float:
        """Predicted cost relative to Transformer-XL's at the same depth, for one latency target."""
        reference = self.latency.predict(transformer_xl_layout(self.n_blocks), target)
        return self.latency.predict(self.kinds(layout), target) / reference


def seed_spread(seeds: Sequence[float | None]) -> float | None:
    """The standard deviation of the values given (None: one or none), as every spread of the study reads it."""
    values = [v for v in seeds if v is not None]
    return statistics.stdev(values) if len(values) > 1 else None


def mean_of(values: Sequence[float | None]) -> float | None:
    """The mean of the values given (None: none)."""
    given = [v for v in values if v is not None]
    return statistics.fmean(given) if given else None


def noise_ceiling(seeds: Mapping[str, Sequence[float | None]]) -> float | None:
    """Kendall's tau-b between the mean val ppl of the even-numbered and of the odd-numbered retrain seeds, over
    the layouts with a perplexity in both halves; None with fewer than 3 such layouts or a constant half."""
    from scipy.stats import kendalltau

    halves: list[tuple[float, float]] = []
    for values in seeds.values():
        even = [v for v in values[0::2] if v is not None]
        odd = [v for v in values[1::2] if v is not None]
        if even and odd:
            halves.append((statistics.fmean(even), statistics.fmean(odd)))
    if len(halves) < 3:
        return None
    tau = kendalltau([a for a, _ in halves], [b for _, b in halves]).statistic
    return None if tau != tau else float(tau)


# --- loading ---------------------------------------------------------------------------------------------------

def read_json_file(path: Path, option: str, what: str) -> Any:
    """The JSON at ``path``, given as ``option``; ConfigError (one line naming both) for a file that cannot be read
    or is not JSON (``what`` names what it should have been)."""
    try:
        return reading.read_json(path, f"{option} {path}")
    except OSError as e:
        raise ConfigError(f"{option}: cannot read {path}: {e.strerror or e}") from None
    except ValueError:
        raise ConfigError(f"{option}: {path} is not {what} (not JSON)") from None


def load_table(path: str | Path) -> RankingTable:
    """Read and check a table; raises ConfigError (one line naming the file and what is wrong)."""
    from parnas.training.latency_table import LatencyTable, cost_problem

    path = Path(path)
    data = read_json_file(path, "--table", "a parnas ranking table")

    def fail(message: str) -> ConfigError:
        return ConfigError(f"--table: {path}: {message}")

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise fail(f"not a parnas ranking table (format {FORMAT!r}, as `parnas table build` writes)")
    if data.get("version") != VERSION:
        raise fail(f"version {data.get('version')!r} is not supported (this parnas reads version {VERSION})")
    space, config, memory = data.get("space"), data.get("config"), data.get("memory")
    if not isinstance(space, dict) or not isinstance(space.get("n_blocks"), int) or space["n_blocks"] < 1 \
            or not isinstance(space.get("candidates"), list) or len(space["candidates"]) < 2:
        raise fail("'space' must give n_blocks (>= 1) and at least two candidates")
    unknown = [k for k in space["candidates"] if not isinstance(k, str) or not kinds.is_known(k)]
    if unknown:
        raise fail(f"space: {kinds.unknown_message(str(unknown[0]))}")
    candidates, n_blocks = tuple(space["candidates"]), space["n_blocks"]
    vocab = config.get("vocab") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict) or not isinstance(vocab, dict) \
            or not isinstance(vocab.get("sha256"), str) or not isinstance(config.get("overrides"), list):
        raise fail("'config' must give the preset, its overrides, the model settings and the vocabulary")
    if not isinstance(memory, dict) or not isinstance(memory.get("mem_len"), int):
        raise fail("'memory' must give mem_len and eval_mem_len")
    for key in ("name", "commit", "rebuild"):
        if not isinstance(data.get(key), str):
            raise fail(f"'{key}' must be a string")
    try:
        latency = LatencyTable.from_dict(data.get("latency_table"))
        missing = [k for k in {*candidates, "attention", "dense"} if k not in latency.kinds_ms]
        problem = cost_problem(latency) or (f"no cost for {', '.join(sorted(missing))}" if missing else None)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise fail("'latency_table' is not a parnas latency table") from None
    if problem:
        raise fail(f"its latency table gives {problem}")
    seeds, roles = _layouts(data.get("layouts"), candidates, n_blocks, fail)
    ceiling = noise_ceiling(seeds)
    recorded = data.get("noise_ceiling")
    if (ceiling is None) != (recorded is None) or (ceiling is not None and not (
            isinstance(recorded, (int, float)) and abs(recorded - ceiling) < 1e-6)):
        raise fail(f"its noise ceiling {recorded} is not its seeds' ({ceiling}): the seeds were edited")
    return RankingTable(data["name"], candidates, n_blocks, config, data["commit"], memory, latency, seeds, roles,
                        ceiling, data["rebuild"])


def _layouts(layouts: Any, candidates: Sequence[str], n_blocks: int,
             fail: Any) -> tuple[dict[str, tuple[float | None, ...]], dict[str, tuple[str, ...]]]:
    letters = {kinds.letter(k) for k in candidates}
    if not isinstance(layouts, dict) or len(layouts) < 3:
        raise fail("'layouts' must map at least 3 layouts to their seeds' val ppl")
    seeds, roles = {}, {}
    for layout, entry in layouts.items():
        if len(layout) != n_blocks or not set(layout) <= letters:
            raise fail(f"layout {layout!r} is not {n_blocks} letters of the candidates ({''.join(sorted(letters))})")
        values = entry.get("val_ppl_seeds") if isinstance(entry, dict) else None
        if not isinstance(values, list) or not all(v is None or (isinstance(v, (int, float)) and not isinstance(
                v, bool) and math.isfinite(v) and v > 0) for v in values) or all(v is None for v in values):
            raise fail(f"layout {layout}: val_ppl_seeds must list positive perplexities (null for a seed without one)")
        spread, recorded = seed_spread(values), entry.get("val_ppl_std")
        if (spread is None) != (recorded is None) or (spread is not None and not (
                isinstance(recorded, (int, float)) and abs(recorded - spread) < 1e-6 * max(1.0, spread))):
            raise fail(f"layout {layout}: val_ppl_std {recorded} is not its seeds' spread ({spread})")
        seeds[layout] = tuple(values)
        roles[layout] = tuple(entry.get("roles") or ())
    return seeds, roles


def check_matches(table: RankingTable, cfg: Config, candidates: Sequence[str], vocab: Mapping[str, Any],
                  what: str) -> None:
    """Refuses (ConfigError, one line) to score ``what`` (a search of ``cfg`` over ``candidates``, whose tokenizer
    is ``vocab``) against a table of another space, model, vocabulary or memory: its perplexities would rank other
    networks."""
    head = f"--table {table.name}: {what}"
    if set(candidates) != set(table.candidates) or cfg.model.n_blocks != table.n_blocks:
        raise ConfigError(f"{head} searched {cfg.model.n_blocks} blocks over {', '.join(candidates)}; the table's "
                          f"space is {table.n_blocks} blocks over {', '.join(table.candidates)}")
    check_same_model(table, cfg, vocab, head)


def check_same_model(table: RankingTable, cfg: Config, vocab: Mapping[str, Any], head: str) -> None:
    """Refuses (ConfigError: ``head``, then what differs) a run of ``cfg`` with tokenizer ``vocab`` whose layouts
    the table's perplexities do not describe: another vocabulary, segment length or model setting."""
    given = table.config["vocab"]
    if (given.get("kind"), given.get("vocab_size"), given.get("sha256")) != \
            (vocab.get("kind"), vocab.get("vocab_size"), vocab.get("sha256")):
        raise ConfigError(f"{head} has another vocabulary ({vocab.get('kind')}, {vocab.get('vocab_size')} tokens) "
                          f"than the table's ({given.get('kind')}, {given.get('vocab_size')} tokens)")
    if table.config.get("seg_len") not in (None, cfg.data.seg_len):
        raise ConfigError(f"{head} was evaluated at data.seg_len={cfg.data.seg_len}, the table at "
                          f"{table.config['seg_len']}")
    for key in model_differences(table.config["model"], cfg, table.candidates):
        raise ConfigError(f"{head} has another model than the table's: {key}")


def model_differences(recorded: Mapping[str, Any], cfg: Config, candidates: Sequence[str]) -> list[str]:
    """``model.<key> <table's> (table) vs <run's> (run)`` for each setting that changes a layout's evaluation (the
    memories included); a setting newer than the table counts as its default there."""
    from parnas.config import ModelConfig

    def flat(values: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in values.items():
            if key in EVALUATION_NEUTRAL:
                continue
            if isinstance(value, Mapping):  # a kind's settings: only the candidates' count
                out.update({f"{key}.{k}": v for k, v in value.items()} if key in candidates else {})
            else:
                out[key] = list(value) if isinstance(value, (tuple, list)) else value
        return out

    table = flat({**ModelConfig().to_dict(), **recorded})
    run = flat(cfg.model.to_dict())
    return [f"model.{k} {table.get(k)!r} (table) vs {run.get(k)!r} (run)" for k in sorted(set(table) | set(run))
            if table.get(k) != run.get(k)]


# --- building one from a study ---------------------------------------------------------------------------------

def table_from_study(study_path: str | Path, latency_table: str | Path | None = None) -> dict[str, Any]:
    """The table of a finished ``parnas study``: every retrained layout at the searches' depth, each retrain seed's val
    ppl, the costs of ``latency_table`` (default: the study's); ConfigError for a study it cannot use. Reads only."""
    from parnas import architecture
    from parnas.config import load_config
    from parnas.training.latency_table import load_table_for, table_key

    path = Path(study_path)
    study = read_json_file(path, "STUDY_JSON", "a study.json")
    if not isinstance(study, dict) or study.get("format") != "parnas.study" or not isinstance(study.get("rows"), list):
        raise ConfigError(f"{path} is not the study.json `parnas study` writes")
    if len(study.get("candidate_sets") or ()) > 1:
        raise ConfigError(f"{path} searched {len(study['candidate_sets'])} candidate sets; a table holds one space")
    cfg = load_config(study.get("config"), study.get("overrides") or [])
    candidates = tuple((study.get("candidate_sets") or [cfg.search.candidates])[0])
    records = sorted(path.parent.glob("search/*/architecture.json"))
    if not records:
        raise ConfigError(f"no search/*/architecture.json beside {path}: the vocabulary is read there")
    record = architecture.read(records[0])
    vocab = record.get("tokenizer") or {}
    source = latency_table or ((study.get("timing") or {}).get("priced_by") or {}).get("table")
    if source is None:
        raise ConfigError(f"{path} was timed on its own machine, not priced by a latency table: give "
                          "--latency-table FILE (`parnas latency` with the study's config)")
    import torch

    key = table_key(cfg, record["model"]["vocab_size"], sorted({*candidates, "attention", "dense", "identity"}),
                    torch.device("cpu"))
    latency = load_table_for(source, key, setting="--latency-table", target=cfg.search.latency_target)
    layouts = _study_layouts(study["rows"], candidates, cfg.model.n_blocks)
    if len(layouts) < 3:
        raise ConfigError(f"{path} retrained {len(layouts)} layouts of its space; a table needs 3")
    config = config_section(cfg, study.get("config"), study.get("overrides") or [], vocab,
                            retrain_steps=study.get("retrain_steps"), retrain_seeds=study.get("retrain_seeds"))
    return table_record(path.parent.name, candidates, cfg, config, latency.to_dict(),
                        {k: v["val_ppl_seeds"] for k, v in layouts.items()},
                        roles={k: v["roles"] for k, v in layouts.items()},
                        commit=study.get("commit") or _commit(), rebuild=rebuild_command(study, path, latency_table))


def table_record(name: str, candidates: Sequence[str], cfg: Config, config: Mapping[str, Any],
                 latency_table: Mapping[str, Any], seeds: Mapping[str, Sequence[float | None]], *,
                 roles: Mapping[str, Sequence[str]] | None = None, commit: str = "unknown",
                 rebuild: str = "") -> dict[str, Any]:
    """A table as JSON (the module docstring's format): each layout's spread and the noise ceiling computed from
    ``seeds`` (layout letters -> each retrain seed's val ppl); the space's depth and memory are ``cfg``'s."""
    layouts = {k: {"val_ppl_seeds": list(v), "val_ppl_std": seed_spread(v), "roles": list((roles or {}).get(k, ()))}
               for k, v in seeds.items()}
    return {"format": FORMAT, "version": VERSION, "name": name,
            "space": {"candidates": list(candidates), "n_blocks": cfg.model.n_blocks}, "config": dict(config),
            "commit": commit, "memory": {"mem_len": cfg.model.mem_len, "eval_mem_len": cfg.model.eval_mem_len,
                                         "evaluation_memory": cfg.model.evaluation_memory},
            "latency_table": dict(latency_table), "layouts": layouts, "noise_ceiling": noise_ceiling(seeds),
            "rebuild": rebuild}


def _study_layouts(rows: Sequence[Mapping[str, Any]], candidates: Sequence[str],
                   n_blocks: int) -> dict[str, dict[str, Any]]:
    by_letter = {kinds.letter(k): k for k in kinds.names()}
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        code = str(row.get("layout") or "")
        if "-d" in code or len(code) > n_blocks or not set(code) <= set(by_letter):
            continue  # a width-scaled front point, or deeper than the searches
        padded = [by_letter[c] for c in code] + ["identity"] * (n_blocks - len(code))
        if not set(padded) <= set(candidates):
            continue
        key = "".join(kinds.letter(k) for k in padded)
        values = row.get("val_ppl_seeds") or [row.get("val_ppl")]
        if key in out:
            out[key]["roles"] = sorted({*out[key]["roles"], row.get("role")})
            continue
        if all(v is None for v in values):
            continue
        out[key] = {"val_ppl_seeds": list(values), "roles": [row.get("role")]}
    return out


def config_section(cfg: Config, preset: str | None, overrides: Sequence[str], vocab: Mapping[str, Any],
                   **extra: Any) -> dict[str, Any]:
    """A table's ``config``: the preset and overrides the layouts were retrained with, what a scored run must share
    with them (the model settings, the segment length, the vocabulary), and ``extra`` (e.g. retrain steps)."""
    return {"preset": preset, "overrides": list(overrides), **extra, "seg_len": cfg.data.seg_len,
            "model": _plain(cfg.model.to_dict()), "vocab": dict(vocab)}


def _plain(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _plain(v) if isinstance(v, Mapping) else list(v) if isinstance(v, tuple) else v
            for k, v in values.items()}


def _commit() -> str:
    """The commit of the checkout converting the table (the study does not record its own), or ``unknown``."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def rebuild_command(study: Mapping[str, Any], path: Path, latency_table: str | Path | None = None) -> str:
    """The commands that rebuild the table: the latency table that priced it (with the study's model, data and thread
    settings, which change what it prices), the study with the settings that chose its layouts, and the conversion."""
    overrides = list(study.get("overrides") or [])
    config = [f"--config {study['config']}"] if study.get("config") else []
    census = study.get("census")
    latency = [o.split("=", 1)[1] for o in overrides if o.startswith("search.latency_table=")]
    latency += [str(latency_table)] if latency_table is not None else []
    priced_by = ("model.", "data.", "train.threads=", "search.candidates=")
    timing = [" ".join(["parnas latency", *config,
                        *(f"--set {shlex.quote(o)}" for o in overrides if o.startswith(priced_by)),
                        f"--out {shlex.quote(latency[-1])} --refresh"])] if latency else []
    budgets = ",".join(str(b) for b in study.get("budgets") or ["none"])
    parts = ["parnas study", *config, *(f"--set {shlex.quote(o)}" for o in overrides),
             f"--seeds {study.get('seeds') or 1},{study.get('retrain_seeds') or 1} --budgets {budgets}",
             *([f"--steps {study.get('search_steps') or ''},{study.get('retrain_steps') or ''}"]
               if study.get("search_steps") or study.get("retrain_steps") else []),
             f"--random-orderings {study.get('random_orderings', 3)}",
             *([f"--space {census['networks']}"] if census else
               ["--space all"] if any(r.get("role") == "space" for r in study.get("rows") or []) else []),
             f"--out {path.parent}"]
    convert = f"parnas table build {path} --table TABLE.json" + (
        f" --latency-table {shlex.quote(str(latency_table))}" if latency_table is not None else "")
    return " && ".join([*timing, " ".join(parts), convert])
