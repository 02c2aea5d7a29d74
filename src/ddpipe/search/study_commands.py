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

import json
import sys
from pathlib import Path

from ddpipe.config.command import load_or_exit
from ddpipe.config.load import DEFAULT_PARAMS_FILE, user_errors
from ddpipe.config.schema import Config, ConfigError
from ddpipe.search.experiments import apply_best, options, remove
from ddpipe.search.space import Plan, make_plan
from ddpipe.search.study import SearchError, load_study
from ddpipe.tracking.run_store import repo_root

USAGE = ("usage: ddpipe search run [--cluster]|status|best|remove [--json] [--apply] [--keep N] "
         "[--dry-run] [key=value ...]")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    removal = None
    if "remove" in argv:
        with user_errors():  # a bad --keep: exit 2 before the study is opened
            removal, argv = options(argv)
    words = [a for a in argv if "=" not in a and not a.startswith("-")]
    if "-h" in argv or "--help" in argv:
        print(f"{USAGE}\n\n{__doc__}")
        return 0
    if len(words) != 1 or words[0] not in ("run", "status", "best", "remove"):
        print(USAGE, file=sys.stderr)
        return 2
    overrides = [a for a in argv if "=" in a]
    with user_errors():
        check_overrides(overrides)
    root = repo_root()
    params = root / DEFAULT_PARAMS_FILE
    cfg = load_or_exit(overrides, "-m ddpipe.search")
    with user_errors(SearchError, code=1):
        plan = make_plan(cfg, root, params if params.is_file() else None)
        if words[0] == "run":
            return _run(cfg, plan, root, "--cluster" in argv)
        study = load_study(plan)
        if removal is not None:
            print(remove(study, root, removal), end="")
        elif words[0] == "status":
            from ddpipe.search.report import status

            print(status(study), end="")
        else:
            from ddpipe.search.report import best

            top = best(study)
            where = f"DVC experiment {top['experiment']} (dvc exp apply {top['experiment']})" if top["experiment"] \
                else "no DVC experiment (ddpipe search remove removed it)"
            print(json.dumps(top) if "--json" in argv else
                  f"best: trial {top['number']}, {plan.settings.metric} {top['value']:.4f}, {top['params']}; {where}",
                  flush=True)
            if "--apply" in argv:
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
        print(f"note: {note}", file=sys.stderr)
    with user_errors(ClusterError):  # no scheduler here, a refused submission: said in a line
        study = driver.run(plan, root, cluster=cfg.cluster if on_cluster else None)
    written, skipped = report.plots(study, plan.folder)
    for reason in skipped:
        print(f"note: plot {reason}", file=sys.stderr)
    try:
        parent = report.log_to_parent(cfg, study, written)
        print(f"plots in {plan.folder}, logged to the MLflow parent run {parent}")
    except Exception as exc:  # the search is done and the plots on disk; the next run logs them again
        print(f"warning: could not log the plots to MLflow ({type(exc).__name__}: {exc})", file=sys.stderr)
    print(report.status(study), end="")
    return 0
