"""``ddpipe search``: run a search, list its trials, name its best.

    ddpipe search run [search.trials=40 ...]    # trials until the study holds search.trials finished ones
    ddpipe search run --cluster                 # each trial a SLURM job (the cluster section), jobs at once
    ddpipe search status [search.study=NAME]    # every trial: state, params, value, epochs, experiment, run
    ddpipe search best [--json]                 # the best trial and its DVC experiment (dvc exp apply NAME)
    ddpipe search best --apply                  # dvc exp apply of it, then dvc repro: tested once
    ddpipe search remove [--keep 10] [--dry-run] # the trials' DVC experiments but the best 10 completed ones

``search.key=value`` after the subcommand overrides the ``search`` section for this command. Other keys are refused
(exit 2): a trial's params are params.yaml's (the working tree's, committed or not) with its space's values, and a
key set on this command line would reach the driver, not the trials. A mistake in the ``search`` section fails
before any trial starts, the study unchanged (exit 2).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from ddpipe.config.command import CommandParser, load_or_exit, run_command
from ddpipe.config.load import DEFAULT_PARAMS_FILE, user_errors
from ddpipe.config.schema import Config, ConfigError
from ddpipe.search.experiments import KEEP, KEEP_ACCEPTED, Removal, apply_best, keep_count, remove
from ddpipe.search.space import Plan, make_plan
from ddpipe.search.study import SearchError, load_study
from ddpipe.tracking.run_store import repo_root

SEARCH_OVERRIDES = "search.key=value: this command's search section (other keys are refused: set them in params.yaml)"

logger = logging.getLogger(__name__)


class _Keep(argparse.Action):
    """``--keep N``: N checked as it always was, the message naming the option, its value and what is accepted."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        try:
            setattr(namespace, self.dest, keep_count(values if isinstance(values, str) else None))
        except ConfigError as exc:
            raise argparse.ArgumentError(None, str(exc)) from None


def arguments(parser: CommandParser) -> None:
    """``ddpipe search``'s arguments: run, status, best and remove, each with its options and search.* overrides."""
    parser.description = "A hyperparameter study: Optuna asks for each trial, each trial a DVC experiment."
    parser.epilog = __doc__
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    run = actions.add_parser("run", help="trials until the study holds search.trials finished ones")
    run.add_argument("--cluster", action="store_true",
                     help="each trial a SLURM job (the cluster section), jobs at once")
    status = actions.add_parser("status", help="every trial: state, params, value, epochs, experiment, run")
    best = actions.add_parser("best", help="the best trial and its DVC experiment (dvc exp apply NAME)")
    best.add_argument("--json", action="store_true", help="the best trial as JSON")
    best.add_argument("--apply", action="store_true", help="dvc exp apply of it, then dvc repro: tested once")
    removal = actions.add_parser("remove", help=f"the trials' DVC experiments but the best {KEEP} completed ones")
    removal.add_argument("--keep", action=_Keep, nargs="?", default=KEEP, metavar="N", help=f"N: {KEEP_ACCEPTED}")
    removal.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    for leaf in (run, status, best, removal):
        leaf.add_overrides(SEARCH_OVERRIDES)
        leaf.set_defaults(run=search)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ddpipe.search``: the same as ``ddpipe search``."""
    return run_command("python -m ddpipe.search", arguments, argv)


def search(args: argparse.Namespace) -> int:
    """Run the study's ``args.action``; its exit code (2: a mistake on the command line or in the search section)."""
    with user_errors():
        check_overrides(args.overrides)
    root = repo_root()
    params = root / DEFAULT_PARAMS_FILE
    cfg = load_or_exit(args.overrides, "-m ddpipe.search")
    with user_errors(SearchError, code=1):
        plan = make_plan(cfg, root, params if params.is_file() else None)
        if args.action == "run":
            return _run(cfg, plan, root, args.cluster)
        study = load_study(plan)
        if args.action == "remove":
            print(remove(study, root, Removal(args.keep, args.dry_run)), end="")
        elif args.action == "status":
            from ddpipe.search.report import status

            print(status(study), end="")
        else:
            from ddpipe.search.report import best

            top = best(study)
            where = f"DVC experiment {top['experiment']} (dvc exp apply {top['experiment']})" if top["experiment"] \
                else "no DVC experiment (ddpipe search remove removed it)"
            print(json.dumps(top) if args.json else
                  f"best: trial {top['number']}, {plan.settings.metric} {top['value']:.4f}, {top['params']}; {where}",
                  flush=True)
            if args.apply:
                return apply_best(top, root, study, cfg.paths.test_metrics)
    return 0


def check_overrides(overrides: list[str]) -> None:
    """Only ``search.*`` keys on the command line: ConfigError naming any other."""
    if other := [o for o in overrides if not o.startswith("search.")]:
        raise ConfigError(f"{' '.join(other)}: only search.* keys are accepted by ddpipe search; a "
                          "trial's params are params.yaml's with its space's values: set the others in params.yaml")


def _run(cfg: Config, plan: Plan, root: Path, on_cluster: bool) -> int:
    from ddpipe.launch.cluster import ClusterError
    from ddpipe.search import driver, report

    for note in plan.notes:
        logger.info(f"note: {note}")
    with user_errors(ClusterError):  # no scheduler here, a refused submission: said in a line
        study = driver.run(plan, root, cluster=cfg.cluster if on_cluster else None)
    written, skipped = report.plots(study, plan.folder)
    for reason in skipped:
        logger.info(f"note: plot {reason}")
    if not cfg.mlflow.enabled:
        logger.info(f"plots in {plan.folder} (mlflow.enabled is false: no MLflow parent run)")
    else:
        try:
            parent = report.log_to_parent(cfg, study, written)
            logger.info(f"plots in {plan.folder}, logged to the MLflow parent run {parent}")
        except Exception as exc:  # the search is done and the plots on disk; the next run logs them again
            logger.warning(f"warning: could not log the plots to MLflow ({type(exc).__name__}: {exc})")
    print(report.status(study), end="")
    return 0
