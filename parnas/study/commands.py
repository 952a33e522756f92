"""``parnas study``, ``parnas strategies`` and ``parnas table build|score|add-seeds``. Only argparse is imported
here: the handler checks every argument (:func:`parnas.study.plan.make_plan`, light) before the heavy modules load,
so a bad argument costs nothing and writes nothing.
"""

from __future__ import annotations

import argparse


def cmd_study(args: argparse.Namespace) -> int:
    """Check the claim that the search finds a model faster than Transformer-XL at the same perplexity: searches
    per seed and budget, retrains of the found and baseline layouts side by side, timing, and verdicts."""
    from parnas.study.plan import make_plan
    from parnas.study.run import run_study
    from parnas.threads import use_threads

    (seeds, retrain_seeds), (search_steps, retrain_steps) = args.seeds, args.steps
    plan = make_plan(args.config, args.set, seeds, args.budgets, args.out, search_steps=search_steps,
                     retrain_steps=retrain_steps, random_orderings=args.random_orderings,
                     candidates=args.candidates or (), retrain_seeds=retrain_seeds, widths=args.widths,
                     space=args.space)
    # the study's searches and retrains inherit the choice
    use_threads(plan.base.model.d_model, plan.base.data.step_tokens, plan.base.train.threads)
    study = run_study(plan, log=lambda line: print(line, flush=True))
    print("", *study["verdicts"], sep="\n")
    return 0


def cmd_strategies(args: argparse.Namespace) -> int:
    """Compare search strategies (PAR's Gumbel-DARTS against NNI's own) at an equal budget of training steps, no
    latency budget: each searches per seed, what each finds is retrained, and the verdict says whether PAR's
    strategy beats the best of the others beyond the spread."""
    from pathlib import Path

    from parnas.config import load_config
    from parnas.study.strategy_study import parse_strategies, run_strategy_study
    from parnas.threads import use_threads

    strategies = parse_strategies(args.strategies)
    cfg = load_config(args.config, args.set)
    use_threads(cfg.model.d_model, cfg.data.step_tokens, cfg.train.threads, cfg.train.devices)  # its searches' too
    (seeds, retrain_seeds), steps = args.seeds, [n or cfg.train.max_steps for n in args.steps]
    study = run_strategy_study(args.config, args.set, strategies, seeds, Path(args.out), search_steps=steps[0],
                               retrain_steps=steps[1], trials=args.trials, retrain_seeds=retrain_seeds,
                               log=lambda line: print(line, flush=True))
    print("", *study["verdicts"], sep="\n")
    return 0


def cmd_table_build(args: argparse.Namespace) -> int:
    """Write the ranking table of a finished study (its study.json): every retrained layout's seeds, costs and
    noise ceiling."""
    from pathlib import Path

    from parnas.errors import ConfigError
    from parnas.files import write_json_atomic
    from parnas.study.table import table_from_study

    if Path(args.table).exists():
        raise ConfigError(f"--table {args.table} exists; a table is written once (give a new file)")
    table = table_from_study(args.study, args.latency_table)
    write_json_atomic(args.table, table)
    print(f"written {args.table}: {len(table['layouts'])} layouts, noise ceiling {table['noise_ceiling']}")
    return 0


def cmd_table_score(args: argparse.Namespace) -> int:
    """Score a finished search (its run folder) against a ranking table, retraining nothing: Kendall and Spearman
    correlations, top-5 overlap, regret at budgets 0.5, 0.65 and 0.8."""
    from parnas.study.score import score
    from parnas.threads import use_threads

    score(args.run, args.table, args.set, log=lambda line: print(line, flush=True),
          before=lambda cfg: use_threads(cfg.model.d_model, cfg.data.step_tokens, cfg.train.threads))
    return 0


def cmd_table_add_seeds(args: argparse.Namespace) -> int:
    """Add finished parnas train runs of a table's layouts (same model, vocabulary and retrain steps, a seed the
    table lacks) to the table as further retrain seeds, in place."""
    from parnas.files import write_json_atomic
    from parnas.study.table_seeds import add_seeds

    table, lines = add_seeds(args.table, args.runs)
    write_json_atomic(args.table, table)
    print("\n".join(lines))
    ceiling = table["noise_ceiling"]
    print(f"written {args.table}: {len(lines)} seeds added, noise ceiling "
          f"{'n/a' if ceiling is None else f'{ceiling:.2f}'}")
    return 0


def _count(text: str, flag: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{flag} takes whole numbers >= 1, not {text!r}")
    return int(text)


def seeds_pair(text: str) -> tuple[int, int]:
    """``--seeds S[,K]``: S searches (train.seed 0..S-1) and K retrains of every layout they lead to (default 1;
    train.seed, +1, ...). Searches and retrains are said as one pair, as ``--steps`` says their lengths."""
    search, _, retrain = text.partition(",")
    return _count(search, "--seeds"), _count(retrain or "1", "--seeds")


def steps_pair(text: str) -> tuple[int | None, int | None]:
    """``--steps N`` (every search and retrain trains N steps) or ``--steps S,R``; an empty side (``--steps ,600``)
    keeps the config's ``train.max_steps``."""
    search, comma, retrain = text.partition(",")
    if not comma:
        retrain = search
    return (_count(search, "--steps") if search else None), (_count(retrain, "--steps") if retrain else None)


def add_commands(sub: argparse._SubParsersAction) -> None:
    from parnas import strategy_registry
    from parnas.arguments import add_command, add_config_args

    p = add_command(sub, "study", cmd_study, "parnas study --config wt2-cpu --seeds 2 --budgets 0.65 --out runs/study")
    add_config_args(p)
    p.add_argument("--seeds", type=seeds_pair, default="3", metavar="S[,K]",
                   help="S searches per budget, with train.seed 0..S-1, and K retrains of every layout (train.seed, "
                        "+1, ...): the verdicts then weigh differences against the seed spread (default 3,1)")
    p.add_argument("--budgets", default="0.65,none", metavar="B,B", help="latency budgets, fractions in (0, 1] of "
                   "Transformer-XL's step time, or none (default 0.65,none)")
    p.add_argument("--out", default="runs/study", help="study directory; a rerun skips finished work (runs/study)")
    p.add_argument("--steps", type=steps_pair, default=",", metavar="N|S,R",
                   help="train.max_steps of each search and retrain, or S of each search and R of each retrain; an "
                        "empty side keeps the config's (default: the config's)")
    p.add_argument("--random-orderings", type=int, default=3, metavar="R",
                   help="random orderings of each found architecture's blocks (default 3)")
    p.add_argument("--widths", default=None, metavar="D,D,...",
                   help="add the full-depth Transformer-XL at these d_model (d_ff in proportion) to the front the "
                        "found models are judged against, beside the shallower ones (each must divide by the "
                        "heads; default: none)")
    p.add_argument("--space", default=None, metavar="all|N",
                   help="also retrain networks of the searched space: all (every distinct one, at most 1,000), or N "
                        "drawn at random (train.seed), stratified by predicted cost, for a larger space: where the "
                        "found models rank among the networks no costlier, and the most any search of this space "
                        "could find (default: none)")
    p.add_argument("--candidates", action="append", metavar="K,K,...",
                   help="a candidate set to search (repeatable: each set gets its own searches, compared at equal "
                        "steps against one Transformer-XL and one timing); default: the config's search.candidates")

    p = add_command(sub, "strategies", cmd_strategies,
                    "parnas strategies par-gumbel-darts,darts,random-oneshot,random --config wt2-cpu --seeds 3")
    add_config_args(p)
    p.add_argument("strategies", metavar="S,S,...",
                   help=f"two or more registered strategies ({', '.join(strategy_registry.names())})")
    p.add_argument("--seeds", type=seeds_pair, default="3", metavar="S[,K]",
                   help="S searches per strategy, with train.seed 0..S-1, and K retrains of every found layout "
                        "(train.seed, +1, ...): the verdict weighs differences against the seed spread (default 3,1)")
    p.add_argument("--steps", type=steps_pair, default="600", metavar="N|S,R",
                   help="training steps of each search (a one-shot strategy's supernet steps, shared by a "
                        "multi-trial one's trials) and train.max_steps of each retrain, or S and R apart; an empty "
                        "side keeps the config's train.max_steps")
    p.add_argument("--trials", type=lambda text: _count(text, "--trials"), default=4, metavar="N",
                   help="trials of a multi-trial strategy")
    p.add_argument("--out", default="runs/strategies", help="study folder; a rerun skips finished work")

    about = "Build, score against or extend a ranking table of a search space (benchmarks/spaces/)."
    p = sub.add_parser("table", help=about, description=about,
                       epilog="Example:\n  parnas table score runs/search --table benchmarks/spaces/adi6-wt2-cpu.json")
    tables = p.add_subparsers(dest="table_command", required=True, metavar="{build,score,add-seeds}",
                              help="what to do with the table")
    p = add_command(tables, "build", cmd_table_build, "parnas table build runs/study/study.json --table space.json")
    p.set_defaults(command="table build")
    p.add_argument("study", metavar="STUDY_JSON", help="the study.json of a finished study with --space")
    p.add_argument("--table", required=True, metavar="FILE", help="the ranking table to write (a new file)")
    p.add_argument("--latency-table", default=None, metavar="FILE",
                   help="the latency table that prices the layouts (default: the study's own)")
    p = add_command(tables, "score", cmd_table_score,
                    "parnas table score runs/search --table benchmarks/spaces/adi6-wt2-cpu.json")
    p.set_defaults(command="table score")
    p.add_argument("run", metavar="RUN", help="a finished search's run folder")
    p.add_argument("--table", required=True, metavar="FILE", help="the ranking table to score against")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting of the search's config, e.g. --set train.threads=1 (repeatable)")
    p = add_command(tables, "add-seeds", cmd_table_add_seeds,
                    "parnas table add-seeds runs/ADADAD-s2 --table space.json")
    p.set_defaults(command="table add-seeds")
    p.add_argument("runs", nargs="+", metavar="RUN", help="finished parnas train runs of the table's layouts")
    p.add_argument("--table", required=True, metavar="FILE", help="the ranking table to extend, in place")
