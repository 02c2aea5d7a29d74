"""A sweep as one unit: its children's test results per configuration, as mean ± std over seeds.

    dvc exp run --queue -S mlflow.sweep=lr-grid -S 'train.base_lr=0.001,0.003,0.01' -S 'seed=1,2'
    dvc queue start -j 2
    ddpipe sweeps lr-grid [key=value ...]      # once the children have finished

Every training with ``mlflow.sweep`` set is a child run of one parent run named after the sweep
(:mod:`ddpipe.tracking.run_store`). This command groups the children by the parameters that vary among them
other than ``seed``, prints a table of test accuracy and macro-F1 as mean ± sample standard deviation
over the seeds, and logs the table to the parent run: metrics, ``sweep_summary.csv`` and
``sweep_summary.md``, and a plot ``sweep_summary.png``.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddpipe.config.command import CommandParser, load_or_exit, run_command
from ddpipe.config.keys import flatten
from ddpipe.config.load import user_errors
from ddpipe.config.schema import Config
from ddpipe.core.metric_names import TEST_ACCURACY, TEST_MACRO_F1
from ddpipe.tracking.run_store import bound_http_requests, find_sweep_parent, tracking_uri

METRICS = (TEST_ACCURACY, TEST_MACRO_F1)
SEARCH_TAG = "ddpipe.search.best_trial"  # set on a search study's parent run (ddpipe.search.report.log_to_parent)


class SweepError(ValueError):
    """No such sweep, or nothing in it to summarise."""


@dataclass
class Group:
    """The children that share one configuration (they differ in ``seed`` only)."""

    config: dict[str, str]
    values: dict[str, list[float]]
    seeds: list[str]

    def mean_std(self, metric: str) -> tuple[float, float]:
        v = np.asarray(self.values[metric], dtype=float)
        return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.config.items()) or "(one configuration)"


def group_children(children: list[Any]) -> tuple[list[Group], list[str]]:
    """Finished children grouped by the schema parameters that vary among them, ``seed`` and ``paths.*`` aside
    (derived values such as effective_lr follow the parameters, so they never split a group; where a run's files go
    is no configuration: a queued experiment's checkpoints are under its own hash, ddpipe.engine.stage_outputs).
    Returns the groups, best mean test accuracy first, and the varying keys."""
    keys = {k for k in flatten(Config()) if not k.startswith("paths.")}
    params = [{k: v for k, v in c.data.params.items() if k in keys} for c in children]
    varying = sorted(k for k in keys if k != "seed" and len({p.get(k) for p in params}) > 1)
    groups: dict[tuple, Group] = {}
    for child, p in zip(children, params):
        if not all(m in child.data.metrics for m in METRICS):
            continue  # still running, failed, or not evaluated: not a result
        key = tuple(p.get(k, "") for k in varying)
        g = groups.setdefault(key, Group(dict(zip(varying, key)), {m: [] for m in METRICS}, []))
        for m in METRICS:
            g.values[m].append(child.data.metrics[m])
        g.seeds.append(p.get("seed", "?"))
    return sorted(groups.values(), key=lambda g: -g.mean_std(TEST_ACCURACY)[0]), varying


def table(groups: list[Group], varying: list[str]) -> list[list[str]]:
    rows = [[*varying, "runs", "seeds", *(f"{m} (mean ± std)" for m in METRICS)]]
    for g in groups:
        cells = [f"{mean:.4f} ± {std:.4f}" for mean, std in (g.mean_std(m) for m in METRICS)]
        rows.append([*g.config.values(), str(len(g.seeds)), ",".join(sorted(g.seeds)), *cells])
    return rows


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + " --- |" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]]) + "\n"


def csv(rows: list[list[str]]) -> str:
    return "\n".join(",".join(f'"{c}"' if "," in c else c for c in r) for r in rows) + "\n"


def metric_key(label: str, name: str) -> str:
    """An MLflow metric name (letters, digits, ``_-. :/``) for one configuration's figure."""
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", f"{label}/{name}")


def summarise(cfg: Config, sweep: str) -> str:
    """Print-ready summary of sweep ``sweep`` in ``mlflow.experiment_name``; logged to its parent run."""
    from mlflow import MlflowClient

    bound_http_requests()
    client = MlflowClient(tracking_uri(cfg.mlflow))
    exp = client.get_experiment_by_name(cfg.mlflow.experiment_name)
    parent = find_sweep_parent(client, exp.experiment_id, sweep) if exp else None
    if parent is None:
        raise SweepError(f"mlflow.sweep = {sweep!r}: no parent run of that name in experiment "
                         f"{cfg.mlflow.experiment_name!r} at {tracking_uri(cfg.mlflow)}")
    if SEARCH_TAG in parent.data.tags:  # a search's trials are never tested: nothing here to average
        raise SweepError(f"mlflow.sweep = {sweep!r} is the study of a search, whose trials are judged on validation "
                         "and never tested; expected a sweep of queued experiments (see its trials with python -m "
                         f"ddpipe.search status search.study={sweep}, and test the chosen one: best --apply)")
    children = client.search_runs([exp.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    groups, varying = group_children(children)
    if not groups:
        raise SweepError(f"sweep {sweep!r}: none of its {len(children)} run(s) has test metrics yet "
                         "(still queued or running? `dvc queue status`; a search's trials are never tested: python -m "
                         "ddpipe.search status)")
    rows = table(groups, varying)
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(Counter(c.info.status for c in children).items()))
    text = (f"sweep {sweep}: {len(children)} run(s) ({statuses}), {len(groups)} configuration(s), "
            f"mean ± std over seeds\n\n{markdown(rows)}")
    _log_to_parent(client, parent.info.run_id, groups, rows, text)
    return text


def _log_to_parent(client: Any, run_id: str, groups: list[Group], rows: list[list[str]], text: str) -> None:
    """The summary into the sweep's parent run, written to the store directly, not through an outbox: this command
    has just read every child from the same store, so it runs only while the store answers, and what it writes is
    derived from those children: a failure is printed and the same command writes it again, nothing is lost."""
    from mlflow.entities import Metric

    metrics = []
    for g in groups:
        for m in METRICS:
            mean, std = g.mean_std(m)
            metrics += [Metric(metric_key(g.label, f"{m}_mean"), mean, 0, 0),
                        Metric(metric_key(g.label, f"{m}_std"), std, 0, 0)]
    best_mean, best_std = groups[0].mean_std(TEST_ACCURACY)
    metrics += [Metric(f"best_{TEST_ACCURACY}_mean", best_mean, 0, 0),
                Metric(f"best_{TEST_ACCURACY}_std", best_std, 0, 0), Metric("num_configurations", len(groups), 0, 0)]
    client.log_batch(run_id, metrics=metrics)
    client.set_tag(run_id, "ddpipe.best_configuration", groups[0].label)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "sweep_summary.csv").write_text(csv(rows))
        (out / "sweep_summary.md").write_text(text)
        _plot(groups, out / "sweep_summary.png")
        for f in sorted(out.iterdir()):
            client.log_artifact(run_id, str(f))


def _plot(groups: list[Group], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means, stds = zip(*(g.mean_std(TEST_ACCURACY) for g in groups))
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(groups) + 1.5))
    ax.barh(range(len(groups)), means, xerr=stds, capsize=4, color="tab:blue")
    ax.set_yticks(range(len(groups)), [g.label for g in groups], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(max(0.0, min(means) - 3 * max(max(stds), 0.005)), min(1.0, max(means) + 3 * max(max(stds), 0.005)))
    ax.set_xlabel("test accuracy (mean ± std over seeds)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def arguments(parser: CommandParser) -> None:
    """``ddpipe sweeps``' arguments: the sweep's name and the overrides."""
    parser.description = "A sweep's runs summarised: test accuracy and macro-F1, mean and std over seeds per " \
                         "configuration, logged to the sweep's parent run."
    parser.epilog = __doc__
    parser.add_argument("sweep", metavar="SWEEP_NAME", help="as set with -S mlflow.sweep=SWEEP_NAME")
    parser.add_overrides()
    parser.set_defaults(run=show)


def show(args: argparse.Namespace) -> int:
    """Print sweep ``args.sweep``'s summary (exit 2 on a user error)."""
    cfg = load_or_exit(args.overrides, "ddpipe sweeps")
    with user_errors(SweepError, code=2):
        print(summarise(cfg, args.sweep), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``ddpipe sweeps NAME [key=value ...]``: summarise sweep NAME (exit 2 on a user error)."""
    return run_command("ddpipe sweeps", arguments, argv)


if __name__ == "__main__":
    raise SystemExit(main())
