"""`mlflow ui` as a person sees it: headless Chromium on the link a training prints, on a two-run
comparison and on a logged model's page. Skips where Debian's chromium is not installed (.ci/run installs it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import CLONE_ENV, VENV_BIN, args_for, free_port, run, subprocess_env, wait_for_url

CHROMIUM = shutil.which("chromium")
# No background traffic (this machine has no internet) and a fresh profile: a first visit, as a newcomer's.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--virtual-time-budget=15000", "--window-size=1920,1080"]


def render(url: str, *extra: str) -> str:
    """The page's DOM after its scripts ran (``--screenshot=FILE`` in ``extra`` writes a PNG too)."""
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, "--dump-dom", url],
                                capture_output=True, text=True, timeout=120)
    return result.stdout


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_mlflow_ui_opens_on_the_runs_table_and_compares_two_runs(tmp_path: Path, prepared: Path) -> None:
    for name, lr, log_model in (("lr-small", "0.001", "false"), ("lr-large", "0.01", "true")):  # one model: its page
        args = args_for(tmp_path, prepared, "num_epochs=1", f"train.base_lr={lr}", f"mlflow.log_model={log_model}")
        trained = run(["python", "stages/train_worker.py", *args], env={**CLONE_ENV, "DVC_EXP_NAME": name})
        run(["python", "stages/evaluate.py", *args], env=CLONE_ENV)
    link = next(line.split()[0] for line in trained.stderr.splitlines() if "(runs table)" in line)

    # `mlflow ui` started where mlflow.db is, as in the repo root: its default store is ./mlflow.db
    port = free_port()
    env = {k: v for k, v in subprocess_env().items() if k != "MLFLOW_TRACKING_URI"}
    server = subprocess.Popen([str(VENV_BIN / "mlflow"), "ui", "--host", "127.0.0.1", "--port", str(port)],
                              cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_url(f"{base}/health", 90, server)
        page = render(link.replace("http://127.0.0.1:5000", base), f"--screenshot={tmp_path / 'runs.png'}")
        assert "<title>Runs - Experiment" in page, page[:2000]
        for text in ("lr-small", "lr-large", "test_accuracy", "test_macro_f1", "world_size", "effective_lr"):
            assert text in page, text

        runs = json.loads(urllib.request.urlopen(
            urllib.request.Request(f"{base}/api/2.0/mlflow/runs/search", method="POST",
                                   data=json.dumps({"experiment_ids": [link.split("/experiments/")[1].split("/")[0]]})
                                   .encode(), headers={"Content-Type": "application/json"})).read())["runs"]
        assert sorted(r["info"]["status"] for r in runs) == ["FINISHED", "FINISHED"]
        ids = json.dumps([r["info"]["run_id"] for r in runs])
        compare = render(f"{base}/#/compare-runs?runs={ids}&experiments=[\"{runs[0]['info']['experiment_id']}\"]")
        assert "Comparing 2 Runs" in compare, compare[:2000]
        # its metrics table is a scroll box that renders only the rows in view (alphabetical: the per-step figures
        # train.log_every_n_steps adds push test_accuracy below its fold; the runs table above shows it)
        for text in ("lr-small", "lr-large", "train.base_lr", "best_val_accuracy", "grad_norm", "val_accuracy"):
            assert text in compare, text

        # a logged model's page (the Models tab's link) shows the figures linked to it through its model id
        from mlflow.tracking import MlflowClient

        experiment = runs[0]["info"]["experiment_id"]
        model = MlflowClient(tracking_uri=base).search_logged_models([experiment], filter_string="name = 'model'")[0]
        figures = {m.key: m.value for m in model.metrics}
        page = render(f"{base}/#/experiments/{experiment}/models/{model.model_id}",
                      f"--screenshot={tmp_path / 'model.png'}")
        assert "Metrics (5)" in page, page[:2000]
        for key in ("model_val_accuracy", "model_val_loss", "test_accuracy", "test_loss", "test_macro_f1"):
            assert key in page and str(figures[key]) in page, key  # the value as stored (JS and Python print alike)
    finally:
        os.killpg(server.pid, 9)  # mlflow ui's job-queue workers ignore SIGTERM
        server.wait(timeout=30)
