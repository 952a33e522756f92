"""Input built to hurt, and what a careless moment deals: YAML whose aliases expand without end, keys given twice,
a huge value in an error message, paths that read as YAML, a cached latency table with impossible costs, a closed
terminal's SIGHUP, a burst of signals, an unusable cache folder or output path, a process that may not allocate
what its run needs, a pickle that would run code. A refusal is one line, exit 2, nothing written; a run stopped
by a signal says so in one line and goes on from its line's command; a path is used as it was given.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tools.campaign_cases import faults
from tools.campaign_cases.bench import (
    CLI,
    Bad,
    Bench,
    Case,
    Skip,
    last_words,
    one_line,
    refused,
    sets,
    snapshot,
    succeeded,
    written,
)
from tools.campaign_cases.refusals import MICRO, TINY, record, retrain, search, train

LONG = "y" * 300  # longer than any file system's 255-byte names


def laughs(levels: int, item: str = '"lol"') -> str:
    """A flow list of anchors, each nine aliases of the one before: ``9**levels`` items written in a few hundred
    bytes (YAML's "billion laughs")."""
    rows = [f"&a0 [{', '.join([item] * 9)}]"] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "[" + ", ".join(rows) + "]"


def config(text: str) -> dict[str, str]:
    return {"c.yaml": text}


def yaml_cases() -> list[Case]:
    """Aliases counted before anything is built (their values and their nesting), and a key given twice."""
    cfg = ["train", "--config", "{in}/c.yaml", *sets("train.out_dir={out}")]
    deep = "[" * 40 + "1" + "]" * 40
    return [
        refused("yaml: a billion laughs under data.path", cfg, "{in}/c.yaml", "repeat more than 100,000 values",
                files=config(f"data:\n  path: {laughs(9)}\n"), quick=True),
        refused("yaml: a billion laughs of mappings under model.cutoffs", cfg, "repeat more than 100,000 values",
                files=config(f"model:\n  cutoffs: {laughs(8, '{a: 1, b: 2}')}\n")),
        refused("yaml: a billion laughs through merge keys", cfg, "repeat more than 100,000 values",
                files=config("x: &m0 {a: 1, b: 2, c: 3}\n" + "".join(
                    f"x{i}: &m{i} [{', '.join([f'*m{i - 1}'] * 9)}]\n" for i in range(1, 8)) +
                    "train:\n  <<: {k: *m7}\n")),
        refused("yaml: a billion laughs in a --set value", train(f"data.path={laughs(8)}"), "--set data.path",
                "repeat more than 100,000 values", quick=True),
        refused("yaml: a billion laughs in an NNI experiment config", ["launch", "--config", "{in}/c.yaml",
                                                                        "--port", "18996"],
                "repeat more than 100,000 values", files=config(
                    "trialCommand: x\ntrialConcurrency: 1\nsearchSpace: {}\ntuner: {name: Random}\n"
                    f"trainingService:\n  platform: local\n  gpuIndices: {laughs(8)}\n")),
        refused("yaml: an alias inside its own anchor", cfg, "once its aliases (*name) are expanded",
                files=config("data:\n  path: &x [*x]\n")),
        refused("yaml: a mapping that holds itself", cfg, "once its aliases (*name) are expanded",
                files=config("model: &x {blocks: *x}\n")),
        refused("yaml: 70 levels deep once expanded", cfg, "once its aliases (*name) are expanded",
                files=config(f"a: &d {deep}\ndata:\n  path: {'[' * 30}*d{']' * 30}\n")),
        refused("yaml: a second train: section", cfg, "key 'train' is given twice", "lines 1 and 5",
                files=config("train:\n  max_steps: 3\nmodel:\n  d_model: 64\ntrain:\n  max_steps: 5\n"), quick=True),
        refused("yaml: a key given twice in a section", cfg, "key 'max_steps' is given twice", "lines 2 and 4",
                files=config("train:\n  max_steps: 3\n  lr: 0.1\n  max_steps: 5\n")),
        refused("yaml: a key given twice, once quoted", cfg, "key 'd_model' is given twice",
                files=config('model:\n  d_model: 64\n  "d_model": 128\n')),
        refused("yaml: a key given twice in a flow mapping", train("model={d_model: 64, d_model: 128}"),
                "--set model", "key 'd_model' is given twice"),
        refused("yaml: a key given twice in an NNI experiment config", ["launch", "--config", "{in}/c.yaml",
                                                                         "--port", "18995"],
                "key 'trainingService' is given twice", files=config(
                    "trialCommand: x\ntrialConcurrency: 1\nsearchSpace: {}\ntuner: {name: Random}\n"
                    "trainingService: {platform: local}\ntrainingService: {platform: remote}\n")),
    ]


def json_cases() -> list[Case]:
    arch = ["retrain", "--arch", "{in}/arch.json", *TINY, *sets("train.out_dir={out}")]

    def twice(make: Any, key: str) -> Any:  # the record's text with ``key`` written a second time, on its own line
        def text(bench: Bench) -> str:
            body = make(bench)
            value = json.dumps(json.loads(body)[key])
            return body[:-1] + f',\n "{key}": {value}' + "}"
        return text

    table = json.dumps({"format": "parnas.latency", "version": 2}).replace("}", ',\n "version": 2}')
    return [
        refused("json: a key given twice in an architecture file", arch, "key 'model' is given twice in one object",
                files={"arch.json": twice(record(), "model")}),
        refused("json: a key given twice, escaped the second time", arch, "key 'format' is given twice",
                files={"arch.json": lambda b: record()(b)[:-1] + ', "\\u0066ormat": "x"}'}),
        refused("json: a key given twice in a latency table", search(*MICRO, "search.latency_table={in}/t.json"),
                "search.latency_table", "key 'version' is given twice", files={"t.json": table}),
        metrics_twice(),
    ]


def metrics_twice() -> Case:
    """``compare`` of a run folder whose metrics.json gives a key twice."""
    inner = refused("json: a key given twice in a run's metrics", ["compare", "{in}/run", "--out", "{out}/t"],
                    "metrics.json", "key 'val_ppl' is given twice in one object (lines 1 and 2)")

    def check(bench: Bench, folder: Path) -> str:
        run = folder / "in" / "run"
        run.mkdir(parents=True, exist_ok=True)
        (run / "metrics.json").write_text('{"val_ppl": 3.0,\n "val_ppl": 2.0}')
        return inner.check(bench, folder)
    return Case(inner.name, check)


def bounded(name: str, args: list[str], needle: str, limit: int = 300) -> Case:
    """A refusal whose line quotes the bad value by its start only, however large the value."""
    def check(bench: Bench, folder: Path) -> str:
        line = one_line(bench.cli([a.replace("{out}", str(folder / "out")) for a in args], folder), 2)
        if needle not in line:
            raise Bad(f"exit 2, but its line lacks {needle!r}: {last_words(line)}")
        if len(line) > limit:
            raise Bad(f"exit 2, but its line is {len(line):,} characters long: {line[:120]}...")
        return f"exit 2, {len(line)} characters: {line[:100]}..."
    return Case(name, check)


def message_cases() -> list[Case]:
    return [
        bounded("message: a 30,000-item list for a number", train("train.max_steps=[" + "1, " * 10_000 + "1]"),
                "train.max_steps must be int, got [1, 1,"),
        bounded("message: a 100 kB word for a number", train("train.max_steps=" + "x" * 100_000),
                "train.max_steps must be int, got 'xxx"),
        bounded("message: 59,049 laughs for a path", train(f"data.path={laughs(5)}"), "data.path must be str"),
        bounded("message: a 100 kB key", train("train." + "k" * 100_000 + "=1"), "unknown config key train.kkk",
                limit=600),  # and the section's known keys
        bounded("message: a 100 kB --set without a value", ["train", *TINY, "--set", "k" * 100_000],
                "--set expects key=value"),
    ]


def as_given(out: str) -> Case:
    """``retrain --out OUT`` writes its run in the folder named exactly OUT (relative to where it runs)."""
    def check(bench: Bench, folder: Path) -> str:
        done = bench.cli(["retrain", "--arch", "transformer-xl", *TINY, *bench.micro_sets(),
                          *sets("train.max_steps=2", "train.eval_every=2"), "--out", out], folder)
        succeeded(done, f"retrain --out {out!r}")
        if not (folder / out / "metrics.json").is_file():
            made = sorted(str(p.relative_to(folder)) for p in folder.iterdir())
            raise Bad(f"--out {out!r} wrote no {out}/metrics.json; the folder holds {made}")
        return f"--out {out!r}: its metrics.json is in {out!r}"
    return Case(f"path: retrain --out {out!r} is a folder of that name", check)


# --- a cached latency table with impossible costs ------------------------------------------------------------

def cached_table(where: tuple[str, ...], cost: Any, said: str) -> Case:
    """A table in the cache, steady and at the run's shapes, but with ``cost`` at ``where``: ``parnas latency``
    must not use it, must say so in one line, remove it and time the table again."""
    def check(bench: Bench, folder: Path) -> str:
        cache = folder / "cache"
        latency = ["latency", *TINY, *bench.micro_sets()]
        made = bench.cli([*latency, "--out", str(folder / "first.json")], folder, {"PARNAS_CACHE_DIR": str(cache)})
        succeeded(made, "the first timing")
        table = json.loads((folder / "first.json").read_text())
        table["timing"].update(load=0.0, threads=1, cores=max(2, table["timing"]["cores"]))
        table["timing"]["spread"] = {m: dict.fromkeys(v, 0.01) for m, v in table["timing"]["spread"].items()}
        node = table
        for key in where[:-1]:
            node = node[key]
        node[where[-1]] = cost
        for old in (cache / "latency").glob("*.json"):
            old.unlink()
        poisoned = cache / "latency" / "poisoned.json"
        poisoned.parent.mkdir(parents=True, exist_ok=True)
        poisoned.write_text(json.dumps(table))
        done = bench.cli([*latency, "--out", str(folder / "again.json")], folder, {"PARNAS_CACHE_DIR": str(cache)})
        succeeded(done, "the second timing")
        lines = [line for line in done.stderr.splitlines() if "cached latency table" in line]
        if len(lines) != 1 or said not in lines[0] or "not used" not in lines[0]:
            raise Bad(f"no one line saying the cached table is not used ({said}): {last_words(done.stderr)}")
        again = json.loads((folder / "again.json").read_text())
        costs = [*again["constant_ms"].values(), *(v for k in again["kinds_ms"].values() for v in k.values())]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in costs):
            raise Bad(f"the table written holds costs {costs}: the cached one was used")
        if poisoned.exists():
            raise Bad("the poisoned table is still in the cache")
        return f"timed again: {lines[0][:140]}"
    return Case(f"latency: a cached table with {said}", check)


def latency_cases() -> list[Case]:
    return [
        cached_table(("kinds_ms", "dense", "train"), math.nan, "a train cost of nan ms"),
        cached_table(("kinds_ms", "attention", "inference"), -1.0, "an inference cost of -1.0 ms"),
        cached_table(("kinds_ms", "attention", "generate"), 0.0, "a generate cost of 0.0 ms"),
        cached_table(("constant_ms", "train"), math.inf, "a train constant of inf ms"),
        cached_table(("kinds_ms", "dense", "train"), "fast", "costs that are not numbers"),
    ]


# --- signals ---------------------------------------------------------------------------------------------------

def burst(command: str, signums: list[int]) -> Case:
    """Several signals at once (a held Ctrl-C, a scheduler's SIGTERM then SIGHUP): the process ends with a line,
    never in silence or a traceback, and its command, run again (with --resume where it saved), finishes."""
    names = "+".join(signal.Signals(s).name for s in signums)

    def check(bench: Bench, folder: Path) -> str:
        out = folder / "run"
        args = faults.run_args(bench, command, out)
        proc = bench.start(args, folder, folder / "stderr.txt")
        try:
            for line in proc.stdout:
                if line.startswith("step 5/"):
                    for signum in signums:
                        proc.send_signal(signum)
                        time.sleep(0.002)
                    break
            proc.communicate(timeout=900)
        finally:
            proc.kill()
            proc.wait()
        err = (folder / "stderr.txt").read_text().strip()
        if "Traceback" in err or not err or not err.splitlines()[-1].startswith("parnas"):
            raise Bad(f"exit {proc.returncode}: it ended without its line: {last_words(err) or 'nothing said'}")
        if proc.returncode not in {code for s in signums for code in (128 + s, -s)}:
            raise Bad(f"exit {proc.returncode}: {last_words(err)}")
        resume = (out / "checkpoints" / "last.ckpt").exists()
        succeeded(bench.cli([*args, *(["--resume"] if resume else [])], folder), "the run after the burst")
        return f"exit {proc.returncode}, '{err.splitlines()[-1][:90]}'; {'resumed' if resume else 'run again'}"
    return Case(f"signal: a burst of {names} to a {command}", check)


def signal_cases() -> list[Case]:
    hup = signal.SIGHUP
    cases = [faults.interrupted(command, hup, "step") for command in faults.HEAD]
    cases += [faults.interrupted("train", hup, "time"), faults.interrupted("retrain", hup, "end")]
    cases += [burst("train", [signal.SIGINT] * 3), burst("search", [signal.SIGINT] * 5),
              burst("retrain", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])]
    return cases


# --- the cache folder, output paths, memory, pickles ------------------------------------------------------------

def cache_cases() -> list[Case]:
    run = train(*MICRO)
    cases = [
        refused("cache: PARNAS_CACHE_DIR a file", run, "PARNAS_CACHE_DIR={in}/f is not a folder",
                env={"PARNAS_CACHE_DIR": "{in}/f"}, files={"f": "x"}, quick=True),
        refused("cache: PARNAS_CACHE_DIR /dev/null", run, "PARNAS_CACHE_DIR=/dev/null is not a folder",
                env={"PARNAS_CACHE_DIR": "/dev/null"}),
        refused("cache: PARNAS_CACHE_DIR under a file", run, "is under {in}/f, which is not a folder",
                env={"PARNAS_CACHE_DIR": "{in}/f/cache"}, files={"f": "x"}),
        refused("cache: PARNAS_CACHE_DIR a name too long", run, "too long",
                env={"PARNAS_CACHE_DIR": "{in}/" + LONG}),
    ]
    read_only = refused("cache: PARNAS_CACHE_DIR a read-only empty folder", run, "this user may not write",
                        env={"PARNAS_CACHE_DIR": "{in}/ro"})

    def check(bench: Bench, folder: Path) -> str:
        if os.geteuid() == 0:
            raise Skip("root writes any folder")
        (folder / "in" / "ro").mkdir(parents=True, exist_ok=True)
        (folder / "in" / "ro").chmod(0o555)
        return read_only.check(bench, folder)
    return [*cases, Case(read_only.name, check)]


def output_cases() -> list[Case]:
    study = ["study", *TINY, "--seeds", "1", "--steps", "2"]
    file = {"f": "a file"}
    return [
        refused("output: study --out under a file", [*study, "--out", "{in}/f/x"], "{in}/f", files=file,
                quick=True),
        refused("output: study --out a name too long", [*study, "--out", "{in}/" + LONG], "too long"),
        refused("output: train into a name too long", train() + sets(f"train.out_dir={{in}}/{LONG}"),
                "too long"),
        refused("output: retrain --out under a file", retrain("transformer-xl") + ["--out", "{in}/f/run"], "{in}/f",
                files=file),
        refused("output: search into a name too long", ["search", *TINY, *sets(f"search.out_dir={{in}}/{LONG}/run")],
                "too long"),
        refused("output: evaluate --out a name too long",  # a checkpoint that exists: its reading comes later
                ["evaluate", "{in}/last.ckpt", "--out", "{in}/" + LONG + "/e.json"],
                "too long", files={"last.ckpt": b"not a checkpoint"}),
        refused("output: latency --out under a file", ["latency", *TINY, "--out", "{in}/f/t.json"], "{in}/f",
                files=file),
    ]


def baseline_vm(bench: Bench) -> int:
    """The address space (kB) a train maps once its libraries are loaded, before it allocates anything."""
    def make() -> int:
        code = "import parnas.training.fit; print(open('/proc/self/status').read().split('VmSize:')[1].split()[0])"
        done = subprocess.run([sys.executable, "-c", code], env=bench.env, capture_output=True, text=True,
                              timeout=300, cwd=bench.root)
        succeeded(done, "measuring the libraries' address space")
        return int(done.stdout.strip())
    return bench.once("baseline_vm", make)


MODELS = {  # two runs whose estimate fits RAM: one mostly weights, one mostly activations (a lower bound there)
    "weights": ["data.batch_size=8", "data.seg_len=64", "model.mem_len=64", "model.d_model=768", "model.d_ff=3072",
                "model.n_heads=4", "train.max_steps=2"],
    "activations": ["data.batch_size=16", "data.seg_len=256", "model.mem_len=256", "model.d_model=256",
                    "model.d_ff=1024", "train.max_steps=2", "train.log_every=1"],
}


def limited(extra_mb: int, model: str) -> Case:
    """Under ``ulimit -v`` (the libraries' address space + ``extra_mb``) a run whose estimate fits RAM: it trains,
    or it is refused in one line naming memory, never a traceback. Refused before training, it writes nothing;
    an allocation that fails once training has begun (the estimate is a lower bound) may leave the run's
    ``tensorboard/``, which the verdict names."""
    def check(bench: Bench, folder: Path) -> str:
        if not Path("/proc/self/status").exists():
            raise Skip("no /proc here")
        kb = baseline_vm(bench) + extra_mb * 1024
        args = ["train", *TINY, *bench.micro_sets(), *sets(*MODELS[model], f"train.out_dir={folder / 'out'}")]
        before = snapshot(folder)
        done = subprocess.run(["bash", "-c", f"ulimit -v {kb} && exec {shlex.join([*CLI, *args])}"], cwd=folder,
                              env=bench.env, capture_output=True, text=True, timeout=900)
        if done.returncode == 0:
            return f"ulimit -v {kb:,} kB: it fit and trained"
        line = one_line(done, 2)
        if "memory" not in line:
            raise Bad(f"exit 2, but its line says nothing of memory: {line}")
        left = written(before, folder)
        began = "while training" in line
        if left and not began:
            raise Bad(f"refused before training, but it left {', '.join(left[:4])}: {line[:160]}")
        return f"ulimit -v {kb:,} kB: {line[:150]}{f' (it had begun: left {left[0]}/)' if left else ''}"
    return Case(f"memory: a train of {model} under ulimit -v the libraries + {extra_mb} MB", check)


def evil_pickle(protocol: int, target: str) -> bytes:
    """A pickle whose loading would run ``target`` (a module.function), with the given protocol."""
    module, name = target.rsplit(".", 1)
    call = pickle.GLOBAL + f"{module}\n{name}\n".encode() + pickle.MARK + pickle.UNICODE + b"touch pwned\n" + \
        pickle.TUPLE + pickle.REDUCE
    body = pickle.EMPTY_DICT + pickle.UNICODE + b"state_dict\n" + call + pickle.SETITEM + pickle.STOP
    return (pickle.PROTO + bytes([protocol]) if protocol >= 2 else b"") + body


def pickle_cases() -> list[Case]:
    cases = []
    for command, protocol, target in [("evaluate", 4, "os.system"), ("evaluate", 5, "builtins.eval"),
                                      ("generate", 3, "subprocess.Popen"), ("evaluate", 0, "os.system")]:
        cases.append(refused(f"pickle: protocol {protocol} calling {target}, to {command}",
                             [command, "{in}/last.ckpt",
                              *(["--out", "{out}/e.json"] if command == "evaluate" else [])], "refused unread",
                             files={"last.ckpt": evil_pickle(protocol, target)}))
    return cases


def cases() -> list[Case]:
    return [*yaml_cases(), *json_cases(), *message_cases(),
            *(as_given(out) for out in ("exp #2", "yes", "null", "off", "~", "a: b", "!!int 3")),
            *latency_cases(), *signal_cases(), *cache_cases(), *output_cases(),
            *(limited(mb, "weights") for mb in (64, 160, 320, 480, 560, 640, 800)),
            *(limited(mb, "activations") for mb in (160, 320, 640, 1200)), *pickle_cases()]

