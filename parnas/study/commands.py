"""``parnas study``: search with several seeds and budgets, retrain what was found beside its baselines, compare.

Only argparse is imported here; the handler checks every argument (:func:`parnas.study.plan.make_plan`, light)
before the heavy modules are loaded, so a bad argument costs nothing and writes nothing.
"""

from __future__ import annotations

import argparse


def cmd_study(args: argparse.Namespace) -> int:
    """Check the claim end to end: searches per seed and budget, retrains of found and baseline layouts, timing."""
    if args.to_table or args.score or args.add_seeds:
        return cmd_table(args)
    if args.strategies:
        from pathlib import Path

        from parnas.errors import ConfigError

        for flag, given in (("--every-network", args.every_network), ("--census", args.census)):
            if given:
                raise ConfigError(f"{flag} retrains the space of a PAR search; it cannot be combined with "
                                  "--strategies")

        from parnas.config import load_config
        from parnas.study.strategy_study import parse_strategies, run_strategy_study
        from parnas.threads import use_threads

        cfg = load_config(args.config, args.set)
        # its searches inherit the choice
        use_threads(cfg.model.d_model, cfg.data.step_tokens, cfg.train.threads, cfg.train.devices)
        study = run_strategy_study(args.config, args.set, parse_strategies(args.strategies), args.seeds,
                                   Path(args.out), search_steps=args.search_steps or 600,
                                   retrain_steps=args.retrain_steps or 600, trials=args.trials,
                                   retrain_seeds=args.retrain_seeds, log=lambda line: print(line, flush=True))
        print()
        for line in study["verdicts"]:
            print(line)
        return 0
    from parnas.study.plan import make_plan
    from parnas.study.run import run_study
    from parnas.threads import use_threads

    plan = make_plan(args.config, args.set, args.seeds, args.budgets, args.out, search_steps=args.search_steps,
                     retrain_steps=args.retrain_steps, random_orderings=args.random_orderings, rounds=args.rounds,
                     candidates=args.candidates or (), retrain_seeds=args.retrain_seeds, widths=args.widths,
                     every_network=args.every_network, census=args.census)
    # the study's searches and retrains inherit the choice
    use_threads(plan.base.model.d_model, plan.base.data.step_tokens, plan.base.train.threads)
    study = run_study(plan, log=lambda line: print(line, flush=True))
    print()
    for line in study["verdicts"]:
        print(line)
    return 0


def cmd_table(args: argparse.Namespace) -> int:
    """``--to-table STUDY_JSON --table FILE`` writes a ranking table; ``--score RUN --table FILE`` scores a search;
    ``--add-seeds RUN ... --table FILE`` adds further retrain seeds to a table, in place."""
    from parnas.errors import ConfigError

    given = [flag for flag, value in (("--to-table", args.to_table), ("--score", args.score),
                                      ("--add-seeds", args.add_seeds)) if value]
    if len(given) > 1:
        raise ConfigError(f"give one of --to-table, --score and --add-seeds, not {' and '.join(given)}")
    if not args.table:
        raise ConfigError(f"{given[0]} needs --table FILE")
    if args.add_seeds:
        from parnas.files import write_json_atomic
        from parnas.study.table_seeds import add_seeds

        table, lines = add_seeds(args.table, args.add_seeds)
        write_json_atomic(args.table, table)
        print("\n".join(lines))
        ceiling = table["noise_ceiling"]
        print(f"written {args.table}: {len(lines)} seeds added, noise ceiling "
              f"{'n/a' if ceiling is None else f'{ceiling:.2f}'}")
        return 0
    if args.to_table:
        from pathlib import Path

        from parnas.files import write_json_atomic
        from parnas.study.table import table_from_study

        if Path(args.table).exists():
            raise ConfigError(f"--table {args.table} exists; a table is written once (give a new file)")
        table = table_from_study(args.to_table, args.latency_table)
        write_json_atomic(args.table, table)
        print(f"written {args.table}: {len(table['layouts'])} layouts, noise ceiling {table['noise_ceiling']}")
        return 0
    from parnas.study.score import score
    from parnas.threads import use_threads

    score(args.score, args.table, args.set, log=lambda line: print(line, flush=True),
          before=lambda cfg: use_threads(cfg.model.d_model, cfg.data.step_tokens, cfg.train.threads))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    from parnas import strategy_registry
    from parnas.arguments import add_command, add_config_args

    p = add_command(sub, "study", cmd_study)
    add_config_args(p)
    p.add_argument("--seeds", type=int, default=3, help="searches per budget, with train.seed 0..N-1 (default 3)")
    p.add_argument("--budgets", default="0.65,none", metavar="B,B",
                   help="latency budgets, fractions in (0, 1] of Transformer-XL's step time, or none "
                        "(default 0.65,none)")
    p.add_argument("--out", default="runs/study", help="study directory; a rerun skips finished work (runs/study)")
    p.add_argument("--search-steps", type=int, default=None, metavar="N", help="train.max_steps of each search")
    p.add_argument("--retrain-steps", type=int, default=None, metavar="N", help="train.max_steps of each retrain")
    p.add_argument("--random-orderings", type=int, default=3, metavar="R",
                   help="random orderings of each found architecture's blocks (default 3)")
    p.add_argument("--rounds", type=int, default=5, help="alternating timing rounds per layout (default 5)")
    p.add_argument("--strategies", default=None, metavar="S,S,...",
                   help=f"compare search strategies instead ({', '.join(strategy_registry.names())}) at an equal "
                        "budget of --search-steps (default 600) training steps, retrained for --retrain-steps "
                        "(default 600)")
    p.add_argument("--trials", type=int, default=4, metavar="N",
                   help="with --strategies: trials of a multi-trial strategy, sharing the search steps (default 4)")
    p.add_argument("--retrain-seeds", type=int, default=1, metavar="K",
                   help="retrain every layout K times (train.seed, +1, ...): the verdicts then weigh differences "
                        "against the seed spread (default 1)")
    p.add_argument("--widths", default=None, metavar="D,D,...",
                   help="add the full-depth Transformer-XL at these d_model (d_ff in proportion) to the front the "
                        "found models are judged against, beside the shallower ones (each must divide by the heads)")
    p.add_argument("--every-network", action="store_true",
                   help="also retrain every distinct network the searched space holds (at most 1,000): where the "
                        "found models rank among the networks no costlier, and the network furthest below the "
                        "Transformer-XL front, i.e. the most any search of this space could find")
    p.add_argument("--census", type=int, default=None, metavar="N",
                   help="for a space too large for --every-network: also retrain N distinct networks of it drawn at "
                        "random (train.seed), stratified by predicted cost; the same verdicts, on the sample")
    p.add_argument("--candidates", action="append", metavar="K,K,...",
                   help="a candidate set to search (repeatable: each set gets its own searches, compared at equal "
                        "steps against one Transformer-XL and one timing); default: the config's search.candidates")
    p.add_argument("--to-table", default=None, metavar="STUDY_JSON",
                   help="write the ranking table of a finished study (its study.json) to --table FILE: every "
                        "retrained layout's seeds, costs and noise ceiling")
    p.add_argument("--score", default=None, metavar="RUN",
                   help="score a finished search (its run directory) against the ranking table --table FILE, "
                        "retraining nothing: Kendall/Spearman, top-5 overlap, regret at budgets 0.5, 0.65, 0.8")
    p.add_argument("--add-seeds", nargs="+", default=None, metavar="RUN",
                   help="add finished `parnas train` runs of a table's layouts (same model, vocabulary and retrain "
                        "steps; train.seed one the table lacks) to --table FILE as further retrain seeds, in place")
    p.add_argument("--table", default=None, metavar="FILE",
                   help="the ranking table --to-table writes, --score reads, --add-seeds extends")
    p.add_argument("--latency-table", default=None, metavar="FILE",
                   help="with --to-table: the latency table that prices the layouts (default: the study's own)")
