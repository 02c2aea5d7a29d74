"""``ddpipe``: one command with subcommands, as ``dvc`` and ``mlflow`` are (``python -m ddpipe`` is the same).

    ddpipe launch [--print] [key=value ...]              check, then train under torchrun (the train stage's command)
    ddpipe search run | status | best | remove [...]     a hyperparameter study, each trial a DVC experiment
    ddpipe cluster submit | wait | status [...]          DVC's queued experiments as SLURM or Kubernetes jobs
    ddpipe sweeps NAME [key=value ...]                   a sweep's runs summarised: mean and std per configuration
    ddpipe outbox deliver | status                       MLflow records that wait for their store
    ddpipe config [key=value ...] | --schema | --docs    params.yaml checked and shown; every parameter

``ddpipe SUBCOMMAND --help`` says more. ``python -m ddpipe.launch``, ``python -m ddpipe.search`` and ``python -m
ddpipe.config`` are the same commands as before. ``python -m ddpipe.cluster``, ``ddpipe.outbox`` and ``ddpipe.sweeps``
(shims at the package root, before this command) are gone: Python answers "No module named ddpipe.cluster", before
any code of ours runs, so nothing can name the new spelling there: ``ddpipe cluster`` (or ``python -m ddpipe
cluster``).
"""

from __future__ import annotations

import importlib
import sys

# subcommand: (the module whose main(argv) it runs, what it does)
SUBCOMMANDS = {
    "launch": ("ddpipe.launch.torchrun", "check the params, this node and the data, then train under torchrun"),
    "search": ("ddpipe.search.study_commands", "a hyperparameter study: run, status, best, remove"),
    "cluster": ("ddpipe.launch.cluster.submission", "DVC's queued experiments as scheduler jobs: submit, wait, status"),
    "sweeps": ("ddpipe.tracking.sweeps", "a sweep's runs summarised per configuration, logged to its parent run"),
    "outbox": ("ddpipe.tracking.outbox", "MLflow records that wait for their store: deliver, status"),
    "config": ("ddpipe.config.__main__", "params.yaml with overrides, checked and shown; --schema, --docs"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    rows = "\n".join(f"  {name.ljust(width)}  {what}" for name, (_, what) in SUBCOMMANDS.items())
    return f"usage: ddpipe SUBCOMMAND [...]\n\nsubcommands:\n{rows}\n\nddpipe SUBCOMMAND --help: its own options"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"error: ddpipe has no subcommand {name!r}; expected one of {', '.join(SUBCOMMANDS)}\n\n{usage()}",
              file=sys.stderr)
        return 2
    sys.argv = [f"ddpipe {name}", *rest]  # what argparse and the usage lines name the command by
    code = importlib.import_module(SUBCOMMANDS[name][0]).main(rest)
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    raise SystemExit(main())
