"""Registered models by alias (MLflow's successor to registry stages). Each version carries the figures that decide
the alias: the validation accuracy of its exported model (``model_val_accuracy``, the train stage's, of the epoch and
weights it exported: ``ddpipe.engine.meters.EpochStats.of_weights``, the same figure a search's trial is scored by)
and the digest of the validation split it was measured on; its test accuracy and that split's digest (the evaluate
stage); and whether its exports passed their check (the export stage). The alias (``mlflow.champion_alias``, e.g.
``champion``) goes to the version with the best validation figure among those measured on one validation split whose
exports passed; the test only vetoes (``mlflow.champion_max_test_drop``: a version whose test accuracy falls that far
below its validation accuracy never takes it) and is shown beside: ranking versions by test accuracy would select on
the test split.

    mlflow models serve -m models:/NAME@champion --env-manager local     # with the server's address and credentials

The evaluate stage's outbox record is delivered by :func:`record_test` (which registers the run's model first when its
training did not: a search's trial); the export stage's by :func:`record_export`, which decides, one decision at a
time for every host that shares the tracking server (:func:`alias_lock`); each says in the log what it did and why.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from ddpipe.core.metric_names import MODEL_VAL_ACCURACY, TEST_ACCURACY, TEST_SPLIT, VAL_SPLIT
from ddpipe.data.store import SPLITS

logger = logging.getLogger(__name__)

# The alias's lock (alias_lock): a registered model, which the server's database holds once (a unique name), renewed
# every LOCK_STALE_S/3 while held. One not renewed for LOCK_STALE_S by the server's clock was left by a process that
# died deciding (a decision takes a second); a waiter gives up after LOCK_WAIT_S, saying who holds it.
LOCK_STALE_S, LOCK_WAIT_S, LOCK_POLL_S = 120.0, 300.0, 0.2


def split_digest(prepared: str | Path, split: str) -> str:
    """sha256 of a prepared split's files (labels, pixels or shards and index) and meta's classes: two versions'
    figures on ``split`` (test or val) compare only when this is equal."""
    directory = Path(prepared)
    h = hashlib.sha256()
    others = tuple(s for s in SPLITS if s != split)
    for path in sorted(directory.iterdir()):
        if path.name.startswith(split) and not path.name.startswith(others):
            h.update(path.name.encode())
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    h.update((directory / "meta.json").read_bytes() if (directory / "meta.json").is_file() else b"")
    return h.hexdigest()[:16]


def record_test(client: Any, run_id: str, rec: dict) -> None:
    """Tag the version registered from ``run_id`` (registered now if its training did not) with its test accuracy
    and the test split's digest: the figure shown beside the alias's decision, and its veto. Moves nothing."""
    name = rec["model_name"]
    version = _version_of(client, name, run_id, "test accuracy", quiet=True) or _register(client, name, run_id)
    if version is None:
        return
    client.set_model_version_tag(name, version, TEST_ACCURACY, f"{float(rec[TEST_ACCURACY]):.6f}")
    client.set_model_version_tag(name, version, TEST_SPLIT, rec["split"])


def _version_of(client: Any, name: str, run_id: str, what: str, quiet: bool = False) -> str | None:
    """The newest version of ``name`` registered from ``run_id``; None (said, unless ``quiet``) when there is none."""
    versions = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    if not versions:
        if not quiet:
            logger.info(f"MLflow: no version of registered model {name!r} comes from run {run_id}; {what} not recorded "
                        "on the registry")
        return None
    return str(max(int(v.version) for v in versions))


def _register(client: Any, name: str, run_id: str) -> str | None:
    """A new version of ``name`` from the model ``run_id`` logged (``model``), tagged as the train stage tags the
    versions it registers; None, said, when the run holds no such model. A search's trial trains without registering
    (issue 47: N trials would be N versions, and the alias would follow the best of them on the test split): the
    chosen trial's version is made here, by its one evaluation."""
    run = client.get_run(run_id)
    found = [m for m in client.search_logged_models([run.info.experiment_id],
                                                    filter_string=f"source_run_id = '{run_id}' AND name = 'model'")
             if str(m.status).upper().endswith("READY")]
    if not found:
        logger.info(f"MLflow: run {run_id} holds no logged model to register as {name!r}; its test accuracy is not "
                    "recorded on the registry")
        return None
    model = max(found, key=lambda m: m.creation_timestamp)
    if not client.search_registered_models(f"name = '{name}'"):
        client.create_registered_model(name)
    tags = {"dvc_exp_name": run.data.tags.get("dvc_exp_name", ""), "git_commit": run.data.tags.get("git_commit", ""),
            "run_id": run_id}
    version = client.create_model_version(name, source=f"models:/{model.model_id}", run_id=run_id, tags=tags,
                                          model_id=model.model_id)
    logger.info(f"MLflow: registered version {version.version} of {name!r} from run {run_id} (its model was logged "
                "unregistered, as a search's trial logs it)")
    return str(version.version)


def record_export(client: Any, run_id: str, rec: dict, uris: dict[str, str]) -> None:
    """Tag the version registered from ``run_id`` with its exports' check (``export_passed`` and each format's
    figures), where they were logged (``uris``) and its exported model's validation accuracy and split; then, when
    they passed, decide ``rec['alias']`` (:func:`decide`) under :func:`alias_lock`. A version whose exports failed
    never takes the alias. Prints what it did."""
    name, alias, passed = rec["model_name"], rec.get("alias"), bool(rec["passed"])
    version = _version_of(client, name, run_id, "the export's check")
    if version is None:
        return
    client.set_model_version_tag(name, version, "export_passed", str(passed).lower())
    for key, value in {**rec.get("figures", {}), **uris}.items():
        client.set_model_version_tag(name, version, f"export_{key}", str(value))
    if rec.get(MODEL_VAL_ACCURACY) is not None:
        client.set_model_version_tag(name, version, MODEL_VAL_ACCURACY, f"{float(rec[MODEL_VAL_ACCURACY]):.6f}")
        client.set_model_version_tag(name, version, VAL_SPLIT, rec[VAL_SPLIT])
    if not passed:
        logger.info(f"MLflow: version {version} of {name!r} keeps no alias: its export failed its check ({rec['why']})")
        return
    if alias:
        with alias_lock(client, name, alias):
            decide(client, name, alias, version, float(rec.get("max_test_drop", 0.05)))


@contextlib.contextmanager
def alias_lock(client: Any, name: str, alias: str) -> Iterator[None]:
    """Hold the decision about ``name@alias`` for every process on every host that shares the tracking server
    (issue 69, item 4). MLflow offers one atomic write, a registered model's creation (its name is unique in the
    server's database), and no conditional delete; the lock is built on the first alone:

    - the lock is the registered model ``ddpipe-lock.<name>.<alias>``, tagged with its holder's fresh token; whoever
      creates it holds it. The holder renews it every :data:`LOCK_STALE_S`/3 (a description write: the server stamps
      its ``last_updated_timestamp``) while its token is still the lock's;
    - a lock, or any claim of this scheme, of token T is deleted only by whoever created the marker
      ``ddpipe-lock.<name>.<alias>.after.<T>`` and, holding it, read T on it again; the holder's release and a
      waiter's takeover go the same way, and the marker is deleted last. Two waiters on one stale lock race to create
      its marker and the server lets one win; the other takes nothing. The winner's re-read and delete cannot hit a
      newer lock: while it holds the marker no one else can delete the lock of token T, so no newer one exists. A
      marker created late (after the lock of T is gone) reads another token, deletes nothing and goes. A holder that
      finds the lock no longer its own says so and leaves the new one alone;
    - a lock is stale when the server's clock, read from a write on the waiter's own registered model
      (``...clock.<token>``, deleted on leaving), stands :data:`LOCK_STALE_S` past the lock's last renewal: two
      timestamps of one clock, never this host's against the server's. A marker left by a remover that died is
      removed the same way once stale.

    As with every lease, a holder stalled past :data:`LOCK_STALE_S` between its check and its write (a frozen host)
    can still act once after its lock was taken over; its release then says so. Every decision reads every version's
    tags after the last one's write, so exports finishing at once on any hosts end with the best eligible version on
    the alias. TimeoutError after :data:`LOCK_WAIT_S`, naming the holder."""
    lock, token = f"ddpipe-lock.{name}.{alias}", uuid.uuid4().hex
    holder = f"{socket.gethostname()} pid {os.getpid()}"
    about = f"ddpipe: held while {holder} decides {name}@{alias}; removed when it is done"
    with _ServerClock(client, f"{lock}.clock.{token}", holder) as clock:
        deadline = time.monotonic() + LOCK_WAIT_S
        while _create(client, lock, token, holder, about) is None:
            held = _claim(client, lock)
            if held is None:  # released in between: try again at once
                continue
            stale = clock.estimate_ms() - held.renewed_ms > LOCK_STALE_S * 1000 and _stale(client, lock, clock)
            if stale and _remove(client, lock, lock, stale.token, clock):
                logger.info(f"MLflow: took over the decision on {name}@{alias} from {stale.holder}, whose lock was "
                            f"last renewed {stale.age_s:.0f} s ago by the server's clock")
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"MLflow: {name}@{alias} is being decided by {held.holder} (registered model "
                                   f"{lock!r}, renewed {(clock.estimate_ms() - held.renewed_ms) / 1000:.0f} s ago); "
                                   "the alias was not decided")
            time.sleep(LOCK_POLL_S)
    try:
        with _renewed(client, lock, token, about):
            yield
    finally:
        _release(client, name, alias, lock, token)


def _release(client: Any, name: str, alias: str, lock: str, token: str) -> None:
    """Delete ``lock`` if it still carries ``token`` (:func:`_remove`); said when it did not, or could not."""
    from mlflow.exceptions import MlflowException

    try:
        released = _remove(client, lock, lock, token, None)
    except MlflowException as exc:  # the decision stands; a waiter takes the lock over once it is stale
        logger.warning(f"MLflow: could not release the lock on {name}@{alias} ({exc.message}); it is taken over "
                       f"{LOCK_STALE_S:.0f} s after its last renewal")
        return
    if not released:
        logger.warning(f"MLflow: the lock on {name}@{alias} was taken over while this decision ran (not renewed for "
                       f"{LOCK_STALE_S:.0f} s): another decision may have overlapped it; export again to decide anew")


class _Claim(NamedTuple):
    """A registered model of the lock's scheme as read: its token, who made it, when the server last stamped it."""

    token: str
    holder: str
    renewed_ms: int
    age_s: float = 0.0


def _claim(client: Any, name: str) -> _Claim | None:
    """The registered model ``name`` as a claim, None when there is none; read until two reads in a row agree. MLflow
    reads a model's row and its tags in two queries: one read can pair a deleted lock's stamp with its successor's
    token (CI at f2bafc4), and the next then shows the successor's own, later stamp, as tags are written with rows."""
    from mlflow.exceptions import MlflowException

    def read() -> _Claim | None:
        try:
            model = client.get_registered_model(name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            return None
        tags = model.tags
        return _Claim(tags.get("ddpipe.lock", ""), tags.get("holder", "?"), int(model.last_updated_timestamp))

    last = read()
    while (again := read()) != last:
        last = again
    return last


def _create(client: Any, name: str, token: str, holder: str, about: str) -> int | None:
    """Create the registered model ``name`` carrying ``token``: the server's time of its creation, or None when one
    of that name exists (the server's unique name decides between creators)."""
    from mlflow.exceptions import MlflowException

    try:
        model = client.create_registered_model(name, tags={"ddpipe.lock": token, "holder": holder}, description=about)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return None
    return int(model.creation_timestamp)


def _delete(client: Any, name: str) -> None:
    """Delete the registered model ``name``; one already gone is no error."""
    from mlflow.exceptions import MlflowException

    try:
        client.delete_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise


def _stale(client: Any, name: str, clock: _ServerClock) -> _Claim | None:
    """The claim ``name`` when the server's clock, read first, stands over :data:`LOCK_STALE_S` past its last renewal
    (read after: a renewal in between makes it young); None otherwise."""
    now_ms = clock.now_ms()
    held = _claim(client, name)
    if held is None or now_ms - held.renewed_ms <= LOCK_STALE_S * 1000:
        return None
    return held._replace(age_s=(now_ms - held.renewed_ms) / 1000)


def _remove(client: Any, lock: str, name: str, token: str, clock: _ServerClock | None) -> bool:
    """Delete the claim ``name`` if it still carries ``token``, holding its marker ``<lock>.after.<token>`` (created
    by one at a time; :func:`alias_lock` says why that is safe); False when it carries another token, is gone, or
    another remover holds the marker (one that died holding it, stale by ``clock``, is removed the same way)."""
    marker = f"{lock}.after.{token}"
    if _create(client, marker, uuid.uuid4().hex, f"{socket.gethostname()} pid {os.getpid()}",
               f"ddpipe: removing {name!r} if it still carries {token}") is None:
        if clock is not None and (dead := _stale(client, marker, clock)):
            _remove(client, lock, marker, dead.token, clock)
        return False
    try:
        held = _claim(client, name)
        if held is None or held.token != token:
            return False
        _delete(client, name)
        return True
    finally:
        _delete(client, marker)


class _ServerClock:
    """The tracking server's clock as a waiter reads it: the ``last_updated_timestamp`` the server stamps on a write
    to the waiter's own registered model ``name`` (created on first use, deleted on leaving)."""

    def __init__(self, client: Any, name: str, holder: str) -> None:
        self.client, self.name, self.holder = client, name, holder
        self._read: tuple[int, float] | None = None  # (server ms, time.monotonic() when it came back)

    def now_ms(self) -> int:
        """The server's time now, by a write."""
        from mlflow.exceptions import MlflowException

        about = f"ddpipe: {self.holder}'s reading of the server's clock while it waits for a lock"
        try:
            ms = int(self.client.update_registered_model(self.name, description=about).last_updated_timestamp)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            ms = _create(self.client, self.name, "", self.holder, about) or self.now_ms()
        self._read = (ms, time.monotonic())
        return ms

    def estimate_ms(self) -> int:
        """The server's time by its last reading plus the time elapsed here since (an interval, no clock compared);
        low by the reading's latency. Only decides when to read it again: :func:`_stale` judges by a fresh one."""
        if self._read is None:
            return self.now_ms()
        ms, at = self._read
        return ms + int((time.monotonic() - at) * 1000)

    def __enter__(self) -> _ServerClock:
        return self

    def __exit__(self, *exc: object) -> None:
        from mlflow.exceptions import MlflowException

        if self._read is not None:
            with contextlib.suppress(MlflowException):  # a clock left behind is litter; the lock just taken is not
                _delete(self.client, self.name)


@contextlib.contextmanager
def _renewed(client: Any, lock: str, token: str, about: str) -> Iterator[None]:
    """Renew ``lock`` every :data:`LOCK_STALE_S`/3 from a thread while the block runs and the lock carries ``token``
    (a description write; tags leave ``last_updated_timestamp`` alone). Read, then written: the one renewal that
    can land on a successor's lock only makes it look younger, once."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(LOCK_STALE_S / 3):
            try:
                held = _claim(client, lock)
                if held is None or held.token != token:
                    return
                client.update_registered_model(lock, description=about)
            except Exception as exc:  # a server blip: the next period tries again
                logger.warning(f"MLflow: could not renew the lock {lock!r}: {exc}")

    thread = threading.Thread(target=renew, name=f"renew {lock}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _why_not(tags: dict[str, str], split: str | None, max_drop: float) -> str:
    """Why a version's tags keep it from the alias, or "" when they do not."""
    if tags.get("export_passed") != "true":
        return "its exports did not pass their check"
    if MODEL_VAL_ACCURACY not in tags:
        return "it records no validation accuracy of its exported model (trained before ddpipe chose by validation)"
    if tags.get(VAL_SPLIT) != split:
        return "it was measured on another validation split"
    if TEST_ACCURACY not in tags:
        return "it has no test accuracy (run the evaluate stage)"
    drop = float(tags[MODEL_VAL_ACCURACY]) - float(tags[TEST_ACCURACY])
    if drop > max_drop:
        return (f"the test vetoes it: test accuracy {float(tags[TEST_ACCURACY]):.4f} is {drop * 100:.2f} points below "
                f"its validation accuracy {float(tags[MODEL_VAL_ACCURACY]):.4f} (mlflow.champion_max_test_drop = "
                f"{max_drop:g})")
    return ""


def _figures(v: Any) -> str:
    return (f"version {v.version}: validation accuracy {float(v.tags[MODEL_VAL_ACCURACY]):.4f}, test "
            f"{float(v.tags[TEST_ACCURACY]):.4f} beside it")


def decide(client: Any, name: str, alias: str, version: str, max_drop: float) -> None:
    """Move ``name@alias`` to the version whose exported model has the best validation accuracy (the earliest on ties)
    among those measured on ``version``'s validation split that nothing keeps from it (:func:`_why_not`: exports
    passed, a test accuracy that does not veto it); a holder measured on another validation split stays (said, with
    how to move it by hand). Said: what moved, or why not, with each figure."""
    versions = {str(v.version): v for v in client.search_model_versions(f"name = '{name}'")}
    split = versions[version].tags.get(VAL_SPLIT)
    try:
        holder = client.get_model_version_by_alias(name, alias)
    except Exception:  # no holder yet
        holder = None
    if why := _why_not(versions[version].tags, split, max_drop):
        logger.info(f"MLflow: version {version} of {name!r} cannot take {alias!r}: {why}")
    if holder is not None and holder.tags.get(VAL_SPLIT, split) != split:
        logger.info(f"MLflow: {name}@{alias} stays on version {holder.version}: it was measured on another validation "
                    f"split ({holder.tags.get(VAL_SPLIT)} vs {split}). Move it by hand if wanted: MlflowClient()."
                    f"set_registered_model_alias({name!r}, {alias!r}, {version!r})")
        return
    eligible = [v for v in versions.values() if not _why_not(v.tags, split, max_drop)]
    if not eligible:
        logger.info(f"MLflow: {name}@{alias} not moved: no version measured on this validation split may take it")
        return
    best = max(eligible, key=lambda v: (float(v.tags[MODEL_VAL_ACCURACY]), -int(v.version)))
    if holder is not None and str(holder.version) == str(best.version):
        logger.info(f"MLflow: {name}@{alias} stays on {_figures(best)}; the best eligible")
        return
    client.set_registered_model_alias(name, alias, best.version)
    was = f"; was version {holder.version}" if holder is not None else "; the first holder"
    logger.info(f"MLflow: {name}@{alias} -> {_figures(best)}: the best validation accuracy of {len(eligible)} eligible "
                f"version(s){was}")
