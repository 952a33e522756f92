"""``parnas search`` and ``parnas export`` (registered by parnas.cli)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def cmd_search(args: argparse.Namespace) -> int:
    """Search an architecture with ``search.strategy`` (the registry's; PAR's Gumbel-DARTS unless set) and write
    architecture.json (inside nnictl: a trial)."""
    from parnas import strategy_registry
    from parnas.config import load_config
    from parnas.files import check_not_held, check_writable_dir, hold_run_dir

    if args.strategy is not None:
        if not args.strategy.strip():  # never read as "no --strategy", the default search
            from parnas.errors import ParnasError

            raise ParnasError(f"--strategy {args.strategy!r} names no strategy: leave it out for par-gumbel-darts, "
                              "or name one (parnas search --help lists them)")
        args.set = [*args.set, f"search.strategy={json.dumps(args.strategy)}"]  # the name as given, as a string
    if args.dry_run:
        from parnas.training.dry_run import dry_run

        cfg = load_config(args.config, args.set)
        print(dry_run(cfg, [list(cfg.search.candidates)] * cfg.model.n_blocks, "search (the supernet)"))
        return 0
    if "NNI_PLATFORM" not in os.environ:  # no tuner parameters to wait for: check the config before torch/NNI load
        early = load_config(args.config, args.set)
        strategy_registry.get(early.search.strategy).check_config(early, args.resume)
        check_writable_dir(early.search.out_dir)
        check_not_held(early.search.out_dir)
    # the run directory (parnas.strategies.search.run_dir_of): an nnictl trial's own, else search.out_dir
    trial_dir = os.environ.get("NNI_OUTPUT_DIR") if "NNI_PLATFORM" in os.environ else None
    with hold_run_dir(trial_dir or load_config(args.config, args.set).search.out_dir):  # for the search's life
        return _search(args)


def _search(args: argparse.Namespace) -> int:
    from parnas.strategies.nni_trial import in_nni_trial, trial_parameters

    from parnas import strategy_registry
    from parnas.config import load_config
    from parnas.threads import use_threads

    params = trial_parameters()
    cfg = load_config(args.config, args.set, extra=params)
    use_threads(cfg.model.d_model, cfg.data.step_tokens, cfg.train.threads, cfg.train.devices)
    if in_nni_trial():  # a resume outside nnictl needs what the trial got from NNI (parnas.cli.resume_command)
        args.resume_sets = [*(f"{k}={json.dumps(v)}" for k, v in params.items()),
                            f"search.out_dir={os.environ['NNI_OUTPUT_DIR']}"]
    strategy = strategy_registry.get(cfg.search.strategy)
    strategy.check_config(cfg, args.resume)
    record = strategy.runner()(cfg, resume=args.resume)
    if record:
        from parnas.report.summaries import search_summary

        print(search_summary(record))
    return 0


def cmd_latency(args: argparse.Namespace) -> int:
    """Time what each block kind costs on this machine and write the table as JSON: per train step, per inference
    segment and per generated token (the three values of search.latency_target).

    The table is the one a search with the same --config/--set would time (its shapes and candidates; the
    cache's, unless --refresh). Only a table timed steadily on a machine that left it its cores is cached; each
    says when, where, how steadily and under what load it was timed. --check times it again and says how far the
    cache is off. Pass it to a search on any machine with --set search.latency_table=PATH: the
    search is then priced on this machine's device (e.g. time on the GPU, search on a laptop).
    """
    from pathlib import Path

    from parnas.config import TARGET_LABELS, load_config
    from parnas.errors import ParnasError
    from parnas.files import check_writable_dir, write_json_atomic

    cfg = load_config(args.config, args.set)
    out = Path(args.out) if args.out else None
    if args.check and (out or args.refresh):
        raise ParnasError("--check compares the cache with a timing taken now and writes nothing: drop --out and "
                          "--refresh (or --check)")
    if not args.check and out is None:
        raise ParnasError("give --out FILE, the table's JSON file (or --check to compare the cache with a timing now)")
    if out is not None and out.is_dir():
        raise ParnasError(f"--out {out} is a folder: name the table's file, e.g. {out / 'latency.json'}")
    if out is not None:
        check_writable_dir(out.parent)
    from parnas.threads import use_threads

    use_threads(cfg.model.d_model, cfg.data.step_tokens, cfg.train.threads, cfg.train.devices)
    if args.check:
        from parnas.strategies.pricing import check_latency_table

        for line in check_latency_table(cfg):
            print(line)
        return 0
    from parnas.strategies.pricing import time_latency_table

    from parnas.training.latency_cache import describe

    table = time_latency_table(cfg, refresh=args.refresh)
    write_json_atomic(out, table.to_dict())
    key, evaluated = table.key, table.key["model"].get("eval_mem_len")
    memory = "" if evaluated is None else f" (inference and generation at M{evaluated})"
    print(f"wrote {out}: {key['device']} ({key['precision']}), B{key['batch_size']} L{key['seg_len']} "
          f"M{key['model']['mem_len']}{memory}, vocabulary {key['vocab_size']}; {describe(table)}")
    for target in table.modes:
        costs = ", ".join(f"{k} {table.block_ms(k, target):.3f}" for k in key["kinds"] if k != "identity")
        print(f"  {TARGET_LABELS[target]}: {table.constant_ms[target]:.3f} ms constant + per block {costs} ms")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Gather an nnictl experiment's architectures: a table, best val ppl of the exported architecture first.

    Columns: trial; val ppl of the exported (argmax) architecture with the supernet's weights, not retrained;
    the supernet's val ppl; the architecture, one letter per block (A = attention, D = dense, I = identity);
    its predicted train step relative to Transformer-XL's (search.latency.ratio), or its cost; each block's
    margin (top - second probability) and the undecided blocks (margin < 0.1, also warned about on stderr).
    --json prints every field instead; --out copies each trial's architecture.json and a summary.json.
    """
    from parnas.strategies import experiment_export

    rows = experiment_export.export_experiment(args.experiment, args.out, root=args.experiments_dir)
    for line in experiment_export.warnings(rows):
        print(f"parnas export: warning: {line}", file=sys.stderr)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
    elif rows:
        print(experiment_export.table(rows))
    if not rows:
        print(experiment_export.nothing_finished(args.experiment, args.experiments_dir),
              file=sys.stderr if args.json else None)
    elif args.out:
        print(f"wrote {len(rows)} architecture file(s) and summary.json to {args.out}", file=sys.stderr)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    """Start the NNI experiment (nnictl create) after checking the port and the set-up; its web UI and REST API
    listen on 127.0.0.1 only unless --listen-all."""
    from parnas.report.experiments import launch

    if args.listen_all:
        print(f"parnas launch: --listen-all: anyone who reaches port {args.port} of this machine can read and stop "
              "the experiment (NNI's web UI and REST API have no login)", file=sys.stderr)
    experiment = launch(args.config, args.port, listen_all=args.listen_all)
    print(f"experiment {experiment}: web UI http://127.0.0.1:{args.port}; stop it with `nnictl stop {experiment}`; "
          f"gather its architectures with `parnas export --experiment {experiment}`")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    from parnas import strategy_registry
    from parnas.arguments import add_command, add_config_args, add_dry_run, add_resume

    p = add_command(sub, "search", cmd_search)
    add_config_args(p)
    add_dry_run(p)
    p.add_argument("--strategy", default=None, metavar="NAME",
                   help=f"a registered search strategy: {', '.join(strategy_registry.names())} (default "
                        f"{strategy_registry.DEFAULT}; same as --set search.strategy=NAME)")
    add_resume(p, "<run dir>")
    p = add_command(sub, "latency", cmd_latency)
    add_config_args(p)
    p.add_argument("--out", default=None, help="the table's JSON file (for --set search.latency_table=...)")
    p.add_argument("--refresh", action="store_true", help="time again even if this machine's cache has the table, "
                   "and replace it there (when timed steadily)")
    p.add_argument("--check", action="store_true", help="time the table again and say how far this machine's "
                   "cached one is off (writes nothing)")
    p = add_command(sub, "launch", cmd_launch)
    p.add_argument("--config", default="search.yaml", help="NNI experiment config (default search.yaml)")
    p.add_argument("--port", type=int, default=8080, help="web UI port (default 8080)")
    p.add_argument("--listen-all", action="store_true",
                   help="serve NNI's web UI and REST API on every interface, not 127.0.0.1 only: anyone who reaches "
                        "the port can read and stop the experiment (needed for trials on other machines)")
    p = add_command(sub, "export", cmd_export)
    p.add_argument("--experiment", required=True, help="nnictl experiment id")
    p.add_argument("--out", default=None, help="folder to copy each trial's architecture.json and a summary into")
    p.add_argument("--experiments-dir", default=None, help="NNI's experimentWorkingDirectory (~/nni-experiments)")
    p.add_argument("--json", action="store_true", help="print every field of every trial as JSON instead of a table")
