"""Checkpoints and MLflow's artifacts in object storage (SeaweedFS's S3 API on 127.0.0.1, as `make remote` starts it):
with ``paths.checkpoints = s3://...``, two nodes that share no disk stop on SIGTERM and resume from the store
bit-equal, a store away for a minute is a pause of the checkpoints and the run ends as if it never stopped, a store
killed in the middle of a checkpoint's upload and away past the stated time stops the training (exit 75) with the last
whole one, which the next run resumes from, and a store that is down, a wrong key or a missing bucket is named before
any training starts; the team's tracking server keeps a registered model's files in the bucket and serves them to a
client that holds no key of it. (The DVC remote on the same store: tests/test_remote.py.)"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpipe.core import claims, store_lease
from ddpipe.core.exits import EXIT_PREEMPTED, StoreAway
from ddpipe.core.objectstore import Store, StoreFolder, dvc_remotes
from ddpipe.core.ranks import DistInfo
from ddpipe.engine.checkpoint import Checkpointer, Position, load_latest
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


@pytest.mark.slow
def test_two_nodes_sharing_no_disk_stop_and_resume_from_the_store_bit_equal(
        tmp_path: Path, prepared: Path, store: Path, uninterrupted: dict[str, torch.Tensor]) -> None:
    """Two nodes (two launchers, a c10d rendezvous on 127.0.0.1), each in a folder of its own with its own copy of the
    prepared data (what `dvc pull` gives each clone) and no path in common: rank 0 writes the checkpoints to the store.
    SIGTERM to both as the checkpoint after epoch 1 goes up (a proxy in front of the store sends it then, inside
    the upload: a poll of the store could come after the training's end on a fast or busy host): both exit 75;
    started again, they resume from the store at the step they stopped at and end with the weights of the
    one-process run straight through."""
    url = f"s3://ddpipe/checkpoints/{tmp_path.name}"
    folders = [tmp_path / f"node{i}" for i in range(2)]
    for folder in folders:
        shutil.copytree(prepared, folder / "prepared")
    nodes: list[subprocess.Popen] = []

    def stop() -> None:
        for node in nodes:
            node.send_signal(signal.SIGTERM)

    proxy = CuttingProxy(int(object_store_env(store)["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]), b"-e0001-", stop,
                         then="all")
    env = subprocess_env({**CLONE_ENV, **object_store_env(store, proxy.port)})

    def start(port: int) -> list[subprocess.Popen]:
        return [subprocess.Popen(
            [sys.executable, "-m", "ddpipe.launch",
             *args_for(folder, folder / "prepared", *COMMON, "train.batch_size_per_rank=16", f"paths.checkpoints={url}",
                       "distributed.nproc_per_node=1", "distributed.nnodes=2",
                       f"distributed.rdzv_endpoint=127.0.0.1:{port}", f"distributed.rdzv_id={tmp_path.name}")],
            cwd=ROOT, env=env, stdout=open(folder / "log.txt", "a"), stderr=subprocess.STDOUT,
            start_new_session=True) for folder in folders]

    nodes += start(free_port())
    try:
        codes = [node.wait(timeout=300) for node in nodes]
    finally:
        kill_all(str(tmp_path))
    text = "".join((folder / "log.txt").read_text() for folder in folders)
    assert proxy.acted.is_set() and codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], text[-4000:]
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
    headers and half its body (``then="half"``; none of it with ``"nothing"``), then calls ``act()`` (which kills the
    store), drops every connection and stops listening: to the training, the store died in the middle of that upload
    (or as it began). With ``then="all"`` it calls ``act()`` (a signal to the training) and passes that upload and
    every later request on. It acts inside the upload, so however fast the training runs, nothing after it has
    happened yet; :meth:`reopen` listens on the same port again (the store back)."""

    def __init__(self, target: int, cut_at: bytes, act: Callable[[], None], then: str = "half") -> None:
        assert then in ("half", "nothing", "all"), then
        self.target, self.cut_at, self.act, self.then = target, cut_at, act, then
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.done, self.acted = threading.Event(), threading.Event()  # cut; act() called
        threading.Thread(target=self._accept, daemon=True).start()

    def reopen(self) -> None:
        """Forward again, on the same port, every request (the cut made once)."""
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.cut_at, self.done = b"\0", threading.Event()
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
                    if cutting and self.then == "all":
                        self.cut_at, cutting = b"\0", False
                        self.act()
                        self.acted.set()
                    elif cutting and self.then == "nothing":
                        self._cut()
                        return
                    upstream.sendall(head)
        except OSError:
            pass

    def _cut(self) -> None:
        self.done.set()
        self.act()
        self.acted.set()
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


def stated_time(tmp: Path, seconds: float) -> dict[str, str]:
    """The environment in which every Python process (the launcher, torchrun, its workers) reads
    ddpipe.core.objectstore.STORE_OUTAGE_S as ``seconds``: a sitecustomize on PYTHONPATH, a process tree's
    monkeypatch."""
    site = tmp / "stated-time"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"from ddpipe.core import objectstore\n"
                                           f"objectstore.STORE_OUTAGE_S = {float(seconds)!r}\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH"))))}


@pytest.mark.slow
def test_a_store_killed_during_a_checkpoint_upload_leaves_the_last_whole_one_and_the_training_resumes_there(
        tmp_path: Path, prepared: Path, uninterrupted: dict[str, torch.Tensor],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The store (one of its own) is SIGKILLed when half of epoch 2's step-8 checkpoint has gone up, and stays away
    past the time a training waits for it (STORE_OUTAGE_S, 5 s here). The training retries with backoff, then stops,
    naming the store, how long it was away, the checkpoint not written and the newest whole one there; the launcher
    exits 75 (EXIT_PREEMPTED: a scheduler runs it again). The store, started again, holds no part of that checkpoint;
    the same command resumes from the whole one before it (step 4) and ends with the weights of the run straight
    through."""
    from deploy.object_store import start, state

    own = start_object_store(tmp_path_factory.mktemp("killed-store"))
    served = state(own)
    port = int(served["endpoint"].rsplit(":", 1)[1])
    url = f"s3://ddpipe/checkpoints/{tmp_path.name}"
    proxy = CuttingProxy(port, b"-e0001-s000008", lambda: os.killpg(served["pid"], signal.SIGKILL))
    cmd = [sys.executable, "-m", "ddpipe.launch", *args_for(tmp_path, prepared, *ONE, f"paths.checkpoints={url}")]
    try:
        cut = run(cmd, env={**CLONE_ENV, **object_store_env(own, proxy.port), **stated_time(tmp_path, 5)},
                  check=False, timeout=300)
        said = cut.stdout + cut.stderr
        assert proxy.done.is_set() and cut.returncode == EXIT_PREEMPTED, said[-4000:]
        assert "writing ckpt-" in said and f"-e0001-s000008.pt to {url}" in said, said[-4000:]
        store_words = f"the store of paths.checkpoints ({url}, endpoint http://127.0.0.1:{proxy.port})"
        assert f"ddpipe.launch: {store_words} has been away for " in said, said[-4000:]
        assert "the checkpoint at step 8 of epoch 2 is not written (writing ckpt-" in said, said[-4000:]
        assert "failed 6 times over 15.5 s" in said, said[-4000:]
        assert re.search(r"; the newest whole checkpoint there is ckpt-\w+-e0001-s000004\.pt", said), said[-4000:]
        assert "objectstore.py" not in said, said[-4000:]  # no traceback of ours (torchrun prints its summary)

        start(own, port, "ddpipe")  # the store again, on its data
        names = _names(own, url)
        assert any("-e0001-s000004.pt" in n for n in names) and not any("-e0001-s000008" in n for n in names), names
        resumed = run(cmd, env={**CLONE_ENV, **object_store_env(own)})
        assert "at epoch 2, step 4" in resumed.stdout + resumed.stderr, (resumed.stdout + resumed.stderr)[-3000:]
        assert same_weights(weights(tmp_path / "model.pt"), uninterrupted)
    finally:
        run([sys.executable, str(ROOT / "deploy" / "object_store.py"), "stop", "--dir", str(own)], check=False)


# How long the store is away in the test of an outage in mid-training: the minute that, before issue 69, cost the job
OUTAGE_S = 60


@pytest.mark.slow
def test_a_store_away_for_a_minute_in_mid_training_is_a_pause_and_the_run_ends_as_if_never_stopped(
        tmp_path: Path, prepared: Path, uninterrupted: dict[str, torch.Tensor],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The store (one of its own) is SIGKILLed once the first checkpoint of epoch 2 is in it, as the second begins to
    go up (a proxy in front of it does it then: a test polling the store could see the first too late on a fast or
    busy host, after the training had ended), and started again on its data and port a minute later. Meanwhile the
    training goes on to its end, saying once that the store is away and its checkpoints are skipped, then waits for
    the store to take its last one; the store back, it says so, writes it and ends 0 with the weights of the run
    straight through. The store holds the checkpoints written before the outage and the last one, each whole, and
    none of those the outage skipped."""
    from deploy.object_store import start, state

    own = start_object_store(tmp_path_factory.mktemp("away-store"))
    served = state(own)
    port = int(served["endpoint"].rsplit(":", 1)[1])
    url = f"s3://ddpipe/checkpoints/{tmp_path.name}"
    before: set[str] = set()

    def outage() -> None:  # what the store held, then the store gone
        before.update(n for n in _names(own, url) if n.startswith("ckpt-"))
        os.killpg(served["pid"], signal.SIGKILL)

    proxy = CuttingProxy(port, b"-e0001-s000008", outage, then="nothing")
    cmd = [sys.executable, "-m", "ddpipe.launch", *args_for(tmp_path, prepared, *ONE, f"paths.checkpoints={url}")]
    with open(tmp_path / "log.txt", "w") as log:
        env = subprocess_env({**CLONE_ENV, **object_store_env(own, proxy.port)})
        training = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        deadline = time.time() + 300
        while not proxy.acted.wait(0.05) and training.poll() is None and time.time() < deadline:
            pass
        assert proxy.acted.is_set() and any("-e0001-s000004" in n for n in before), \
            (before, (tmp_path / "log.txt").read_text()[-4000:])
        time.sleep(OUTAGE_S)
        assert training.poll() is None, (tmp_path / "log.txt").read_text()[-4000:]  # waiting for the store
        start(own, port, "ddpipe")  # the store again, on its data and port
        proxy.reopen()
        code = training.wait(timeout=300)
        said = (tmp_path / "log.txt").read_text()
        assert code == 0, said[-4000:]
        store_words = f"the store of paths.checkpoints ({url}, endpoint http://127.0.0.1:{proxy.port})"
        order = [said.find(f"{store_words} is away since"), said.find("epoch 3/3:"),
                 said.find("waiting for it to take the checkpoint after epoch 3"),
                 said.find(f"{store_words} is back after")]
        assert -1 not in order and order == sorted(order), (order, said[-4000:])  # it trained on meanwhile
        assert said.count("is not written; the training goes on") == 1, said[-4000:]  # said once
        assert int(re.search(r"is back after (\d+) s", said)[1]) >= OUTAGE_S - 20, said[-4000:]  # type: ignore[index]
        assert same_weights(weights(tmp_path / "model.pt"), uninterrupted)
        after = {n for n in _names(own, url) if n.startswith("ckpt-")}
        (last,) = [n for n in after if "-e0003-s000000" in n]
        assert before < after and not any("-e0002-" in n for n in after), after  # epoch 3's were skipped
        fp, place = last.split("-")[1], StoreFolder(url, _store(own))
        assert load_latest(place, fp)[0] == Position(3, 0)  # type: ignore[index]
        assert all(torch.load(io.BytesIO(place.read(n)), weights_only=True)["fingerprint"] == fp
                   for n in after)  # each whole
    finally:
        kill_all(str(tmp_path))
        run([sys.executable, str(ROOT / "deploy" / "object_store.py"), "stop", "--dir", str(own)], check=False)


def test_a_store_that_never_comes_back_is_a_pause_until_its_stated_time_then_every_rank_stops(
        store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """A Checkpointer whose store goes away after its first checkpoint and never comes back (a proxy in front of it,
    closed), the stated time (STORE_OUTAGE_S) shrunk to 3 s: the next checkpoint is skipped, said once naming the
    store and the newest whole checkpoint there, and the training goes on; its last checkpoint is waited for until
    3 s after the store went away, then StoreAway names the store, how long it was away, the checkpoint not written
    and that newest whole one, as it does at a checkpoint due after that. The store holds that first checkpoint
    alone, whole, with the weights it was written with."""
    from ddpipe.core import objectstore

    monkeypatch.setattr(objectstore, "STORE_OUTAGE_S", 3.0)
    monkeypatch.setattr(objectstore, "RETRY_DELAYS_S", (0.05,))  # a refused request takes 0.2-0.4 s here
    port = int(object_store_env(store)["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    proxy = CuttingProxy(port, b"\0", lambda: None)  # cuts no upload: closed below, by hand
    for name, value in object_store_env(store, proxy.port).items():
        monkeypatch.setenv(name, value)
    url, fp = f"s3://ddpipe/never-back/{tmp_path.name}", "0123456789ab"
    model = torch.nn.Linear(4, 2)
    saver = Checkpointer(url, fp, keep=10, info=DistInfo())
    saver.save(Position(0, 4), {"model": model})
    written = {k: v.clone() for k, v in model.state_dict().items()}
    proxy._cut()  # the store is away, for good
    with torch.no_grad():
        model.weight.add_(1.0)
    saver.save(Position(0, 8), {"model": model})  # skipped: the training goes on
    said = capsys.readouterr().err
    store_words = f"the store of paths.checkpoints ({url}, endpoint http://127.0.0.1:{proxy.port})"
    newest = f"the newest whole checkpoint there is ckpt-{fp}-e0000-s000004.pt"
    assert f"{store_words} is away since" in said and newest in said, said
    assert "the checkpoint at step 8 of epoch 1 is not written; the training goes on" in said, said
    started = time.monotonic()
    with pytest.raises(StoreAway) as stopped:
        saver.flush()
    assert time.monotonic() - started < 8, "the wait ends 3 s after the store went away"
    assert "waiting for it to take the checkpoint at step 8 of epoch 1" in capsys.readouterr().err
    why = str(stopped.value)
    assert re.match(rf"{re.escape(store_words)} has been away for \d+ s \(since [\d:]+\), 3 s or more", why), why
    assert "the checkpoint at step 8 of epoch 1 is not written (" in why and newest in why, why
    with pytest.raises(StoreAway, match="the checkpoint at step 12 of epoch 1 is not written"):
        saver.save(Position(0, 12), {"model": model})
    place = StoreFolder(url, _store(store))
    assert place.names() == [f"ckpt-{fp}-e0000-s000004.pt"]
    pos, state = load_latest(place, fp)
    assert pos == Position(0, 4) and same_weights(state["model"], written)


def test_a_training_stopped_for_its_store_exits_75_and_so_does_its_launcher(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """A worker stopped by StoreAway says why and exits 75, leaving the reason for its launcher, whose torchrun exits
    1 whatever its workers' codes: the launcher says it again and exits 75, which SLURM's scripts and the Kubernetes
    jobs requeue on. Without that note, torchrun's code stands."""
    from ddpipe.core.environment import PAUSE_NOTE_ENV
    from ddpipe.launch import torchrun, worker

    note = tmp_path / "paused"
    monkeypatch.setenv(PAUSE_NOTE_ENV, str(note))
    why = "the store of paths.checkpoints (s3://ddpipe/x, endpoint http://127.0.0.1:1) has been away for 301 s"
    with pytest.raises(SystemExit) as ended:
        worker.paused(why)
    assert ended.value.code == EXIT_PREEMPTED and f"training stopped: {why}" in capsys.readouterr().err
    assert torchrun.paused(1, note) == EXIT_PREEMPTED and f"ddpipe.launch: {why}" in capsys.readouterr().err
    assert torchrun.paused(0, note) == 0 and torchrun.paused(1, tmp_path / "no-note") == 1


def test_a_store_that_is_down_refuses_the_key_or_lacks_the_bucket_is_named_before_training(
        tmp_path: Path, prepared: Path, store: Path) -> None:
    """One request before any worker starts: the setting, the URL, the endpoint and what is wrong; exit 2, no
    traceback, nothing written."""
    def refused(url: str, **env: str) -> str:
        cmd = [sys.executable, "-m", "ddpipe.launch", *args_for(tmp_path, prepared, *ONE, f"paths.checkpoints={url}")]
        empty_store = (tmp_path / "mlflow.db").read_bytes()  # conftest's migrated copy, not yet opened
        said = run(cmd, env={**CLONE_ENV, **object_store_env(store), **env}, check=False)
        assert said.returncode == 2 and "Traceback" not in said.stderr, said.stderr[-3000:]
        assert f"paths.checkpoints ({url}" in said.stderr, said.stderr
        assert not (tmp_path / "model.pt").exists() and (tmp_path / "mlflow.db").read_bytes() == empty_store
        return said.stderr

    assert "refused the credentials" in refused("s3://ddpipe/ckpt", AWS_SECRET_ACCESS_KEY="not-the-secret")
    assert "has no bucket 'no-such-bucket'" in refused("s3://no-such-bucket/ckpt")
    assert "does not answer" in refused("s3://ddpipe/ckpt", AWS_ENDPOINT_URL=f"http://127.0.0.2:{free_port()}")


# A lease's times shortened for the tests (ddpipe.core.store_lease; the store's clock counts whole seconds)
SHORT_LEASE = {"LEASE_RENEW_S": 0.2, "LEASE_TTL_S": 3.0, "LEASE_BACKOFF_S": 0.2}


def _short_leases(monkeypatch: pytest.MonkeyPatch, conditions: str = "honoured") -> None:
    """This process's leases with :data:`SHORT_LEASE`'s times; ``conditions="ignored"``: on a store that ignores
    conditional writes (its client drops the headers, as such a store does)."""
    for name, value in SHORT_LEASE.items():
        monkeypatch.setattr(store_lease, name, value)
    plain = Store.client

    @functools.cache  # one client per store (a new one costs 0.1-0.4 s of CPU), shared by threads as botocore allows
    def client(store: Store) -> Any:
        return _dropping_conditions(plain(store)) if conditions == "ignored" else plain(store)
    monkeypatch.setattr(Store, "client", lambda self: client(self))


def _dropping_conditions(client: Any) -> Any:
    drop = lambda params, **_: [params.pop(k, None) for k in ("IfMatch", "IfNoneMatch")]  # noqa: E731
    client.meta.events.register("before-parameter-build.s3.PutObject", drop)
    return client


def test_one_training_per_checkpoint_place_in_the_store_by_a_lease_renewed_from_its_own_thread(
        store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """A live holder's lease refuses a second training, naming it; one of another host renewed within the lease's time
    too (saying when it lapses); one the store last wrote longer ago than that (by the store's clock), or of a process
    of this host that has ended, is taken over, saying so; the holder renews it on its own; released, it is gone."""
    from dataclasses import asdict, replace

    _short_leases(monkeypatch)
    place = StoreFolder(f"s3://ddpipe/leases/{tmp_path.name}", _store(store))
    first = store_lease.StoreLease.take(place, "paths.checkpoints", "rank 0")
    try:
        beat = json.loads(place.read(store_lease.LEASE_NAME))["beat"]
        time.sleep(0.6)
        assert json.loads(place.read(store_lease.LEASE_NAME))["beat"] > beat  # its thread renews it
        with pytest.raises(claims.InUse, match=rf"in use by another training: pid {os.getpid()}, rank 0"):
            store_lease.StoreLease.take(place, "paths.checkpoints", "rank 0")
    finally:
        first.release()
    assert store_lease.LEASE_NAME not in place.names()

    def leave(holder: claims.Holder) -> None:
        lease = {"holder": asdict(holder), "beat": 1}
        place.write(store_lease.LEASE_NAME, lambda f: f.write(json.dumps(lease).encode()))

    leave(replace(claims.Holder.this("rank 0", "t0"), host="node-elsewhere"))
    with pytest.raises(claims.InUse, match=r"on host node-elsewhere.*lapses [0-3] s from now"):
        store_lease.StoreLease.take(place, "paths.checkpoints", "rank 0")
    deadline = time.monotonic() + 30
    while True:  # lapsed by the store's clock: taken over
        try:
            store_lease.StoreLease.take(place, "paths.checkpoints", "rank 0").release()
            break
        except claims.InUse:
            assert time.monotonic() < deadline, "the lease of node-elsewhere never lapsed"
            time.sleep(0.2)
    assert "taking over" in (said := capsys.readouterr().err) and "s ago by the store's clock" in said, said
    leave(replace(claims.Holder.this("rank 0", "t2"), pid=2**22 + 7))  # a process of this host that has ended
    store_lease.StoreLease.take(place, "paths.checkpoints", "rank 0").release()
    assert "taking over" in capsys.readouterr().err


# A training's rank 0 as far as the store sees it: it takes the lease (its times SHORT_LEASE's, passed as arguments)
# and writes a checkpoint every 0.2 s through save_checkpoint; it stops as ddpipe.launch.worker does on LeaseLost.
HOLDER = textwrap.dedent("""
    import sys, time
    import torch
    from ddpipe.core import store_lease
    from ddpipe.core.objectstore import Store, StoreFolder
    from ddpipe.engine.checkpoint import Position, save_checkpoint

    endpoint, key_id, secret, url, conditions, renew, ttl, backoff = sys.argv[1:]
    store_lease.LEASE_RENEW_S, store_lease.LEASE_TTL_S = float(renew), float(ttl)
    store_lease.LEASE_BACKOFF_S = float(backoff)
    if conditions == "ignored":  # a store that ignores conditional writes: the headers never reach it
        plain = Store.client
        def client(self):
            c = plain(self)
            c.meta.events.register("before-parameter-build.s3.PutObject",
                                   lambda params, **_: [params.pop(k, None) for k in ("IfMatch", "IfNoneMatch")])
            return c
        Store.client = client
    place = StoreFolder(url, Store(endpoint, key_id, secret))
    store_lease.StoreLease.take(place, "paths.checkpoints", "rank 0")
    step = 0
    try:
        while True:
            save_checkpoint(place, "0123456789ab", Position(0, step), {"step": torch.tensor(step)}, keep=1000)
            print(f"wrote step {step}", flush=True)
            step += 1
            time.sleep(0.2)
    except store_lease.LeaseLost as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
""")


@pytest.mark.parametrize("conditions", ["honoured", pytest.param("ignored", marks=pytest.mark.slow)])
def test_a_holder_frozen_past_its_lease_stops_at_its_next_checkpoint_naming_the_new_holder_and_writes_nothing(
        store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, conditions: str) -> None:
    """A training (rank 0 writing a checkpoint every 0.2 s, its lease's time 3 s) is SIGSTOPped between two
    checkpoints; a training on another host is refused until the lease lapses by the store's clock, then takes it
    over. SIGCONTed, the first stops at its next checkpoint within seconds, exit 1, naming the new holder, and writes
    nothing more to the store. On a store that honours conditional writes and on one that ignores them."""
    _short_leases(monkeypatch, conditions)
    url, env = f"s3://ddpipe/frozen/{tmp_path.name}", object_store_env(store)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, env["AWS_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"],
         url, conditions, *(str(v) for v in SHORT_LEASE.values())],
        cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not (line := holder.stdout.readline()).startswith("wrote step 2"):  # type: ignore[union-attr]
            assert line, holder.stderr.read()  # type: ignore[union-attr]
        holder.send_signal(signal.SIGSTOP)  # in its 0.2 s between two checkpoints
        place = StoreFolder(url, _store(store))
        monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
        deadline = time.monotonic() + 30
        while True:
            try:
                taker = store_lease.StoreLease.take(place, "paths.checkpoints", "rank 0")
                break
            except claims.InUse as refused:
                assert "lapses" in str(refused) and time.monotonic() < deadline, str(refused)
                time.sleep(0.2)
        try:
            written = sorted(n for n in place.names() if n.startswith("ckpt-"))
            holder.send_signal(signal.SIGCONT)
            try:
                _, said = holder.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                pytest.fail(f"thawed, the first holder went on: {len(written)} checkpoints before, "
                            f"{len([n for n in place.names() if n.startswith('ckpt-')])} now")
            assert holder.returncode == 1, said
            assert (f"is no longer this training's: another training holds it now: pid {os.getpid()} on host node-b"
                    in said), said
            assert sorted(n for n in place.names() if n.startswith("ckpt-")) == written  # nothing after the thaw
            taker.check()  # the new holder's, still
        finally:
            taker.release()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("conditions", ["honoured", pytest.param("ignored", marks=pytest.mark.slow)])
def test_of_four_trainings_on_four_hosts_started_at_once_exactly_one_takes_the_lease(
        store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, conditions: str) -> None:
    """Four trainings (threads, each with a host name of its own) take the lease at the same moment, 20 times over,
    on no lease and on one left unreadable (a dead one): each time exactly one holds it, and the three others are
    refused naming it. On a store that honours conditional writes and on one that ignores them."""
    _short_leases(monkeypatch, conditions)
    host, real = threading.local(), socket.gethostname()
    monkeypatch.setattr(socket, "gethostname", lambda: getattr(host, "name", real))
    place = StoreFolder(f"s3://ddpipe/contended/{tmp_path.name}", _store(store))
    together = threading.Barrier(4)

    def contend(i: int, got: dict[int, object]) -> None:
        host.name = f"node-{i}"
        together.wait()
        try:
            got[i] = store_lease.StoreLease.take(place, "paths.checkpoints", "rank 0", say=lambda _: None)
        except claims.InUse as refused:
            got[i] = refused

    for round_ in range(20):
        if round_ % 2:  # a dead one's lease (its claim, where the store ignores conditional writes)
            left = store_lease.LEASE_NAME if conditions == "honoured" else f"{store_lease.LEASE_NAME}.claim-left"
            place.write(left, lambda f: f.write(b"not a lease"))
        got: dict[int, object] = {}
        threads = [threading.Thread(target=contend, args=(i, got)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        (lease,) = [g for g in got.values() if isinstance(g, store_lease.StoreLease)]
        refusals = [str(g) for g in got.values() if isinstance(g, claims.InUse)]
        assert len(refusals) == 3 and all(f"on host {lease.me.host}," in r for r in refusals), (round_, refusals)
        lease.release()
        assert not [n for n in place.names() if n.startswith(store_lease.LEASE_NAME)]


def test_conditional_writes_go_as_headers_where_botocore_lacks_their_parameters(
        store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A botocore older than 1.36 has no IfNoneMatch or IfMatch on put_object: the lease's client sends them as
    headers, and the store honours them as it honours botocore's own."""
    from botocore.exceptions import ClientError

    client = _store(store).client()
    members = client.meta.service_model.operation_model("PutObject").input_shape.members
    for name in ("IfMatch", "IfNoneMatch"):
        monkeypatch.delitem(members, name)
    client, key = store_lease._conditional_client(client), f"headers/{tmp_path.name}"
    first = client.put_object(Bucket="ddpipe", Key=key, Body=b"1", IfNoneMatch="*")
    for condition in ({"IfNoneMatch": "*"}, {"IfMatch": '"00000000000000000000000000000000"'}):
        with pytest.raises(ClientError, match="PreconditionFailed"):
            client.put_object(Bucket="ddpipe", Key=key, Body=b"2", **condition)
    client.put_object(Bucket="ddpipe", Key=key, Body=b"3", IfMatch=first["ETag"])


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


def _kept_of_run(client: Any, run_id: str, registered: str, into: Path) -> dict[str, bytes]:
    """Everything a tracking server keeps of run ``run_id``, by where: the run (params, tags, metrics, dataset
    inputs), its experiment, its logged models (params, tags) and registered versions of ``registered``, and every
    file of the run's artifacts and of its logged models, downloaded into ``into``."""
    import mlflow

    run = client.get_run(run_id)
    experiment = client.get_experiment(run.info.experiment_id)
    kept = {"the run": json.dumps(run.to_dictionary(), default=str).encode(),
            "its experiment": json.dumps([experiment.name, experiment.tags, experiment.artifact_location]).encode()}
    places = {"run artifacts": mlflow.artifacts.download_artifacts(run_id=run_id, dst_path=str(into / "run"))}
    for model in client.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'"):
        kept[f"logged model {model.name}"] = json.dumps(model.to_dictionary(), default=str).encode()
        places[f"logged model {model.name}"] = mlflow.artifacts.download_artifacts(
            artifact_uri=model.artifact_location, dst_path=str(into / model.model_id))
    for version in client.search_model_versions(f"name = '{registered}'"):
        kept[f"version {version.version}"] = json.dumps([version.tags, version.source, version.description]).encode()
    kept["registered model"] = json.dumps(client.get_registered_model(registered).tags).encode()
    for where, folder in places.items():
        files = [f for f in Path(folder).rglob("*") if f.is_file()]
        kept.update({f"{where}: {f.relative_to(folder)}": f.read_bytes() for f in files})
    assert any(name.endswith("MLmodel") for name in kept), sorted(kept)  # the model's files were read
    return kept


@pytest.mark.slow
def test_the_tracking_server_keeps_a_registered_models_files_in_the_bucket_and_serves_them(
        tmp_path: Path, prepared: Path, store: Path) -> None:
    """deploy/tracking_server.py with ``--artifacts-destination s3://ddpipe/mlflow`` (its keys from the environment
    here, from the DVC remote in a clone): a training that holds the server's password and the store's keys (its
    checkpoints in the bucket, as the no-shared-disk TrainJob's) logs and registers its model through the server, whose
    files land in the bucket, and nothing the server keeps of it (params, tags, the experiment's, the logged model's,
    the version's, every artifact's bytes) holds the password or a key; a client with the server's URL and a password,
    and no key of the store, loads version 1 and predicts. A wrong key is named before the server starts."""
    import mlflow
    import numpy as np

    script, port, admin = str(ROOT / "deploy" / "tracking_server.py"), free_port(), "admin-pw-0123456789"
    server = [sys.executable, script, "start", "--dir", str(tmp_path / "server"), "--port", str(port),
              "--backend-store-uri", f"sqlite:///{tmp_path / 'server' / 'mlflow.db'}",
              "--artifacts-destination", "s3://ddpipe/mlflow", "--workers", "1"]
    env = {**object_store_env(store), "MLFLOW_AUTH_ADMIN_PASSWORD": admin}
    wrong = run(server, env={**env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}, check=False)
    assert wrong.returncode != 0 and "--artifacts-destination (s3://ddpipe/mlflow" in wrong.stderr, wrong.stderr
    assert "refused the credentials" in wrong.stderr and not (tmp_path / "server" / "mlflow-server.pid").exists()
    run(server, env=env, timeout=300)
    try:
        url = f"http://127.0.0.1:{port}"
        client = {"MLFLOW_TRACKING_URI": url, "MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": admin}
        trained = run([sys.executable, "-m", "ddpipe.launch",
                       *args_for(tmp_path, prepared, "num_epochs=1", "distributed.nproc_per_node=1",
                                 f"mlflow.tracking_uri={url}", "mlflow.log_model=true",
                                 "mlflow.registered_model_name=store-model",
                                 f"paths.checkpoints=s3://ddpipe/checkpoints/{tmp_path.name}")],
                      env={**CLONE_ENV, **client, **object_store_env(store)})
        objects = StoreFolder("s3://ddpipe", _store(store)).fs.find("ddpipe/mlflow")
        assert any(o.endswith("/MLmodel") for o in objects) and any(o.endswith("/model.pt") for o in objects), objects
        os.environ.update(client)  # restored by conftest's autouse fixture; no key of the store here
        mlflow.set_tracking_uri(url)
        run_id = json.loads((tmp_path / "run.json").read_text())["run_id"]
        kept = _kept_of_run(mlflow.MlflowClient(url), run_id, "store-model", tmp_path / "kept")
        kept["the training's output"] = (trained.stdout + trained.stderr).encode()
        kept.update({f"outbox: {f.name}": f.read_bytes() for f in (tmp_path / "outbox").rglob("*") if f.is_file()})
        secrets = {"the admin's password": admin, **{name: value for name, value in object_store_env(store).items()
                                                     if name != "AWS_ENDPOINT_URL"}}
        leaks = [f"{where} holds {what}" for where, data in kept.items() for what, secret in secrets.items()
                 if secret.encode() in data]
        assert not leaks, leaks
        model = mlflow.pyfunc.load_model("models:/store-model/1")
        answers = model.predict(np.zeros((3, 28, 28), dtype=np.uint8))
        assert len(answers) == 3 and set(answers.columns) >= {"label", "probability"}
    finally:
        run([sys.executable, script, "stop", "--dir", str(tmp_path / "server")], check=False)
