"""What a study holds, for a person and for scripts: every trial (``status``), the best one and its DVC experiment
(``best``), and Optuna's plots as PNG files in ``search/<study>/``, logged to the study's MLflow parent run."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from ddpipe.config.schema import Config
from ddpipe.core.errors import one_line
from ddpipe.core.metric_names import TEST_ACCURACY
from ddpipe.core.trials import EXPORTED, pruned_at
from ddpipe.search.experiments import REMOVED, TESTED
from ddpipe.search.study import SearchError
from ddpipe.tracking.run_store import bound_http_requests, experiment_id, open_client, sweep_parent, tracking_uri
from ddpipe.tracking.sweeps import SEARCH_TAG, markdown

PLOTS = ("optimization_history", "parallel_coordinate", "param_importances")


def _shown(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def rows(study: Any) -> list[list[str]]:
    """``status``'s table: number, state (a pruned trial's with its epoch), params, value, epochs run (and attempts,
    when it was stopped and resumed), the DVC experiment (completed trials only: a pruned or failed one leaves none;
    ``removed`` once ``remove`` removed it), the MLflow run."""
    table = [["trial", "state", "params", "value", "epochs", "DVC experiment", "MLflow run"]]
    removed = set(study.user_attrs.get(REMOVED, ()))
    tested = {r["trial"]: r[TEST_ACCURACY] for r in study.user_attrs.get(TESTED, ())}
    for t in study.get_trials(deepcopy=False):
        state = t.state.name + (f" at {pruned_at(t.user_attrs)}" if "pruned_epoch" in t.user_attrs else "") \
            + (" (diverged)" if "diverged" in t.user_attrs else "") \
            + (f" (tested by best --apply: test accuracy {tested[t.number]:.4f})" if t.number in tested else "") \
            + (f" (finished, its experiment not sent back: {t.user_attrs['unsent']}; the next run sends it)"
               if t.state.name == "RUNNING" and "unsent" in t.user_attrs else "")
        params = " ".join(f"{k}={_shown(v)}" for k, v in t.params.items())
        experiment = "removed" if t.number in removed else \
            t.user_attrs.get("experiment", "") if t.state.name == "COMPLETE" else ""
        value = "" if t.value is None else f"{t.value:.4f}"
        attempts = int(t.user_attrs.get("attempts", 1))
        epochs = str(t.user_attrs.get("epochs", "")) + (f" ({attempts} attempts)" if attempts > 1 else "") \
            + (f", model of epoch {t.user_attrs[EXPORTED]['epoch']}" if EXPORTED in t.user_attrs else "")
        table.append([str(t.number), state, params, value, epochs, experiment, t.user_attrs.get("mlflow_run", "")])
    return table


def status(study: Any) -> str:
    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no trials yet"
    return f"search {study.study_name} ({study.direction.name.lower()}): {summary}\n\n{markdown(rows(study))}"


def best(study: Any) -> dict[str, Any]:
    """The best completed trial: its number, params, value and DVC experiment (None once ``remove`` removed it)."""
    from optuna.trial import TrialState

    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        raise SearchError(f"search {study.study_name}: no completed trial yet (ddpipe search status)")
    t = study.best_trial
    gone = t.number in study.user_attrs.get(REMOVED, ())
    return {"number": t.number, "params": t.params, "value": t.value,
            "experiment": None if gone else t.user_attrs.get("experiment")}


def plots(study: Any, folder: Path) -> tuple[list[Path], list[str]]:
    """Optuna's matplotlib plots of the study as PNG files in ``folder``; those it cannot draw yet (importances need
    two completed trials that differ) are named with the reason."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as vis

    written, skipped = [], []
    folder.mkdir(parents=True, exist_ok=True)
    for name in PLOTS:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
                ax = getattr(vis, f"plot_{name}")(study)
            fig = (ax.flat[0] if hasattr(ax, "flat") else ax).get_figure()
            fig.savefig(folder / f"{name}.png", dpi=110, bbox_inches="tight")
            plt.close(fig)
            written.append(folder / f"{name}.png")
        except Exception as exc:  # too few trials for this plot, for now
            skipped.append(f"{name}: {one_line(exc, 200)}")
    return written, skipped


def log_to_parent(cfg: Config, study: Any, files: list[Path]) -> str:
    """The plots and the best trial into the study's MLflow parent run (the sweep ``search.study``), written to the
    store directly, not through an outbox: they are drawn from the study again by the next ``run``, nothing is lost
    when the store does not answer (the caller prints the failure). Returns the parent's id."""
    import mlflow

    bound_http_requests()
    uri = tracking_uri(cfg.mlflow)
    mlflow.set_tracking_uri(uri)
    client = open_client(uri)
    run_id = sweep_parent(client, uri, experiment_id(mlflow, cfg.mlflow.experiment_name, uri), study.study_name)
    for f in files:
        client.log_artifact(run_id, str(f), artifact_path="search")
    try:
        top = best(study)
    except SearchError:
        return run_id
    client.set_tag(run_id, SEARCH_TAG, f"{top['number']} ({top['experiment'] or 'experiment removed'})")
    client.log_metric(run_id, f"best_{cfg.search.metric}", float(top["value"]), step=len(study.trials))
    return run_id
