"""Checkpoints and MLflow's artifacts in object storage (SeaweedFS's S3 API on 127.0.0.1, as `make remote` starts it):
with ``paths.checkpoints = s3://...``, two nodes that share no disk stop on SIGTERM and resume from the store
bit-equal, a store killed in the middle of a checkpoint's upload leaves the last whole one, which the next run resumes
from, and a store that is down, a wrong key or a missing bucket is named before any training starts; the team's
tracking server keeps a registered model's files in the bucket and serves them to a client that holds no key of it.
(The DVC remote on the same store: tests/test_remote.py.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ddpipe.core.exits import EXIT_PREEMPTED
from ddpipe.core.objectstore import Store, StoreFolder, dvc_remotes
from tests.conftest import (
    CLONE_ENV,
    ROOT,
    STOPPED,
    args_for,
    free_port,
    kill_all,
    object_store_env,
    run,
    same_weights,
    start_object_store,
    subprocess_env,
    weights,
)

# one global batch of 32 (one process of 32, or two of 16) at one lr, world-size invariant weights
# (distributed.exact), a step checkpoint every 4 of the epoch's 33 steps, all kept (a test polls for one of them)
COMMON = ("num_epochs=3", "distributed.exact=true", "train.lr_scaling=none", "train.checkpoint_every_steps=4",
          "train.keep_checkpoints=100", "distributed.threads_per_process=1")
ONE = (*COMMON, "train.batch_size_per_rank=32", "distributed.nproc_per_node=1")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, prepared: Path) -> dict[str, torch.Tensor]:
    """The weights of the run straight through, its checkpoints on this host's disk."""
    tmp = tmp_path_factory.mktemp("straight")
    run([sys.executable, "-m", "ddpipe.launch", *args_for(tmp, prepared, *ONE)], env=CLONE_ENV)
    return weights(tmp / "model.pt")


def _store(directory: Path) -> Store:
    env = object_store_env(directory)
    return Store(env["AWS_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])


def _names(store: Path, url: str) -> list[str]:
    return StoreFolder(url, _store(store)).names()


def _wait_for(store: Path, url: str, name_part: str, running: Callable[[], bool], seconds: float = 300) -> None:
    place, deadline = StoreFolder(url, _store(store)), time.time() + seconds
    while not any(name_part in n for n in place.names()) and running() and time.time() < deadline:
        time.sleep(0.05)
    assert any(name_part in n for n in place.names()) and running(), f"no checkpoint {name_part} in {url}"


@pytest.mark.slow
def test_two_nodes_sharing_no_disk_stop_and_resume_from_the_store_bit_equal(
        tmp_path: Path, prepared: Path, store: Path, uninterrupted: dict[str, torch.Tensor]) -> None:
    """Two nodes (two launchers, a c10d rendezvous on 127.0.0.1), each in a folder of its own with its own copy of the
    prepared data (what `dvc pull` gives each clone) and no path in common: rank 0 writes the checkpoints to the store.
    SIGTERM to both once a checkpoint of epoch 2 is in the store: both exit 75; started again, they resume from the
    store at the step they stopped at and end with the weights of the one-process run straight through."""
    url = f"s3://ddpipe/checkpoints/{tmp_path.name}"
    folders = [tmp_path / f"node{i}" for i in range(2)]
    for folder in folders:
        shutil.copytree(prepared, folder / "prepared")
    env = subprocess_env({**CLONE_ENV, **object_store_env(store)})

    def start(port: int) -> list[subprocess.Popen]:
        return [subprocess.Popen(
            [sys.executable, "-m", "ddpipe.launch",
             *args_for(folder, folder / "prepared", *COMMON, "train.batch_size_per_rank=16", f"paths.checkpoints={url}",
                       "distributed.nproc_per_node=1", "distributed.nnodes=2",
                       f"distributed.rdzv_endpoint=127.0.0.1:{port}", f"distributed.rdzv_id={tmp_path.name}")],
            cwd=ROOT, env=env, stdout=open(folder / "log.txt", "a"), stderr=subprocess.STDOUT,
            start_new_session=True) for folder in folders]

    nodes = start(free_port())
    try:
        _wait_for(store, url, "-e0001-", lambda: all(n.poll() is None for n in nodes))
        for node in nodes:
            node.send_signal(signal.SIGTERM)
        codes = [node.wait(timeout=300) for node in nodes]
    finally:
        kill_all(str(tmp_path))
    text = "".join((folder / "log.txt").read_text() for folder in folders)
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], text[-4000:]
    ((sig, epoch, step),) = set(STOPPED.findall(text))
    assert not any((f / "ckpt").exists() for f in folders)  # nothing of the checkpoints on either node's disk

    again = start(free_port())
    assert [p.wait(timeout=600) for p in again] == [0, 0], text[-2000:]
    text = "".join((folder / "log.txt").read_text() for folder in folders)
    assert f"at epoch {epoch}, step {step}" in text, text[-4000:]
    (model,) = [f / "model.pt" for f in folders if (f / "model.pt").exists()]  # written by global rank 0's node only
    assert same_weights(weights(model), uninterrupted)


class CuttingProxy:
    """A TCP proxy in front of the store that, on the first upload (PUT) of a key holding ``cut_at``, forwards its
    headers and half its body, then calls ``cut()`` (which kills the store), drops every connection and stops
    listening: to the training, the store died in the middle of that upload."""

    def __init__(self, target: int, cut_at: bytes, cut: Callable[[], None]) -> None:
        self.target, self.cut_at, self.cut = target, cut_at, cut
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.done = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.done.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.conns += [client, upstream]
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        """Forward the client's requests one by one (headers, then Content-Length bytes of body), cutting the one."""
        buf, body_left, cutting = b"", 0, False
        try:
            while data := client.recv(65536):
                buf += data
                while buf:
                    if body_left:
                        chunk, buf = buf[:body_left], buf[body_left:]
                        if cutting:
                            upstream.sendall(chunk[: max(0, len(chunk) - body_left // 2)])
                            self._cut()
                            return
                        upstream.sendall(chunk)
                        body_left -= len(chunk)
                        continue
                    end = buf.find(b"\r\n\r\n")
                    if end < 0:
                        break
                    head, buf = buf[: end + 4], buf[end + 4:]
                    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                    body_left = int(length[1]) if length else 0
                    cutting = head.startswith(b"PUT ") and self.cut_at in head.split(b"\r\n", 1)[0]
                    upstream.sendall(head)
        except OSError:
            pass

    def _cut(self) -> None:
        self.done.set()
        self.cut()
        try:  # a listener closed alone keeps listening while its accept() blocks: shut it down first
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        for conn in self.conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            except OSError:
                pass


@pytest.mark.slow
def test_a_store_killed_during_a_checkpoint_upload_leaves_the_last_whole_one_and_the_training_resumes_there(
        tmp_path: Path, prepared: Path, uninterrupted: dict[str, torch.Tensor],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The store (one of its own) is SIGKILLed when half of epoch 2's step-8 checkpoint has gone up. The training
    retries with backoff, then stops, naming the store and the checkpoint (exit 1); the store, started again, holds no
    part of that checkpoint; the same command resumes from the whole one before it (step 4) and ends with the weights
    of the run straight through."""
    from deploy.object_store import start, state

    own = start_object_store(tmp_path_factory.mktemp("killed-store"))
    served = state(own)
    port = int(served["endpoint"].rsplit(":", 1)[1])
    url = f"s3://ddpipe/checkpoints/{tmp_path.name}"
    proxy = CuttingProxy(port, b"-e0001-s000008", lambda: os.killpg(served["pid"], signal.SIGKILL))
    cmd = [sys.executable, "-m", "ddpipe.launch", *args_for(tmp_path, prepared, *ONE, f"paths.checkpoints={url}")]
    try:
        cut = run(cmd, env={**CLONE_ENV, **object_store_env(own, proxy.port)}, check=False, timeout=300)
        said = cut.stdout + cut.stderr
        assert proxy.done.is_set() and cut.returncode == 1, said[-4000:]
        assert "writing ckpt-" in said and f"-e0001-s000008.pt to {url}" in said, said[-4000:]
        assert "failed 6 times" in said and "its newest whole checkpoint kept there" in said, said[-4000:]
        assert "objectstore.py" not in said, said[-4000:]  # no traceback of ours (torchrun prints its summary)

        start(own, port, "ddpipe")  # the store again, on its data
        names = _names(own, url)
        assert any("-e0001-s000004.pt" in n for n in names) and not any("-e0001-s000008" in n for n in names), names
        resumed = run(cmd, env={**CLONE_ENV, **object_store_env(own)})
        assert "at epoch 2, step 4" in resumed.stdout + resumed.stderr, (resumed.stdout + resumed.stderr)[-3000:]
        assert same_weights(weights(tmp_path / "model.pt"), uninterrupted)
    finally:
        run([sys.executable, str(ROOT / "deploy" / "object_store.py"), "stop", "--dir", str(own)], check=False)


def test_a_store_that_is_down_refuses_the_key_or_lacks_the_bucket_is_named_before_training(
        tmp_path: Path, prepared: Path, store: Path) -> None:
    """One request before any worker starts: the setting, the URL, the endpoint and what is wrong; exit 2, no
    traceback, nothing written."""
    def refused(url: str, **env: str) -> str:
        cmd = [sys.executable, "-m", "ddpipe.launch", *args_for(tmp_path, prepared, *ONE, f"paths.checkpoints={url}")]
        said = run(cmd, env={**CLONE_ENV, **object_store_env(store), **env}, check=False)
        assert said.returncode == 2 and "Traceback" not in said.stderr, said.stderr[-3000:]
        assert f"paths.checkpoints ({url}" in said.stderr, said.stderr
        assert not (tmp_path / "model.pt").exists() and not (tmp_path / "mlflow.db").exists()
        return said.stderr

    assert "refused the credentials" in refused("s3://ddpipe/ckpt", AWS_SECRET_ACCESS_KEY="not-the-secret")
    assert "has no bucket 'no-such-bucket'" in refused("s3://no-such-bucket/ckpt")
    assert "does not answer" in refused("s3://ddpipe/ckpt", AWS_ENDPOINT_URL=f"http://127.0.0.2:{free_port()}")


def test_one_training_per_checkpoint_place_in_the_store_by_a_lease_renewed_from_its_own_thread(
        store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """A live holder's lease refuses a second training, naming it; one of another host renewed within the lease's time
    too (saying when it lapses); one not renewed for that long, or of a process of this host that has ended, is taken
    over, saying so; the holder renews it on its own; released, it is gone."""
    from dataclasses import asdict, replace

    from ddpipe.core import claims

    monkeypatch.setattr(claims, "LEASE_RENEW_S", 0.2)
    monkeypatch.setattr(claims, "LEASE_SETTLE_S", 0.1)
    place = StoreFolder(f"s3://ddpipe/leases/{tmp_path.name}", _store(store))
    first = claims.StoreLease.take(place, "paths.checkpoints", "rank 0")
    try:
        renewed = json.loads(place.read(claims.LEASE_NAME))["renewed"]
        time.sleep(0.6)
        assert json.loads(place.read(claims.LEASE_NAME))["renewed"] > renewed  # its thread renews it
        with pytest.raises(claims.InUse, match=rf"in use by another training: pid {os.getpid()}, rank 0"):
            claims.StoreLease.take(place, "paths.checkpoints", "rank 0")
    finally:
        first.release()
    assert claims.LEASE_NAME not in place.names()

    def leave(holder: claims.Holder, age_s: float) -> None:
        record = {"holder": asdict(holder), "renewed": time.time() - age_s}
        place.write(claims.LEASE_NAME, lambda f: f.write(json.dumps(record).encode()))

    elsewhere = replace(claims.Holder.this("rank 0", "t0"), host="node-elsewhere")
    leave(elsewhere, 10)
    with pytest.raises(claims.InUse, match=r"on host node-elsewhere.*lapses 80 s from now"):
        claims.StoreLease.take(place, "paths.checkpoints", "rank 0")
    for gone in (replace(elsewhere, token="t1"), replace(claims.Holder.this("rank 0", "t2"), pid=2**22 + 7)):
        leave(gone, claims.LEASE_TTL_S + 1 if gone.host == "node-elsewhere" else 0)
        claims.StoreLease.take(place, "paths.checkpoints", "rank 0").release()
        assert "taking over" in capsys.readouterr().err


def test_a_checkpoint_store_is_found_from_the_environment_else_the_dvc_remote_on_its_bucket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No endpoint or key in the environment: the DVC remote on the same bucket (config.local's keys over config's
    URL) is the checkpoints' store; one in the environment wins over it."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / ".dvc").mkdir()
    (tmp_path / ".dvc" / "config").write_text("[core]\n    remote = store\n['remote \"store\"']\n"
                                              "    url = s3://team-bucket/dvc\n['remote \"other\"']\n"
                                              "    url = s3://another/dvc\n")
    (tmp_path / ".dvc" / "config.local").write_text("['remote \"store\"']\n    endpointurl = http://10.0.0.5:8333\n"
                                                    "    access_key_id = AK\n    secret_access_key = SK\n")
    assert dvc_remotes(tmp_path)["store"]["endpointurl"] == "http://10.0.0.5:8333"
    assert Store.for_url("s3://team-bucket/checkpoints", (tmp_path,)) == Store("http://10.0.0.5:8333", "AK", "SK")
    assert Store.for_url("s3://team-bucketx/checkpoints", (tmp_path,)) == Store()  # another bucket: the chain's
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://store.example:9000")
    assert Store.for_url("s3://team-bucket/checkpoints", (tmp_path,)) == Store("http://store.example:9000")
    assert json.dumps(Store().fsspec_options()["config_kwargs"]["s3"]) == '{"addressing_style": "path"}'


@pytest.mark.slow
def test_the_tracking_server_keeps_a_registered_models_files_in_the_bucket_and_serves_them(
        tmp_path: Path, prepared: Path, store: Path) -> None:
    """deploy/tracking_server.py with ``--artifacts-destination s3://ddpipe/mlflow`` (its keys from the environment
    here, from the DVC remote in a clone): a training logs and registers its model through the server, whose files
    land in the bucket; a client with the server's URL and a password, and no key of the store, loads version 1 and
    predicts. A wrong key is named before the server starts."""
    import mlflow
    import numpy as np

    script, port, admin = str(ROOT / "deploy" / "tracking_server.py"), free_port(), "admin-pw-0123456789"
    server = [sys.executable, script, "start", "--dir", str(tmp_path / "server"), "--port", str(port),
              "--backend-store-uri", f"sqlite:///{tmp_path / 'server' / 'mlflow.db'}",
              "--artifacts-destination", "s3://ddpipe/mlflow"]
    env = {**object_store_env(store), "MLFLOW_AUTH_ADMIN_PASSWORD": admin}
    wrong = run(server, env={**env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}, check=False)
    assert wrong.returncode != 0 and "--artifacts-destination (s3://ddpipe/mlflow" in wrong.stderr, wrong.stderr
    assert "refused the credentials" in wrong.stderr and not (tmp_path / "server" / "mlflow-server.pid").exists()
    run(server, env=env, timeout=300)
    try:
        url = f"http://127.0.0.1:{port}"
        client = {"MLFLOW_TRACKING_URI": url, "MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": admin}
        run([sys.executable, "-m", "ddpipe.launch",
             *args_for(tmp_path, prepared, "num_epochs=1", "distributed.nproc_per_node=1", f"mlflow.tracking_uri={url}",
                       "mlflow.log_model=true", "mlflow.registered_model_name=store-model")],
            env={**CLONE_ENV, **client, "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_ENDPOINT_URL": ""})
        objects = StoreFolder("s3://ddpipe", _store(store)).fs.find("ddpipe/mlflow")
        assert any(o.endswith("/MLmodel") for o in objects) and any(o.endswith("/model.pt") for o in objects), objects
        os.environ.update(client)  # restored by conftest's autouse fixture; no key of the store here
        mlflow.set_tracking_uri(url)
        model = mlflow.pyfunc.load_model("models:/store-model/1")
        answers = model.predict(np.zeros((3, 28, 28), dtype=np.uint8))
        assert len(answers) == 3 and set(answers.columns) >= {"label", "probability"}
    finally:
        run([sys.executable, script, "stop", "--dir", str(tmp_path / "server")], check=False)
