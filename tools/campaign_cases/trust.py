"""What a command may trust, and what it may touch: it removes only what it made (a failed launch, while another
process makes folders beside it), writes through no link (planted at any sub-folder a run, a study, ``export`` or
``plot`` writes in, or at a file ``export`` copies to), reads no cache entry damaged at the same size (token ids
zeroed or flipped, a vocabulary edited), opens no special file (a FIFO, a socket or a device given as a config,
an architecture, a latency table or a corpus split), takes ids as ids, not paths, ints as ints, and refuses at the
start what the run would fail on later (seeds out of range, weights that are not finite, a pick past the steps).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from tools.campaign_cases.bench import (
    Bad,
    Bench,
    Case,
    last_words,
    one_line,
    refused,
    sets,
    snapshot,
    succeeded,
    written,
)
from tools.campaign_cases.faults import reference, run_args
from tools.campaign_cases.refusals import TINY, record, retrain, search, train

HANG_S = 120  # a command that opened a FIFO would wait for a writer for ever: past this it is BAD, not slow


# --- removal: only what the command made -------------------------------------------------------------------

def failed_launch(bench: Bench, folder: Path) -> str:
    """``parnas launch`` of a config nnictl refuses, while another process keeps making folders in the same
    experiments folder: every one of those is kept, and no ``_latest`` link is left pointing at nothing."""
    root = folder / "W"
    root.mkdir(exist_ok=True)
    (root / "kept_before").mkdir(exist_ok=True)
    config = folder / "c.yaml"
    config.write_text("experimentName: x\ntrialConcurrency: 1\nmaxTrialNumber: 1\ntrialCommand: 'true'\n"
                      f"searchSpaceFile: {folder / 'absent-space.json'}\ntuner: {{name: Random}}\n"
                      f"trainingService: {{platform: local}}\nexperimentWorkingDirectory: {root}\n")
    stop, made = threading.Event(), []

    def other() -> None:  # another user's process, writing beside the launch
        while not stop.is_set():
            run = root / f"new_run_{len(made)}"
            run.mkdir()
            (run / "results.txt").write_text("not the launch's\n")
            made.append(run)
            stop.wait(0.01)

    writer = threading.Thread(target=other, daemon=True)
    writer.start()
    try:
        line = one_line(bench.cli(["launch", "--config", str(config), "--port", str(free_port())], folder,
                                  {"NNI_EXPERIMENTS_DIR": str(root)}, timeout=300), 2)
    finally:
        stop.set()
        writer.join()
    lost = [p.name for p in [root / "kept_before", *made] if not p.is_dir()]
    lost += [p.name for p in made if p.is_dir() and not (p / "results.txt").is_file()]
    if lost:
        raise Bad(f"exit 2, but it removed {len(lost)} of {len(made) + 1} folders it did not make: {lost[:3]}")
    latest = root / "_latest"
    if latest.is_symlink() and not latest.exists():
        raise Bad(f"exit 2, but {latest} is left pointing at nothing")
    return f"exit 2, the {len(made) + 1} folders made beside it kept: {last_words(line, 90)}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- links: never written through ------------------------------------------------------------------------------

def planted_sub(command: str, sub: str, planted: str) -> Case:
    """``<out>/<sub>`` a link to a folder of the user's (or a link to nothing, or a file): refused in one line at
    the start, before a step is trained, and nothing written there or in the link's target."""
    def check(bench: Bench, folder: Path) -> str:
        out, target = folder / "out", folder / "users"
        out.mkdir(exist_ok=True)
        target.mkdir(exist_ok=True)
        place = out / sub
        if planted == "file":
            place.write_text("a file of the user's\n")
        else:
            place.symlink_to(target if planted == "link" else folder / "nowhere", target_is_directory=True)
        args = (["study", *TINY, *bench.micro_sets(), "--out", str(out), "--seeds", "1", "--budgets", "none",
                 "--steps", "4", "--random-orderings", "0"]
                if command == "study" else run_args(bench, command, out))
        done = bench.cli(args, folder, timeout=600)
        line = one_line(done, 2)
        if str(place) not in line:
            raise Bad(f"exit 2, but the line does not name {place}: {line}")
        if any(w.startswith("step ") for w in done.stdout.splitlines()):
            raise Bad(f"exit 2, but only after training: {line}")
        if list(target.iterdir()) or sorted(p.name for p in out.iterdir()) != [sub]:
            raise Bad(f"exit 2, but it wrote {sorted(p.name for p in [*target.iterdir(), *out.iterdir()])}")
        return f"exit 2 at the start: {last_words(line, 100)}"
    return Case(f"links: {command} with a planted {planted} at {sub}/", check,
                quick=(command, sub, planted) == ("train", "checkpoints", "link"))


def fake_experiment(bench: Bench, folder: Path) -> Path:
    """An experiments folder holding experiment ``exp1`` whose trial ``t1`` is a finished search."""
    source, _ = reference(bench, "search")
    root = folder / "experiments"
    trial = root / "exp1" / "environments" / "local-env" / "trials" / "t1"
    if not trial.is_dir():
        shutil.copytree(source, trial)
    return root


def export_through(what: str) -> Case:
    """``parnas export --out O`` where ``O/t1.json`` or ``O/summary.json`` is a link to a file of the user's: the
    link is replaced by the file, its target keeps its bytes; ``O`` itself a link is refused in one line."""
    def check(bench: Bench, folder: Path) -> str:
        root, out, victim = fake_experiment(bench, folder), folder / "O", folder / "victim.txt"
        victim.write_text("a file of the user's\n")
        args = ["export", "--experiment", "exp1", "--experiments-dir", str(root), "--out", str(out)]
        if what == "the folder":
            (folder / "users").mkdir(exist_ok=True)
            out.symlink_to(folder / "users", target_is_directory=True)
            line = one_line(bench.cli(args, folder), 2)
            if "symbolic link" not in line or list((folder / "users").iterdir()):
                raise Bad(f"exit 2, but wrote through the link or did not say so: {line}")
            return f"exit 2: {last_words(line, 100)}"
        out.mkdir(exist_ok=True)
        (out / what).symlink_to(victim)
        succeeded(bench.cli(args, folder), "export")
        if victim.read_text() != "a file of the user's\n":
            raise Bad(f"the link's target was overwritten: {victim.read_text()[:40]!r}")
        if (out / what).is_symlink() or not json.loads((out / what).read_text()):
            raise Bad(f"{what} is still the link, or empty")
        return f"exit 0, {what} replaced, the link's target untouched"
    return Case(f"links: export --out with a link at {what}", check)


# --- caches: verified, not trusted -------------------------------------------------------------------------------

def zero_payload(npy: Path) -> None:
    """Every byte after the .npy header set to 0: the same size, a header that still reads."""
    data = bytearray(npy.read_bytes())
    start = 10 + int.from_bytes(data[8:10], "little") if data[6] == 1 else 12 + int.from_bytes(data[8:12], "little")
    data[start:] = bytes(len(data) - start)
    npy.write_bytes(bytes(data))


def flip_one(npy: Path) -> None:
    data = bytearray(npy.read_bytes())
    data[-3] ^= 0x01
    npy.write_bytes(bytes(data))


def swap_vocabulary(vocab: Path) -> None:
    """Two entries of the vocabulary swapped: the same words, the same size, other ids."""
    lines = vocab.read_text().splitlines(keepends=True)
    lines[-1], lines[-2] = lines[-2], lines[-1]
    vocab.write_text("".join(lines))


def damaged_cache(what: str, damage: Callable[[Path], None], pattern: str) -> Case:
    """A run, the cache entries matching ``pattern`` damaged at the same size, the same run again: one note per
    damaged entry, then the same perplexity as the first run (rebuilt, never used)."""
    def check(bench: Bench, folder: Path) -> str:
        env = {"PARNAS_CACHE_DIR": str(folder / "cache")}
        first, again = folder / "first", folder / "again"
        short = ("train.max_steps=4", "train.eval_every=4")
        succeeded(bench.cli(run_args(bench, "train", first, *short), folder, env), "the first train")
        entries = sorted((folder / "cache").rglob(pattern))
        if not entries:
            raise Bad(f"no cache entry {pattern} after the first run")
        for entry in entries:
            damage(entry)
        done = bench.cli(run_args(bench, "train", again, *short), folder, env)
        succeeded(done, "the second train")
        notes = [line for line in done.stderr.splitlines() if "damaged" in line]
        if len(notes) < 1:
            raise Bad(f"the damaged {what} were used without a word (val ppl "
                      f"{json.loads((again / 'metrics.json').read_text())['val_ppl']})")
        a, b = (json.loads((d / "metrics.json").read_text())["val_ppl"] for d in (first, again))
        if a != b:
            raise Bad(f"a note, but the run differs: val ppl {b} against {a}")
        return f"{len(notes)} note(s), rebuilt: the same val ppl {a:.3f}"
    return Case(f"cache: {what}", check)


# --- special files: refused by what they are, never opened -----------------------------------------------------

def special(kind: str, given: str) -> Case:
    """A FIFO, a socket or a character device given as ``given``: one line naming what it is, fast (a FIFO
    opened would wait for a writer), nothing written, no run folder taken."""
    def check(bench: Bench, folder: Path) -> str:
        inputs = folder / "in"
        inputs.mkdir(exist_ok=True)
        path = inputs / ("train.txt" if given == "a corpus split" else "f.json")
        if given == "a corpus split":
            for split in ("valid", "test"):
                shutil.copy(bench.micro() / f"{split}.txt", inputs / f"{split}.txt")
        if kind == "character device":
            if given == "a corpus split":
                path.symlink_to("/dev/zero")
            else:
                path = Path("/dev/zero")
        elif not os.path.lexists(path):
            if kind == "FIFO":
                os.mkfifo(path)
            else:
                sock = socket.socket(socket.AF_UNIX)
                sock.bind(str(path))
                bench.cleanups.append(sock.close)
        out = f"train.out_dir={folder / 'out'}"
        args = {"a config": ["train", "--config", str(path), *sets(out)],
                "an architecture": ["retrain", "--arch", str(path), *TINY, *sets(out)],
                "a latency table": ["search", *TINY, *sets(f"search.latency_table={path}",
                                                          "search.penalty_cost=latency",
                                                          f"search.out_dir={folder / 'out'}")],
                "a corpus split": ["train", *TINY, *sets(f"data.path={inputs}", "data.tokenizer=char",
                                                        "model.cutoffs=[20, 40]", out)]}[given]
        before = snapshot(folder)
        try:
            line = one_line(bench.cli(args, folder, timeout=HANG_S), 2)
        except subprocess.TimeoutExpired:
            raise Bad(f"still running after {HANG_S} s: it opened the {kind}") from None
        short = {"FIFO": "FIFO", "socket": "socket", "character device": "character device"}[kind]
        if f"is a {short}" not in line:
            raise Bad(f"exit 2, but the line does not say it is a {short}: {line}")
        changed = written(before, folder)
        if changed:
            raise Bad(f"exit 2, but it wrote {', '.join(changed[:4])}")
        return f"exit 2: {last_words(line, 100)}"
    return Case(f"special: a {kind} as {given}", check, quick=(kind, given) == ("FIFO", "a config"))


# --- refused at the start: numbers in range, finite weights, the pick's steps ------------------------------------

def poisoned_checkpoint(bench: Bench, folder: Path) -> Path:
    """The reference train's checkpoint with one weight set to NaN, its digests made again (a run that diverged
    between its checks writes such a file)."""
    source, _ = reference(bench, "train")
    target = folder / "nan.ckpt"
    script = ("import sys, torch\nfrom parnas.training import checkpoint as c\n"
              "ck = c.load(sys.argv[1])\nstate = ck['state_dict']\n"
              "name = next(k for k, t in state.items() if t.is_floating_point())\n"
              "state[name] = state[name].clone(); state[name].view(-1)[0] = float('nan')\n"
              "ck['parnas']['weights_sha256'] = c.weights_digest(state)\nc.save(ck, sys.argv[2])\n")
    done = subprocess.run([sys.executable, "-c", script, str(source / "checkpoints" / "last.ckpt"), str(target)],
                          env=bench.env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise Bad(f"could not make the poisoned checkpoint: {last_words(done.stderr)}")
    return target


def non_finite(command: str) -> Case:
    def check(bench: Bench, folder: Path) -> str:
        ckpt = poisoned_checkpoint(bench, folder)
        args = {"generate": ["generate", str(ckpt), "--tokens", "5"],
                "evaluate": ["evaluate", str(ckpt), "--out", str(folder / "eval.json")]}[command]
        line = one_line(bench.cli(args, folder), 2)
        if "training diverged" not in line:
            raise Bad(f"exit 2, but not the line a diverged run ends with: {line}")
        return f"exit 2: {last_words(line, 100)}"
    return Case(f"weights: {command} from a checkpoint with a NaN weight", check)


def pick_past_steps(steps: str) -> Case:
    def check(bench: Bench, folder: Path) -> str:
        done = bench.cli(["search", "--dry-run", *TINY, *sets("train.max_steps=4",
                                                             f"search.par-gumbel-darts.select.steps={steps}",
                                                             f"search.out_dir={folder / 'out'}")], folder)
        succeeded(done, "the dry run")
        said = [line for line in done.stderr.splitlines() if "go beyond train.max_steps" in line]
        if len(said) != 1:
            raise Bad(f"a pick to {steps} steps after a 4-step search, not said: "
                      f"{last_words(done.stderr) or 'nothing'}")
        return f"said: {last_words(said[0], 100)}"
    return Case(f"settings: search.par-gumbel-darts.select.steps={steps} past train.max_steps=4", check)


def cases() -> list[Case]:
    out = [Case("removal: a failed launch keeps the folders made beside it", failed_launch)]
    out += [planted_sub(command, sub, "link") for command, sub in
            [("train", "checkpoints"), ("train", "tensorboard"), ("retrain", "checkpoints"), ("retrain", "tensorboard"),
             ("search", "checkpoints"), ("search", "tensorboard"), ("search", "select"), ("study", "search"),
             ("study", "retrain")]]
    out += [planted_sub(command, sub, "file") for command, sub in
            [("train", "checkpoints"), ("retrain", "tensorboard"), ("search", "select")]]
    out += [planted_sub("train", "checkpoints", "dangling link")]
    out += [export_through(what) for what in ("t1.json", "summary.json", "the folder")]
    out += [damaged_cache("token ids zeroed after their header", zero_payload, "*.npy"),
            damaged_cache("token ids with one bit flipped", flip_one, "*.npy"),
            damaged_cache("a vocabulary with two entries swapped", swap_vocabulary, "vocab.txt")]
    out += [special(kind, given) for kind in ("FIFO", "socket", "character device")
            for given in ("a config", "an architecture", "a latency table", "a corpus split")]
    out += [refused(f"ids: export --experiment {name!r}", ["export", "--experiment", name, "--experiments-dir",
                                                            "{in}"], "is not an NNI experiment id",
                    quick=name == "../../x") for name in ("../../x", "..", "a/b", "x y")]
    out.append(refused("ids: plot --experiment ../x", ["plot", "--experiment", "../x", "--experiments-dir", "{in}"],
                       "is not an NNI experiment id"))
    out += [refused(f"json: an architecture whose {what}", retrain("{in}/a.json"), needle,
                    files={"a.json": record(edit)}) for what, edit, needle in [
        ("n_blocks is 4.0", lambda r: r["model"].update(n_blocks=4.0), "model.n_blocks must be int"),
        ("n_blocks is true", lambda r: r["model"].update(n_blocks=True), "model.n_blocks must be int"),
        ("version is true", lambda r: r.update(version=True), "version True"),
        ("vocab_size is 1000.0", lambda r: r["model"].update(vocab_size=1000.0), "an integer vocab_size"),
        ("d_model is 64.0", lambda r: r["model"].update(d_model=64.0), "model.d_model must be int"),
        ("mem_len is true", lambda r: r["model"].update(mem_len=True), "model.mem_len must be int")]]
    out += [refused(f"numbers: {' '.join(args[:1])} {pair}", args, needle, quick=pair == "train.seed=-1")
            for args, pair, needle in [
        (train("train.seed=-1"), "train.seed=-1", "train.seed must be in 0..4294967295"),
        (train("train.seed=4294967296"), "train.seed=4294967296", "train.seed must be in 0..4294967295"),
        (search("train.seed=-7"), "train.seed=-7", "train.seed must be in 0..4294967295"),
        (retrain("transformer-xl", "train.seed=1099511627776"), "train.seed=2**40",
         "train.seed must be in 0..4294967295")]]
    out.append(refused("numbers: generate --seed -1", ["generate", "{in}/none.ckpt", "--seed", "-1"],
                       "--seed must be in 0..2**64 - 1", files={"none.ckpt": "not a checkpoint"}))
    out += [non_finite(command) for command in ("generate", "evaluate")]
    out += [pick_past_steps(steps) for steps in ("[1000]", "[2, 8]")]
    return out
