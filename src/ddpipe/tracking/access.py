"""Whether this user may write runs to the tracking server, asked before any worker starts.

A tracking server with MLflow's basic-auth app answers 401 to a wrong or missing password and tells a user its
permission on an experiment; a training that would be refused fails here with one message, before torchrun
starts and before anything is written. Credentials are MLflow's own (``MLFLOW_TRACKING_USERNAME`` and
``MLFLOW_TRACKING_PASSWORD``, or ``~/.mlflow/credentials``); only the user's name appears in a message. A server
that does not answer at all is not refused: the training starts and its records wait (``ddpipe.tracking.outbox``).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from ddpipe.config.schema import ConfigError, MlflowConfig
from ddpipe.tracking.run_store import bound_http_requests, experiment_id, is_server, redact, tracking_uri

WRITERS = ("EDIT", "MANAGE")


class StoreAccessError(ConfigError):
    """The tracking server refuses this user: wrong credentials, or no right to write to the experiment."""


def check_access(cfg: MlflowConfig) -> str | None:
    """Nothing for a local store or with ``mlflow.enabled`` false; for a server: None when this user may write to
    ``cfg.experiment_name`` (created when missing), a note when the server does not answer, StoreAccessError when it
    refuses."""
    uri = tracking_uri(cfg)
    if not (cfg.enabled and is_server(uri)):
        return None
    bound_http_requests()
    import mlflow
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    creds = get_default_host_creds(uri)
    user = creds.username or ""

    def get(endpoint: str) -> Any:
        return http_request(creds, endpoint, "GET", max_retries=0, timeout=10)

    where = redact(uri)
    try:
        answer = get(f"/api/2.0/mlflow/experiments/get-by-name?experiment_name={quote(cfg.experiment_name)}")
    except Exception as exc:  # no answer at all: the training starts, its records wait for the server
        return (f"note: the MLflow server at {where} does not answer ({type(exc).__name__}); the training starts "
                "and its records wait in mlflow.outbox until the server is back")
    who = f"user {user!r}" if user else "no user (MLFLOW_TRACKING_USERNAME is not set)"
    if answer.status_code == 401:
        raise StoreAccessError(f"the MLflow server at {where} refused the credentials of {who}: a wrong or missing "
                               "password (MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or "
                               "~/.mlflow/credentials); nothing was started")
    if answer.status_code == 403:
        raise StoreAccessError(f"the MLflow server at {where} does not let {who} read experiment "
                               f"{cfg.experiment_name!r} (mlflow.experiment_name); ask its admin for EDIT")
    if answer.status_code >= 500:
        return f"note: the MLflow server at {where} answers {answer.status_code}; the training's records will wait"
    if not user or _is_admin(get, user):
        return None
    if answer.status_code == 200:
        exp = answer.json()["experiment"]["experiment_id"]
    else:  # none yet: created now, and its creator may write to it
        mlflow.set_tracking_uri(uri)
        try:
            exp = experiment_id(mlflow, cfg.experiment_name, uri)
        except mlflow.exceptions.MlflowException as exc:
            raise StoreAccessError(f"the MLflow server at {where} does not let {who} create experiment "
                                   f"{cfg.experiment_name!r} ({exc.error_code}); ask its admin") from None
    perm = get(f"/api/3.0/mlflow/users/permissions/get?username={quote(user)}&resource_type=experiment"
               f"&resource_id={exp}")
    if perm.status_code == 200 and perm.json().get("permission") not in WRITERS:
        raise StoreAccessError(f"{who} may only {perm.json().get('permission')} experiment "
                               f"{cfg.experiment_name!r} on the MLflow server at {where}, not write runs to it; ask "
                               "its admin for EDIT (docs/tracking.md, 'A team's tracking server')")
    return None


def _is_admin(get: Any, user: str) -> bool:
    answer = get(f"/api/2.0/mlflow/users/get?username={quote(user)}")
    return answer.status_code == 200 and bool(answer.json().get("user", {}).get("is_admin"))
