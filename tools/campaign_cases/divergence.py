"""Divergence, as a user with too high a learning rate meets it: a run whose loss explodes (finite or not) is a
result, not a crash. train and retrain end with one line naming the step and ``train.lr`` (exit status 2) and
still write ``metrics.json``, strict JSON marked ``diverged``; ``--resume`` and ``evaluate`` of that run say the
same line; a diverged search exports nothing and leaves a run that ``--resume`` takes up (or nothing at all).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tools.campaign_cases.bench import Bad, Bench, Case, last_words, one_line, sets

# search.penalty_cost=flops: no latency table timed (a loaded machine's timing warns on stderr)
RUN = ["train.max_steps=6", "train.eval_every=2", "train.log_every=2", "train.ckpt_every=2", "search.log_every=2",
       "search.penalty_cost=flops"]
EXPLODES = ["train.lr=30", "train.warmup_steps=0"]  # the loss stays finite, about 1e5 nats
UNCLIPPED = ["train.lr=3", "train.clip=0", "train.warmup_steps=0", "train.max_steps=20", "train.eval_every=20"]
OUT_KEY = {"train": "train.out_dir", "retrain": "train.out_dir", "search": "search.out_dir"}
HEAD = {"train": ["train"], "retrain": ["retrain", "--arch", "transformer-xl"], "search": ["search"]}


def run_args(bench: Bench, command: str, out: Path, *extra: str) -> list[str]:
    return [*HEAD[command], "--config", "tiny", *bench.micro_sets(), *sets(*RUN, *extra, f"{OUT_KEY[command]}={out}")]


def diverged_line(done: Any, lr: str) -> str:
    """The one line of a diverged run: exit 2, the step, train.lr and the advice."""
    line = one_line(done, 2)
    for words in ("training diverged at step ", f"train.lr={lr}", "lower train.lr"):
        if words not in line:
            raise Bad(f"the line lacks {words!r}: {last_words(line, 120)}")
    return line


def strict_json(path: Path) -> dict[str, Any]:
    """``path`` read as JSON readers other than Python's read it (no NaN, no Infinity)."""
    if not path.is_file():
        raise Bad(f"no {path.name} written")

    def refuse(name: str) -> None:
        raise Bad(f"{path.name} holds {name}, which is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def marked(path: Path, line: str) -> dict[str, Any]:
    """``path`` marked diverged, at the step the line names."""
    record = strict_json(path)
    if record.get("diverged") is not True:
        raise Bad(f"{path.name} is not marked diverged: {record.get('diverged')!r}")
    step = record.get("diverged_step", record.get("step"))
    if f"at step {step} " not in line:
        raise Bad(f"{path.name} says step {step}, the line another: {last_words(line, 90)}")
    return record


def said(line: str) -> str:
    """The head of a diverged run's line, for the case's report: the command and the step."""
    return line.split(" (")[0]


def trained(what: str, command: str, *extra: str, lr: str = "30") -> Case:
    name = f"diverged: {' '.join(HEAD[command])} {what}"

    def check(bench: Bench, folder: Path) -> str:
        out = folder / "run"
        line = diverged_line(bench.cli(run_args(bench, command, out, *extra), folder), lr)
        marked(out / "metrics.json", line)
        return f"exit 2, '{said(line)}'; metrics.json marked diverged"
    return Case(name, check)


def diverged_run(bench: Bench) -> tuple[Path, str]:
    """A train that diverged (made once) and its line."""
    def make() -> tuple[Path, str]:
        out = bench.root / "reference" / "diverged-train"
        line = diverged_line(bench.cli(run_args(bench, "train", out, *EXPLODES), bench.root), "30")
        return out, line
    return bench.once("diverged-train", make)


def resumed(bench: Bench, folder: Path) -> str:
    source, line = diverged_run(bench)
    out = folder / "run"
    shutil.copytree(source, out)
    again = diverged_line(bench.cli([*run_args(bench, "train", out, *EXPLODES), "--resume"], folder), "30")
    if again.split(": error: ")[-1] != line.split(": error: ")[-1]:
        raise Bad(f"--resume says another line: {last_words(again, 90)}")
    marked(out / "metrics.json", again)
    return "--resume: exit 2, the same line; metrics.json marked diverged"


def evaluated(bench: Bench, folder: Path) -> str:
    source, line = diverged_run(bench)
    report = folder / "eval.json"
    done = bench.cli(["evaluate", str(source / "checkpoints" / "last.ckpt"), "--out", str(report)],
                     folder)
    answer = diverged_line(done, "30")
    if said(answer).split(": error: ")[-1] != said(line).split(": error: ")[-1]:
        raise Bad(f"evaluate names another step than the run: {last_words(answer, 90)}")
    if strict_json(report).get("diverged") is not True:
        raise Bad("evaluate's file is not marked diverged")
    return "evaluate: exit 2, the run's step; its file marked diverged"


def searched(bench: Bench, folder: Path) -> str:
    out = folder / "search"
    args = run_args(bench, "search", out, *EXPLODES)
    line = diverged_line(bench.cli(args, folder), "30")
    if (out / "architecture.json").exists():
        raise Bad("a diverged search exported an architecture")
    if not (out / "checkpoints" / "last.ckpt").is_file():
        left = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
        if left:
            raise Bad(f"neither a resumable run nor nothing: {', '.join(left)}")
        return f"exit 2, '{said(line)}'; nothing left"
    again = diverged_line(bench.cli([*args, "--resume"], folder), "30")
    if (out / "architecture.json").exists():
        raise Bad("the resumed diverged search exported an architecture")
    return f"exit 2, '{said(line)}'; --resume: {'the same line' if again == line else said(again)}"


def cases() -> list[Case]:
    return [
        trained("with train.lr=30", "train", *EXPLODES),
        trained("with train.lr=3 and no clipping", "train", *UNCLIPPED, lr="3"),
        trained("with train.lr=30", "retrain", *EXPLODES),
        Case("diverged: --resume of a diverged train", resumed),
        Case("diverged: evaluate of a diverged train", evaluated),
        Case("diverged: search with train.lr=30", searched),
    ]
