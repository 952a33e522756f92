"""``parnas search``, ``latency``, ``export`` and ``launch`` (registered by parnas.cli)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def cmd_search(args: argparse.Namespace) -> int:
    """Search an architecture with ``search.strategy`` (the registry's; PAR's Gumbel-DARTS unless set) and write
    architecture.json (inside nnictl: a trial, with the tuner's parameters)."""
    from parnas import reading, strategy_registry
    from parnas.config import load_config
    from parnas.overrides import as_given
    from parnas.strategies.nni_trial import in_nni_trial, trial_parameters
    from parnas.strategies.search_folder import run_dir_of, take_search_dir

    if args.strategy is not None:
        if not args.strategy.strip():  # never read as "no --strategy", the default search
            from parnas.errors import ParnasError

            raise ParnasError(f"--strategy {args.strategy!r} names no strategy: leave it out for "
                              f"{strategy_registry.DEFAULT}, or name one (parnas search --help lists them)")
        args.set = [*args.set, as_given("search.strategy", args.strategy)]  # the name as given, as a string
    trial = in_nni_trial()
    params = trial_parameters()  # {} outside nnictl: the config is read and checked before torch or NNI loads
    cfg = load_config(args.config, args.set, extra=params)  # once, for the whole command
    strategy = strategy_registry.get(cfg.search.strategy)
    strategy.check_config(cfg, args.resume)  # a dry run refuses what the search refuses
    select = getattr(cfg.search.settings, "select", None)  # the final pick, where the strategy has one
    beyond = select and select.beyond(cfg.train.max_steps, f"search.{cfg.search.strategy}.select.steps")
    if beyond:
        print(f"parnas search: note: {beyond}", file=sys.stderr, flush=True)
    if cfg.search.latency_table is not None:  # a FIFO would block its open while the run's folder is held
        reading.check_regular(cfg.search.latency_table, f"search.latency_table: {cfg.search.latency_table}")
    if args.dry_run:
        from parnas.strategies.pricing import dry_run_budget
        from parnas.strategies.search_folder import check_search_dir
        from parnas.training.dry_run import dry_run

        check_search_dir(run_dir_of(cfg), args.resume)  # the folder the search would take, as it checks it
        report, budget = dry_run(cfg, [list(cfg.search.candidates)] * cfg.model.n_blocks, "search (the supernet)"), \
            dry_run_budget(cfg)
        if budget is not None:  # before the report's last line, "dry run: nothing read, allocated or written"
            body, last = report.rsplit("\n", 1)
            report = f"{body}\n{budget}\n{last}"
        print(report)
        return 0
    run_dir = run_dir_of(cfg)  # an nnictl trial's own, else search.out_dir
    with take_search_dir(run_dir, args.resume):  # held and checked once, for the search's life
        from parnas.threads import use_threads

        use_threads(cfg.model.d_model, cfg.data.step_tokens, cfg.train.threads, cfg.train.devices)
        if trial:  # a resume outside nnictl needs what the trial got from NNI (parnas.cli.resume_command)
            args.resume_sets = [*(f"{k}={json.dumps(v)}" for k, v in params.items()),
                                as_given("search.out_dir", str(run_dir))]
        record = strategy.runner()(cfg, resume=args.resume)
    if record:
        from parnas.report.summaries import search_summary

        print(search_summary(record))
    return 0


def cmd_latency(args: argparse.Namespace) -> int:
    """Time what each block kind costs on this machine and write the table as JSON: per train step, per inference
    segment and per generated token (the three values of search.latency_target; --target times fewer).

    The table is the one a search with the same --config/--set would time (its shapes and candidates; the
    cache's, unless --refresh). Only a table timed steadily on a machine that left it its cores is cached; each
    says when, where, how steadily and under what load it was timed. --check times it again and says how far the
    cache is off. Pass it to a search on any machine with --set search.latency_table=PATH: the
    search is then priced on this machine's device (e.g. time on the GPU, search on a laptop).
    """
    from parnas.config import TARGET_LABELS, load_config
    from parnas.errors import ParnasError
    from parnas.files import check_file_folder, write_json_atomic
    from parnas.training.latency_table import MODES, check_targets

    asked = [t.strip() for given in args.target or [] for t in given.split(",")]
    targets = check_targets(asked) if args.target else MODES  # before any model is built
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
        check_file_folder(out)
    from parnas.threads import use_threads

    use_threads(cfg.model.d_model, cfg.data.step_tokens, cfg.train.threads, cfg.train.devices)
    if args.check:
        from parnas.strategies.pricing import check_latency_table

        for line in check_latency_table(cfg):
            print(line)
        return 0
    from parnas.strategies.pricing import time_latency_table
    from parnas.training.latency_cache import describe

    table = time_latency_table(cfg, refresh=args.refresh, targets=targets)
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
    from parnas.report.experiments import launch, working_root
    from parnas.strategies.experiment_budget import check_experiment_budgets, share_with_trials

    if args.listen_all:
        print(f"parnas launch: --listen-all: anyone who reaches port {args.port} of this machine can read and stop "
              "the experiment (NNI's web UI and REST API have no login)", file=sys.stderr)
    checked = check_experiment_budgets(Path(args.config)) if Path(args.config).is_file() else None  # else launch says
    if checked:
        print(checked.line, flush=True)
    experiment = launch(args.config, args.port, listen_all=args.listen_all)
    share_with_trials(checked, working_root(Path(args.config)) / experiment)
    print(f"experiment {experiment}: web UI http://127.0.0.1:{args.port}; stop it with `nnictl stop {experiment}`; "
          f"gather its architectures with `parnas export --experiment {experiment}`", flush=True)
    return wait_for(experiment, args.config, args.port) if args.wait else 0


def wait_for(experiment: str, config: str, port: int) -> int:
    """``launch --wait``: the trials' progress until NNI says the experiment is done, then the export table and
    the next command; Ctrl-C stops the experiment (``nnictl stop``) and says so."""
    import subprocess

    from parnas.report.experiment_summary import summary_block
    from parnas.report.experiments import experiment_trials
    from parnas.report.follow import Follower, experiment_size, follow
    from parnas.strategies import experiment_export

    trials, steps, preset, root, pick = experiment_size(config)
    count = "all its trials" if trials is None else f"{trials} trial{'s' * (trials != 1)}"
    print(f"following it here until it is done ({count}; Ctrl-C stops the experiment)", flush=True)
    try:
        follow(Follower(experiment, port, trials, steps, root=root, pick_steps=pick),
               out=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        nnictl = os.path.join(os.path.dirname(sys.executable), "nnictl")
        nnictl = nnictl if os.path.exists(nnictl) else "nnictl"
        done = subprocess.run([nnictl, "stop", experiment], capture_output=True, text=True)
        state = "stopped" if done.returncode == 0 else f"could not be stopped (`nnictl stop {experiment}`)"
        print(f"parnas launch: interrupted: experiment {experiment} {state}; the finished trials' architectures: "
              f"parnas export --experiment {experiment}", file=sys.stderr)
        return 130
    rows = experiment_export.export_experiment(experiment, root=root)
    if not rows:
        print(experiment_export.nothing_finished(experiment, root))
        return 1
    print(experiment_export.table(rows))
    print()
    print(summary_block(experiment, experiment_trials(experiment, root), preset))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    from parnas import strategy_registry
    from parnas.arguments import add_command, add_config_args, add_dry_run, add_resume

    p = add_command(sub, "search", cmd_search, "parnas search --config wt2-cpu")
    add_config_args(p)
    add_dry_run(p)
    p.add_argument("--strategy", default=None, metavar="NAME",
                   help=f"a registered search strategy: {', '.join(strategy_registry.names())} (default "
                        f"{strategy_registry.DEFAULT}; same as --set search.strategy=NAME); its own settings are "
                        "--set search.NAME.SETTING=VALUE")
    add_resume(p)
    p = add_command(sub, "latency", cmd_latency, "parnas latency --config wt2-cpu --out runs/wt2-cpu-table.json")
    add_config_args(p)
    p.add_argument("--out", default=None, help="the table's JSON file, for --set search.latency_table=... (default: "
                   "only this machine's cache)")
    p.add_argument("--refresh", action="store_true", help="time again even if this machine's cache has the table, "
                   "and replace it there (when timed steadily)")
    p.add_argument("--check", action="store_true", help="time the table again and say how far this machine's "
                   "cached one is off (writes nothing)")
    p.add_argument("--target", action="append", metavar="TARGET[,TARGET]",
                   help="time only these latency targets: train, inference, generate (repeatable; default all three; "
                        "a search times only its search.latency_target)")
    p = add_command(sub, "launch", cmd_launch, "parnas launch --config search.yaml --wait")
    p.add_argument("--config", default="search.yaml", help="NNI experiment config (default search.yaml)")
    p.add_argument("--port", type=int, default=8080, help="web UI port (default 8080)")
    p.add_argument("--wait", action="store_true", help="stay and show the trials' progress (trial k of n, the step, "
                   "the time left) until the experiment is done, then the export table; Ctrl-C stops the experiment")
    p.add_argument("--listen-all", action="store_true",
                   help="serve NNI's web UI and REST API on every interface, not 127.0.0.1 only: anyone who reaches "
                        "the port can read and stop the experiment (needed for trials on other machines)")
    p = add_command(sub, "export", cmd_export, "parnas export --experiment Ab12Cd34 --out found/")
    p.add_argument("--experiment", required=True, help="nnictl experiment id")
    p.add_argument("--out", default=None,
                   help="folder to copy each trial's architecture.json and a summary into (default: copy nothing)")
    p.add_argument("--experiments-dir", default=None,
                   help="NNI's experimentWorkingDirectory (default: ~/nni-experiments)")
    p.add_argument("--json", action="store_true", help="print every field of every trial as JSON instead of a table")
