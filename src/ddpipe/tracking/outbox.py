"""A run's MLflow records kept on disk until the store has them: nothing is lost while a server is down.

    ddpipe outbox deliver        # send what waits (the next training or evaluate stage does it too)
    ddpipe outbox status         # what waits, per run

Every record a training or the evaluate stage makes for MLflow (params, each epoch's metrics, system metrics,
tags, the end status, the model and the reports) is first appended to a journal, ``<mlflow.outbox>/<run>/<name>
.jsonl`` (one line per record, files copied beside it), and a courier thread sends the journal in order, off the
training's critical path. What the store has is remembered as a byte offset (``<name>.sent``), written after each
delivery, so a record is sent once; one that is sent twice after a crash between the two is harmless, as every
record is idempotent (a metric carries its own timestamp and step, and the store keeps one copy of identical
values; params, tags and statuses are set to the same values; the model is not logged twice).

A store that does not answer (connection refused, a timeout, a 5xx, "database is locked") keeps the records
waiting: the courier retries with backoff and says so once; one that refuses a record for good (a 4xx such as an
invalid value) moves that record to ``<name>.rejected.jsonl`` with the reason, and the rest go on. A run whose
store did not answer when it began is created by its first delivery under a local key (``pending-<hex>``); the
id the store gave it is kept in the journal's directory (``run_id``) for the evaluate stage and the next attempt.
Credentials never enter a journal: they come from MLflow's own environment variables or file at delivery time.
Each record carries its format (``"v"``: :data:`RECORD_FORMAT`), read before the record is sent; a record of a newer
format than this code reads waits, unsent and not set aside, for the ddpipe that wrote it.

The train stage's ``paths.run_info`` names the run its outputs went to by the key its journal goes by; its format
(:data:`RUN_INFO_FORMAT`) is kept here too, in a module both the train and the evaluate stage import.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpipe.config.command import CommandParser, load_or_exit, run_command
from ddpipe.core.errors import one_line
from ddpipe.core.files import atomic_write_json, atomic_write_text
from ddpipe.core.processes import alive_here, host_lock, this_process
from ddpipe.tracking.delivery import Delivery, send
from ddpipe.tracking.run_store import redact, repo_root

logger = logging.getLogger(__spec__.name)  # its dotted name under `python -m` too (there __name__ is "__main__")

PENDING = "pending-"
# The records' format, written into each as "v": one letter, where a file would say "format_version", because a
# journal holds a line for every metrics call (each epoch's, each system-metrics sample's) and repeats the key on
# each. 0: written before format versions existed (no "v"; see ddpipe.tracking.delivery.model_names); 1: a model
# record names its network and registered model (model_name, registered_model_name), never the run's whole config.
# A metrics record may carry model_epoch: figures of the run's logged model of that exported epoch, linked to it at
# delivery (ddpipe.tracking.delivery.link_to_model). Still format 1: a ddpipe from before it logs them into the run
# alone, which loses nothing of the run.
RECORD_FORMAT, FORMAT_KEY = 1, "v"
# paths.run_info (run.json), written as "format_version". 1: run_id (the store's id, or a pending key this outbox
# resolves) and tracking_uri (redacted); a file without the key (written before format versions) is format 1 too:
# it held both from the first.
RUN_INFO_FORMAT = 1
_SAID: set[tuple[str, str]] = set()  # (run key, what) said by this process
# In the outbox's directory: held to remove a delivered journal and to add a record to a journal another process
# wrote (a killed run's close, ddpipe.tracking.tracker), so that no record goes with a journal removed after a
# delivery that came before it.
REMOVAL_LOCK = ".removal.lock"
FAILURES_TO_SAY = 2  # failed attempts in a row that make an outage, said


def outbox_root(directory: str) -> Path:
    """``mlflow.outbox`` as a directory: relative paths under the repo root (the main repo's under DVC, so a
    queued experiment's records outlive its temporary workspace)."""
    path = Path(directory)
    return path if path.is_absolute() else repo_root() / path


class Journal:
    """One run's records from one process (``name``: ``main`` for rank 0 and the evaluate stage, ``node<i>``
    for another node's system metrics), appended by any thread and delivered in order."""

    def __init__(self, root: Path, run_key: str, uri: str, name: str = "main", owner: bool = True) -> None:
        self.dir = Path(root) / run_key
        self.key, self.uri, self.name = run_key, uri, name
        self.path = self.dir / f"{name}.jsonl"
        self._sent = self.dir / f"{name}.sent"
        self._lock = threading.Lock()
        self.dir.mkdir(parents=True, exist_ok=True)
        if not (self.dir / "store.json").is_file():
            atomic_write_json(self.dir / "store.json", {"tracking_uri": redact(uri)})
        if owner:  # this process writes the journal: nobody else removes it while it lives
            atomic_write_json(self.dir / f"{name}.owner", this_process())

    def written_by_live_process(self) -> bool:
        try:
            return alive_here(json.loads((self.dir / f"{self.name}.owner").read_text()))
        except (OSError, ValueError):
            return False

    # -- writing ------------------------------------------------------------------------------------

    def append(self, op: str, **fields: Any) -> None:
        """Add one record (durable once this returns: one write of one line, flushed)."""
        assert FORMAT_KEY not in fields, f"a record's field may not be named {FORMAT_KEY!r}: its format's key"
        line = json.dumps({FORMAT_KEY: RECORD_FORMAT, "op": op, **fields}, separators=(",", ":")) + "\n"
        with self._lock:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            except FileNotFoundError:  # the directory went (a delivery that found it whole removed it): again
                self.dir.mkdir(parents=True, exist_ok=True)
                if not (self.dir / "store.json").is_file():
                    atomic_write_json(self.dir / "store.json", {"tracking_uri": redact(self.uri)})
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)

    def keep_file(self, path: str | Path, name: str | None = None) -> str:
        """A copy of ``path`` beside the journal (the run's file may change before delivery); its path."""
        target = self.dir / "files" / uuid.uuid4().hex[:12] / (name or Path(path).name)  # the name it is logged as
        target.parent.mkdir(parents=True)
        shutil.copyfile(path, target)
        return str(target)

    # -- reading --------------------------------------------------------------------------------------

    @property
    def run_id(self) -> str | None:
        """The store's id of this run: the key itself, or for a pending key the id its delivery got."""
        if not self.key.startswith(PENDING):
            return self.key
        path = self.dir / "run_id"
        return path.read_text().strip() if path.is_file() else None

    def resolvable(self) -> bool:
        """Whether this run's id is known or will be: a real key, a pending key already created, or one whose
        creation still waits here (not a pending key whose journal was deleted)."""
        return self.run_id is not None or any(r["op"] == "create" for _, r in self.waiting())

    def sent_offset(self) -> int:
        return int(self._sent.read_text()) if self._sent.is_file() else 0

    def waiting(self) -> list[tuple[int, dict]]:
        """(end offset, record) of each complete line not yet delivered, in order."""
        if not self.path.is_file():
            return []
        start = self.sent_offset()
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read()
        out, pos = [], 0
        while (nl := data.find(b"\n", pos)) != -1:
            out.append((start + nl + 1, json.loads(data[pos:nl])))
            pos = nl + 1
        return out

    def deliver(self, wait: bool = False) -> Delivery:
        """Send every waiting record in order, until the store stops answering."""
        # a courier and `deliver` never send one line twice at once
        with host_lock(self.dir / f"{self.name}.lock", wait) as mine:
            if not mine:
                return Delivery(0, len(self.waiting()), None)
            return send(self)

    def mark_sent(self, offset: int) -> None:
        atomic_write_text(self._sent, str(offset))

    def set_run_id(self, run_id: str) -> None:
        atomic_write_text(self.dir / "run_id", run_id)

    def format_of(self, record: dict) -> int:
        """The format ``record`` (one of :meth:`waiting`) was written in; ValueError if it is newer than this code
        reads."""
        version = int(record.get(FORMAT_KEY, 0))
        if version > RECORD_FORMAT:
            raise ValueError(f"{self.path}: a record of format {version}, newer than this ddpipe reads (formats up "
                             f"to {RECORD_FORMAT}); it waits for the ddpipe that wrote it")
        return version

    def reject(self, record: dict, exc: BaseException) -> None:
        """Set aside a record the store refused for good, with the reason."""
        with open(self.dir / f"{self.name}.rejected.jsonl", "a") as f:
            f.write(json.dumps({"record": record, "error": f"{type(exc).__name__}: {exc}"[:2000]}) + "\n")


def write_run_info(path: str | Path, run_id: str, uri: str) -> None:
    """``paths.run_info``: the run a training's outputs went to (``run_id``: the store's id, or a pending key) and
    its store (``uri``, written redacted)."""
    atomic_write_json(path, {"format_version": RUN_INFO_FORMAT, "run_id": run_id, "tracking_uri": redact(uri)})


def read_run_info(path: str | Path) -> dict[str, Any]:
    """What :func:`write_run_info` wrote, its format read first: ValueError if it is newer than this code reads."""
    info = json.loads(Path(path).read_text())
    version = int(info.get("format_version", 1))
    if version > RUN_INFO_FORMAT:
        raise ValueError(f"{path}: run-info format {version} is newer than this ddpipe reads (formats up to "
                         f"{RUN_INFO_FORMAT}): evaluate with the ddpipe that trained the model")
    return info


def new_key() -> str:
    """A run's local key until the store gives it an id."""
    return f"{PENDING}{uuid.uuid4().hex}"


class Courier:
    """Delivers a journal in the background: at once when a record is added, with backoff while the store does
    not answer (said once per outage, and once when it answers again; a failure that the next attempt, a second
    later, gets past is a blip, not an outage: a restarted server's stale pooled connections, one slow answer).
    ``others``: first, what earlier runs left waiting in the same outbox (a training or evaluate stage after an
    outage sends it)."""

    def __init__(self, journal: Journal, say: Callable[[str], None] | None = None, others: bool = False) -> None:
        self.journal, self.others = journal, others
        # records that wait (the store down, or still down at the end), and the end of that wait: warnings
        self._say = say or logger.warning
        self._wake, self._stop = threading.Event(), threading.Event()
        self._down_since: float | None = None  # when the attempts began to fail
        self._failed = 0  # failed attempts in a row: an outage, said, from FAILURES_TO_SAY on
        self._thread = threading.Thread(target=self._loop, name=f"ddpipe-outbox-{journal.name}", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        self._wake.set()

    def say(self, text: str, about: str) -> None:
        """Say ``text`` once per run and process (a node's journals, main and system metrics, share one outage)."""
        if (self.journal.key, about) not in _SAID:
            _SAID.add((self.journal.key, about))
            self._say(text)

    def _loop(self) -> None:
        if self.others:
            with contextlib.suppress(Exception):  # best effort: what fails waits for the next stage
                deliver_all(self.journal.dir.parent, skip=self.journal, wait=False)
        backoff = 1.0
        while not self._stop.is_set():
            self._wake.wait(timeout=None if self._down_since is None else backoff)
            self._wake.clear()
            if self._stop.is_set():
                return
            self._attempt()
            backoff = 1.0 if self._down_since is None else min(30.0, backoff * 2)

    def _attempt(self, wait: bool = False) -> Delivery:
        try:
            result = self.journal.deliver(wait)
        except Exception as exc:  # whatever the store or the disk says, tracking never takes training down
            result = Delivery(0, len(self.journal.waiting()), exc)
        if result.error is not None:
            self._failed += 1
            if self._down_since is None:
                self._down_since = time.monotonic()
            if self._failed == FAILURES_TO_SAY:
                self.say(f"MLflow: the store at {redact(self.journal.uri)} does not answer ({describe(result.error)}); "
                         f"the run's records wait in {self.journal.dir} and go when it answers (training goes on)",
                         "down")
                _SAID.discard((self.journal.key, "back"))
        elif self._down_since is not None:
            if self._failed >= FAILURES_TO_SAY:
                self.say(f"MLflow: the store answers again after {time.monotonic() - self._down_since:.0f} s; the "
                         "records that waited were delivered in order", "back")
                _SAID.discard((self.journal.key, "down"))
            self._down_since, self._failed = None, 0
        return result

    def close(self, timeout_s: float = 60.0) -> Delivery:
        """Stop the thread and make a last delivery (bounded by the HTTP timeouts); say once what still waits and
        how to send it; remove the journal once the store has all of it."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s)
        result = self._attempt(wait=True)
        for pause in (1.0, 2.0):  # a restarted server's first answers fail on stale pooled connections
            if result.error is None:
                break
            time.sleep(pause)
            result = self._attempt(wait=True)
        if self.others and result.error is None:  # what was added to other runs meanwhile (a killed run's close)
            with contextlib.suppress(Exception):  # only to this store, which answers, never waiting for a lock
                deliver_all(self.journal.dir.parent, skip=self.journal, wait=False, only_uri=self.journal.uri)
        if result.waiting:
            self.say(f"MLflow: {result.waiting} record(s) of run {self.journal.key} wait in {self.journal.dir}: the "
                     f"store at {redact(self.journal.uri)} did not answer ({describe(result.error)}). The next "
                     "training or evaluate stage sends them, or now: ddpipe outbox deliver", "left")
        else:
            remove_if_delivered(self.journal, by_writer=True)
        return result


def describe(exc: BaseException | None) -> str:
    if exc is None:
        return "busy"
    return redact(one_line(exc, 200))


def journals(root: Path) -> list[Journal]:
    """Every journal under ``root`` (main journals first: another node's journal of a pending run needs the id
    the main one's delivery gets)."""
    found = []
    for path in sorted(Path(root).glob("*/*.jsonl")):
        if path.name.endswith(".rejected.jsonl"):
            continue
        store = json.loads((path.parent / "store.json").read_text()) if (path.parent / "store.json").is_file() \
            else {}
        found.append(Journal(root, path.parent.name, store.get("tracking_uri", ""), path.stem, owner=False))
    return sorted(found, key=lambda j: (j.name != "main", j.key))


def deliver_all(root: Path, uri: str | None = None, skip: Journal | None = None, wait: bool = True,
                only_uri: str | None = None) -> tuple[int, int]:
    """Deliver every journal under ``root`` but ``skip`` (to ``uri`` where given, else each journal's own store;
    ``only_uri``: only the journals of that store; ``wait``: for a journal another process is delivering): (sent,
    still waiting). A journal the store has whole is removed, unless a live process still writes it."""
    sent = waiting = 0
    for journal in journals(root):
        if skip is not None and (journal.key, journal.name) == (skip.key, skip.name):
            continue
        if only_uri is not None and journal.uri != redact(only_uri):
            continue
        if uri:
            journal.uri = uri
        result = journal.deliver(wait=wait)
        sent, waiting = sent + result.sent, waiting + result.waiting
        if not result.waiting:
            remove_if_delivered(journal)
    return sent, waiting


def removal_lock(root: Path) -> contextlib.AbstractContextManager[bool]:
    """The lock of the outbox ``root`` on removing journals (:data:`REMOVAL_LOCK`)."""
    return host_lock(Path(root) / REMOVAL_LOCK)


def remove_if_delivered(journal: Journal, by_writer: bool = False) -> bool:
    """Remove ``journal`` (:func:`finished`) if the store has all of it and, unless ``by_writer``, no live process
    writes it; looked at again under :func:`removal_lock`: a record another process added since the delivery keeps
    the journal for the next one."""
    with removal_lock(journal.dir.parent):
        if journal.waiting() or (not by_writer and journal.written_by_live_process()):
            return False
        finished(journal)
        return True


def finished(journal: Journal) -> None:
    """Remove a delivered journal, and its run's directory (copied files included) once no journal of it waits
    and none was set aside."""
    for suffix in (".jsonl", ".sent", ".lock", ".owner"):
        (journal.dir / f"{journal.name}{suffix}").unlink(missing_ok=True)
    if not any(journal.dir.glob("*.jsonl")):
        shutil.rmtree(journal.dir, ignore_errors=True)


def arguments(parser: CommandParser) -> None:
    """``ddpipe outbox``'s arguments: deliver or status, and the overrides."""
    parser.description = "The MLflow records that wait in this repository's outbox (mlflow.outbox) for their store."
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, what in (("deliver", "send what waits to its store (exit 1 while some still waits)"),
                       ("status", "what waits, per run and journal")):
        command = sub.add_parser(name, help=what, description=what)
        command.add_overrides("key=value, as for the stages (e.g. mlflow.outbox=...)")
        command.set_defaults(run=outbox)


def main(argv: list[str] | None = None) -> int:
    """``ddpipe outbox deliver | status``."""
    return run_command("ddpipe outbox", arguments, argv)


def outbox(args: argparse.Namespace) -> int:
    """``deliver`` or ``status`` of the outbox of this repository (``mlflow.outbox``): the command's result on
    stdout."""
    from ddpipe.tracking.run_store import bound_http_requests, tracking_uri

    cfg = load_or_exit(args.overrides, "-m ddpipe.outbox")
    root = outbox_root(cfg.mlflow.outbox)
    if args.command == "status":
        for journal in journals(root):
            print(f"{journal.key} {journal.name}: {len(journal.waiting())} record(s) waiting for "
                  f"{redact(journal.uri)}")
        return 0
    bound_http_requests()
    env_uri = os.environ.get("MLFLOW_TRACKING_URI")
    sent, waiting = deliver_all(root, env_uri or None)
    print(f"delivered {sent} record(s) from {root}; {waiting} still waiting"
          + ("" if not waiting else f" (the store at {redact(env_uri or tracking_uri(cfg.mlflow))} did not answer)"))
    return 0 if not waiting else 1


if __name__ == "__main__":
    raise SystemExit(main())
