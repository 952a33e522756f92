"""Bad input, as a hostile user gives it: each case must exit 2 with one line on stderr that names what is wrong
(its needles), no traceback, and nothing written (:func:`tools.campaign_cases.bench.refused`)."""

from __future__ import annotations

import json
from typing import Any

from tools.campaign_cases.bench import Bench, Case, refused, sets

DEEP = "[" * 5 * 2**20  # 5 MB of "[": Python's parsers would recurse until RecursionError
NESTED = "[" * 10_000 + "]" * 10_000  # small, but nested far deeper than any parnas file
BINARY = bytes(range(256)) * 4
TINY = ["--config", "tiny"]
MICRO = ["data.path={micro}", "data.tokenizer=char", "model.cutoffs=[20, 40]"]


def train(*pairs: str) -> list[str]:
    return ["train", *TINY, *sets(*pairs, "train.out_dir={out}")]


def search(*pairs: str) -> list[str]:
    return ["search", *TINY, *sets(*pairs, "search.out_dir={out}")]


def retrain(arch: str, *pairs: str) -> list[str]:
    return ["retrain", "--arch", arch, *TINY, *sets(*pairs, "train.out_dir={out}")]


def record(edit: Any = None) -> Any:
    """An architecture file (tiny Transformer-XL, as a search writes one), changed by ``edit(record)``."""
    def make(bench: Bench) -> str:
        from parnas.architecture import named_layout
        from parnas.config import load_config

        r = named_layout("transformer-xl", load_config("tiny").model, 1000)
        if edit is not None:
            edit(r)
        return json.dumps(r)
    return make


def table(where: tuple[str, ...], cost: float) -> str:
    """A latency table as ``parnas latency`` writes one, with the cost at ``where`` replaced."""
    modes = ("train", "inference", "generate")
    t = {"format": "parnas.latency", "version": 2, "n_reference": 4, "timing": None,
         "key": {"device": "cpu", "device_type": "cpu", "model": {}, "kinds": ["attention", "dense", "identity"]},
         "constant_ms": {m: 5.0 for m in modes},
         "kinds_ms": {"attention": {m: 3.0 for m in modes}, "dense": {m: 1.0 for m in modes},
                      "identity": {m: 0.0 for m in modes}}}
    node = t
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = cost
    return json.dumps(t)  # NaN and Infinity as Python's json writes them


def settings_cases() -> list[Case]:
    c = [
        refused("config: an unknown key", train("train.max_step=5"), "unknown config key train.max_step", quick=True),
        refused("config: an unknown section", train("trian.max_steps=5"), "unknown config key trian"),
        refused("config: a word for a number", train("train.max_steps=ten"), "train.max_steps", quick=True),
        refused("config: negative steps", train("train.max_steps=-5"), "train.max_steps"),
        refused("config: zero steps", train("train.max_steps=0"), "train.max_steps"),
        refused("config: lr NaN", train("train.lr=.nan"), "train.lr must be a finite number", quick=True),
        refused("config: lr infinite", train("train.lr=.inf"), "train.lr must be a finite number"),
        refused("config: negative lr", train("train.lr=-0.1"), "train.lr"),
        refused("config: negative weight decay", train("train.weight_decay=-1"), "train.weight_decay"),
        refused("config: unknown precision", train("train.precision=bogus"), "train.precision"),
        refused("config: a TPU", train("train.accelerator=tpu"), "train.accelerator"),
        refused("config: 3 processes for a batch of 8", train("train.devices=3"), "divisible by the 3 processes"),
        refused("config: unknown compile mode", train("train.compile=cudagraphs"), "train.compile must be one of"),
        refused("config: unknown attention kernel", train("model.attention_kernel=flash"), "model.attention_kernel"),
        refused("config: width not divisible by heads", train("model.d_model=33"), "model.d_model"),
        refused("config: no heads", train("model.n_heads=0"), "model.n_heads"),
        refused("config: dropout above 1", train("model.dropout=1.5"), "model.dropout"),
        refused("config: dropout NaN", train("model.dropout=.nan"), "model.dropout must be a finite number"),
        refused("config: negative clamp", train("model.clamp_len=-4"), "model.clamp_len must be >= 0"),
        refused("config: empty batches", train("data.batch_size=0"), "data.batch_size"),
        refused("config: empty segments", train("data.seg_len=0"), "data.seg_len"),
        refused("config: cutoffs out of order", train("model.cutoffs=[400, 100]"), "model.cutoffs"),
        refused("config: a vocabulary of one", train("data.vocab_size=1"), "set a larger data.vocab_size"),
        refused("config: negative warm-up", train("train.warmup_steps=-1"), "train.warmup_steps"),
        refused("config: an unknown block kind", train("model.blocks=[attention, warp, attention, dense]"), "warp"),
        refused("config: a --set without a value", ["train", *TINY, "--set", "train.max_steps"], "train.max_steps"),
        refused("config: a --set value nested too deep", train(f"model.cutoffs={NESTED}"),
                "--set model.cutoffs", "more than 64 levels deep"),
        refused("config: an unknown preset", ["train", "--config", "tinyy", *sets("train.out_dir={out}")], "tinyy"),
        refused("config: an empty file", ["train", "--config", "{in}/c.yaml"], "empty config", files={"c.yaml": ""}),
        refused("config: a file nested too deep", ["train", "--config", "{in}/c.yaml"], "more than 64 levels deep",
                files={"c.yaml": "model:\n  blocks: " + NESTED + "\n"}),
        refused("config: a 5 MB file", ["train", "--config", "{in}/c.yaml"], "MiB, above the 4 MiB",
                files={"c.yaml": DEEP}),
        refused("config: a list, not a mapping", ["train", "--config", "{in}/c.yaml"], "c.yaml",
                files={"c.yaml": "[1, 2]\n"}),
        refused("config: a binary file", ["train", "--config", "{in}/c.yaml"], "c.yaml", files={"c.yaml": BINARY}),
        refused("config: a model too large for this machine", train(*MICRO, "model.d_model=100000000000"),
                "training needs", "this machine has"),
        refused("config: segments longer than the data", train(*MICRO, "data.seg_len=100000"), "too short"),
        refused("search: compiling a sampled supernet",
                search("train.compile=default", "search.par-gumbel-darts.forward=sampled"),
                "search.par-gumbel-darts.forward to gumbel or fair", "train.compile=none"),
        refused("search: tau infinite", search("search.par-gumbel-darts.tau_start=.inf"),
                "search.par-gumbel-darts.tau_start must be a finite number"),
        refused("search: an unknown latency target", search("search.latency_target=decode"),
                "search.latency_target must be one of"),
        refused("search: an unknown candidate kind", search("search.candidates=[attention, dense, warp]"), "warp"),
    ]
    for command in ("train", "search", "retrain"):
        args = retrain("transformer-xl", "model.eval_mem_len=-1") if command == "retrain" else \
            {"train": train, "search": search}[command]("model.eval_mem_len=-1")
        c.append(refused(f"config: {command} with model.eval_mem_len=-1", args, "model.eval_mem_len must be >= 0"))
    return c


def kind_cases() -> list[Case]:
    """The kinds' own settings, the new kinds' first: each checked alone and against the run's shapes."""
    def blocks(kind: str, *pairs: str) -> list[str]:
        return train(f"model.blocks=[{kind}, dense, attention, dense]", *pairs)

    return [
        refused("kind: a removed share", blocks("attention_half", "model.attention_half.fraction=0.3"),
                "model.attention_half.fraction was removed"),
        refused("kind: attention_quarter of 2 heads", blocks("attention_quarter"),
                "attention_quarter keeps 0.25 of model.n_heads (2): 0.5 heads"),
        refused("kind: moe with no experts", blocks("moe", "model.moe.n_experts=0"), "model.moe.n_experts must be >= 1",
                quick=True),
        refused("kind: moe top_k above its experts", blocks("moe", "model.moe.top_k=5"),
                "model.moe.top_k must be in [1, n_experts=4], got 5"),
        refused("kind: moe top_k 0", blocks("moe", "model.moe.top_k=0"), "model.moe.top_k"),
        refused("kind: moe capacity 0", blocks("moe", "model.moe.capacity_factor=0"), "capacity_factor must be > 0"),
        refused("kind: moe negative aux weight", blocks("moe", "model.moe.aux_weight=-1"), "aux_weight must be >= 0"),
        refused("kind: moe given a number", blocks("moe", "model.moe=3"), "model.moe must be a mapping"),
        refused("kind: moe unknown setting", blocks("moe", "model.moe.experts=8"),
                "unknown config key model.moe.experts"),
        refused("kind: settings for a kind that has none", train("model.dense.ratio=2"),
                "the dense kind has no settings"),
        refused("kind: odd lsh buckets", blocks("lsh", "model.lsh.n_buckets=3"), "n_buckets must be even"),
        refused("kind: conv kernel 0", blocks("conv", "model.conv.kernel=0"), "kernel must be > 0"),
        refused("kind: ut with no steps", blocks("ut", "model.ut.max_steps=0"), "max_steps must be >= 1"),
        refused("kind: compressive unknown fn", blocks("compressive", "model.compressive.fn=median"), "fn must be"),
        refused("kind: search over attention_quarter of 2 heads",
                search("search.candidates=[attention_quarter, dense, identity]"), "attention_quarter keeps 0.25"),
        refused("kind: moe under reversible pairs", blocks("moe", "model.reversible=true"), "moe"),
    ]


def file_cases() -> list[Case]:
    """Architecture files and latency tables: damaged, huge, nested, or claiming what cannot be."""
    arch = ["retrain", "--arch", "{in}/arch.json", *TINY, *sets("train.out_dir={out}")]
    lat = search(*MICRO, "search.latency_table={in}/t.json")
    c = [
        refused("arch: truncated", arch, "is not JSON (Unterminated string starting at: line 1, column",
                files={"arch.json": lambda b: record()(b)[:40]}),
        refused("arch: binary", arch, "not JSON", files={"arch.json": BINARY}),
        refused("arch: 5 MB of [", arch, "MiB, above the 4 MiB", files={"arch.json": DEEP}),
        refused("arch: nested 10,000 deep", arch, "more than 64 levels deep", files={"arch.json": NESTED}),
        refused("arch: a kind this version lacks", arch, "block_1", "warp",
                files={"arch.json": record(lambda r: r["architecture"].update(block_1="warp"))}),
        refused("arch: another format", arch, "format is", files={"arch.json": record(lambda r: r.update(format="x"))}),
        refused("arch: a newer version", arch, "version 99 is not supported",
                files={"arch.json": record(lambda r: r.update(version=99))}),
        refused("arch: labels with a gap", arch, "block labels",
                files={"arch.json": record(lambda r: r["architecture"].update(block_9=r["architecture"].pop("block_3")))
                       }),
        refused("arch: a list", arch, "must be a JSON object", files={"arch.json": "[1, 2, 3]"}),
        refused("arch: a width that is a word", arch, "d_model",
                files={"arch.json": record(lambda r: r["model"].update(d_model="wide"))}),
        refused("arch: absent", retrain("{in}/absent.json"), "absent.json"),
        refused("arch: an unknown layout name", retrain("transformer-xxl"), "transformer-xxl"),
        refused("latency: absent table", lat, "cannot read"),
        refused("latency: a log, not a table", lat, "is not a parnas latency table (not JSON)",
                files={"t.json": "step 1/60, train loss 8.6\n"}),
        refused("latency: nested too deep", lat, "more than 64 levels deep",
                files={"t.json": '{"format": "parnas.latency", "key": ' + NESTED + "}"}),
    ]
    for name, where, cost, needle in [
            ("a negative cost", ("kinds_ms", "dense", "train"), -1.0, "block kind 'dense' a train cost of -1.0 ms"),
            ("a free attention", ("kinds_ms", "attention", "generate"), 0.0, "'attention' a generate cost of 0.0 ms"),
            ("a NaN cost", ("kinds_ms", "dense", "inference"), float("nan"), "an inference cost of nan ms"),
            ("an infinite identity", ("kinds_ms", "identity", "train"), float("inf"), "a train cost of inf ms"),
            ("a zero constant", ("constant_ms", "train"), 0.0, "a train constant of 0.0 ms"),
            ("a negative constant", ("constant_ms", "inference"), -3.0, "an inference constant of -3.0 ms")]:
        c.append(refused(f"latency: {name}", lat, needle, "parnas latency", files={"t.json": table(where, cost)}))
    c.append(refused("latency: a table and FLOPs both", search("search.latency_table={in}/t.json",
                                                               "search.penalty_cost=flops"),
                     "search.penalty_cost=latency", files={"t.json": table(("n_reference",), 4)}))
    return c


def command_cases() -> list[Case]:
    study = ["study", *TINY, "--out", "{out}", "--seeds", "1", "--steps", "2"]
    ckpt, binary = ["{in}/last.ckpt"], {"last.ckpt": BINARY}  # binary: a checkpoint that exists, unreadable
    return [
        refused("search: an empty strategy", search() + ["--strategy", ""], "names no strategy", quick=True),
        refused("search: a blank strategy", search() + ["--strategy", " \t"], "names no strategy"),
        refused("search: an unknown strategy", search() + ["--strategy", "bogus"], "unknown search strategy 'bogus'"),
        refused("study: a census far above the space", study + ["--space", "100000"], "--space 100,000"),
        refused("study: a space neither all nor a count", study + ["--space", "every"],
                "--space must be all or a number of networks", quick=True),
        refused("study: a census of 0", study + ["--space", "0"], "--space must be >= 1"),
        refused("study: every network of 12 blocks", study + ["--space", "all", *sets("model.n_blocks=12")],
                "at most 1000 are retrained"),
        # an argument's check, given a checkpoint that exists (its reading comes later): the run folder is checked
        # before anything else and would answer first
        refused("generate: a trillion tokens", ["generate", *ckpt, "--tokens", "1000000000000"],
                "above the 100,000 one run samples at most", files=binary),
        refused("generate: zero tokens", ["generate", *ckpt, "--tokens", "0"], "--tokens", files=binary),
        refused("generate: temperature NaN", ["generate", *ckpt, "--temperature", "nan"], "--temperature",
                files=binary),
        refused("generate: an absent checkpoint", ["generate", *ckpt], "last.ckpt"),
        refused("generate: a checkpoint of random bytes", ["generate", *ckpt], "last.ckpt", files=binary),
        refused("evaluate: a text file as checkpoint", ["evaluate", *ckpt, "--out", "{out}/e.json"], "last.ckpt",
                files={"last.ckpt": "not a checkpoint\n"}),
        refused("evaluate: negative memory", ["evaluate", *ckpt, "--mem-len", "-1"], "--mem-len", files=binary),
        refused("data: PARNAS_DATA_DIR missing", train(), "is not a folder",
                env={"PARNAS_DATA_DIR": "{in}/no-such-folder"}),
        refused("data: PARNAS_DATA_DIR a file", train(), "PARNAS_DATA_DIR", env={"PARNAS_DATA_DIR": "{in}/f.txt"},
                files={"f.txt": "x"}),
        refused("resume: nothing to resume", train() + ["--resume"], "nothing to resume"),
        refused("resume: an absent checkpoint", train() + ["--resume={in}/old.ckpt"], "nothing to resume"),
        refused("output: a file as the run folder", ["train", *TINY, *sets("train.out_dir={in}/f/run")],
                "{in}/f", files={"f": "a file"}),
        refused("output: under /proc", ["train", *TINY, *sets("train.out_dir=/proc/parnas-campaign/run")],
                "/proc/parnas-campaign"),
        refused("launch: an absent experiment file", ["launch", "--config", "{in}/none.yaml", "--port", "18999"],
                "none.yaml"),
        refused("launch: remote trials on loopback", ["launch", "--config", "{in}/r.yaml", "--port", "18998"],
                "--listen-all", files={"r.yaml": "trialCommand: x\ntrialConcurrency: 1\nsearchSpace: {}\n"
                                                 "tuner: {name: Random}\ntrainingService: {platform: remote, "
                                                 "machineList: []}\n"}),
        refused("launch: port 70000", ["launch", "--config", "{in}/e.yaml", "--port", "70000"],
                "port 70000 is not a TCP port", files={"e.yaml": "trialCommand: x\ntrialConcurrency: 1\n"
                                                                "searchSpace: {}\ntuner: {name: Random}\n"
                                                                "trainingService: {platform: local}\n"}),
        refused("export: an unknown experiment", ["export", "--experiment", "nosuch1", "--experiments-dir", "{in}"],
                "nosuch1"),
        refused("latency: a folder as output", ["latency", *TINY, *sets(*MICRO), "--out", "{in}"], "is a folder"),
        refused("compare: a folder without metrics", ["compare", "{in}", "--out", "{out}/t"], "metrics.json"),
        refused("arguments: an unknown option", ["train", "--bogus"], "--bogus", quick=True),
    ]


def cases() -> list[Case]:
    return [*settings_cases(), *kind_cases(), *file_cases(), *command_cases()]
